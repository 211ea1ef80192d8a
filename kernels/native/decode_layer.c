/* A whole decoder layer of a CPU decode step in one call: the Llama layer's
 * eight kernels in the order the model calls them, each the same exported
 * function the model's Python calls one at a time, on the same rows.
 *
 * Built with the other sources into one library (kernels/native/loader.py;
 * the caller is engine/decode_layers.py). Why: a decode step of a small
 * model makes ~8 calls per layer, and each call's Python side (module call,
 * wrapper, ctypes, an output tensor) costs microseconds that add up to
 * ~10 % of a SmolLM2 step at batch 8 (docs/engine.md, "Decode layers").
 * Calling the same kernels on the same inputs gives the same bits.
 *
 * Per layer, with hidden and residual [B, H] updated in place:
 *   hidden, residual = rms_norm(hidden + residual), hidden + residual
 *                      (the first layer: residual = hidden, then the norm)
 *   qkv    = hidden @ Wqkv (+ b)                  [B, (Hq + 2 Hkv) D]
 *   attn   = decode_qkv_attention(qkv, ...)        [B, Hq D]
 *   hidden = attn @ Wo (+ b)
 *   hidden, residual = rms_norm(hidden + residual), hidden + residual
 *   gu     = hidden @ Wgate_up                     [B, 2 I]
 *   act    = silu(gu[:, :I]) * gu[:, I:]           [B, I]
 *   hidden = act @ Wdown
 * Arguments come as two int64 arrays (pointers and sizes; the indices are
 * the L_* and S_* names below, kept in order with engine/decode_layers.py)
 * and the floats, so one ctypes call carries them.
 */
#include <stdint.h>
#include <string.h>

#include "exports.h"

/* The layer's array: its weights (packed panels, float32 biases or 0), norm
 * weights, KV cache and attention window. */
enum { L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS, L_O, L_O_BIAS, L_GATE_UP, L_DOWN, L_CACHE,
       L_WINDOW, L_COUNT };
/* The step's array: rows and sizes, the attention's step arguments, buffers. */
enum { S_BATCH, S_DTYPE, S_HIDDEN_SIZE, S_Q_HEADS, S_KV_HEADS, S_HEAD_DIM, S_INTER,
       S_HIDDEN, S_RESIDUAL, S_QKV_BUF, S_ATTN_BUF, S_GATE_UP_BUF, S_ACT_BUF,
       S_POSITIONS, S_COS_SIN, S_MAX_POSITIONS, S_SLOTS, S_TABLES, S_LENS, S_NUM_BLOCKS,
       S_BLOCK_SIZE, S_TABLE_WIDTH, S_TABLE_STRIDE, S_THREADS, S_FIRST, S_COUNT };

#define P(a, i) ((void *)(intptr_t)(a)[i])

static int gemm(int dtype, const void *x, long M, const void *panels, long K, long N,
                const float *bias, void *out, int threads) {
  if (dtype == 1)
    return pdserve_gemm_panels_bf16(x, K, M, panels, K, N, bias, out, N, threads);
  return pdserve_gemm_panels(x, K, M, panels, K, N, bias, out, N, threads);
}

/* Returns 0, or the first failing kernel's status. `first`: this is the
 * model's first layer (no residual yet). */
int pdserve_decode_layer(const int64_t *layer, const int64_t *step, float eps, float scale,
                         float softcap) {
  const long B = step[S_BATCH], H = step[S_HIDDEN_SIZE], I = step[S_INTER];
  const int dtype = (int)step[S_DTYPE], threads = (int)step[S_THREADS];
  const int Hq = (int)step[S_Q_HEADS], Hkv = (int)step[S_KV_HEADS], D = (int)step[S_HEAD_DIM];
  const long qkv_n = (long)(Hq + 2 * Hkv) * D, q_size = (long)Hq * D;
  void *hidden = P(step, S_HIDDEN), *residual = P(step, S_RESIDUAL);
  void *qkv = P(step, S_QKV_BUF), *attn = P(step, S_ATTN_BUF);
  void *gate_up = P(step, S_GATE_UP_BUF), *act = P(step, S_ACT_BUF);
  int code;
  if (step[S_FIRST]) {
    memcpy(residual, hidden, (size_t)(B * H) * (dtype == 0 ? 4 : 2));
    code = pdserve_rms_norm(hidden, H, NULL, 0, P(layer, L_IN_NORM), hidden, NULL, B, H, eps,
                            dtype, threads);
  } else {
    code = pdserve_rms_norm(hidden, H, residual, H, P(layer, L_IN_NORM), hidden, residual, B,
                            H, eps, dtype, threads);
  }
  if (code) return code;
  if ((code = gemm(dtype, hidden, B, P(layer, L_QKV), H, qkv_n, P(layer, L_QKV_BIAS), qkv,
                   threads)))
    return code;
  if ((code = pdserve_decode_qkv_attention(
           qkv, qkv_n, P(layer, L_CACHE), attn, P(step, S_POSITIONS), P(step, S_COS_SIN),
           step[S_MAX_POSITIONS], P(step, S_SLOTS), P(step, S_TABLES), P(step, S_LENS), dtype,
           (int)B, Hq, Hkv, D, (int)step[S_NUM_BLOCKS], (int)step[S_BLOCK_SIZE],
           (int)step[S_TABLE_WIDTH], step[S_TABLE_STRIDE], (int)layer[L_WINDOW], scale, softcap,
           threads)))
    return code;
  if ((code = gemm(dtype, attn, B, P(layer, L_O), q_size, H, P(layer, L_O_BIAS), hidden,
                   threads)))
    return code;
  if ((code = pdserve_rms_norm(hidden, H, residual, H, P(layer, L_POST_NORM), hidden, residual,
                               B, H, eps, dtype, threads)))
    return code;
  if ((code = gemm(dtype, hidden, B, P(layer, L_GATE_UP), H, 2 * I, NULL, gate_up, threads)))
    return code;
  if ((code = pdserve_silu_and_mul(gate_up, 2 * I, act, B, I, dtype, threads))) return code;
  return gemm(dtype, act, B, P(layer, L_DOWN), I, H, NULL, hidden, threads);
}
