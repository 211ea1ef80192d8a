/* RMSNorm (with the fused residual add) and neox rotary embedding for CPU pods.
 *
 * Built with paged_decode.c into one library (kernels/native/__init__.py).
 * Through torch ops each of these is 8-10 small ops per call; at decode
 * batch sizes their dispatch cost, not their arithmetic, is what a step
 * pays. Same contracts as kernels.dispatch.rms_norm / rotary_embedding:
 * float32 math, results rounded to the tensor dtype (float32, bfloat16,
 * float16), new output tensors, inputs untouched. Rows may be strided
 * (a row stride in elements); within a row, elements are contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "exports.h"
#include "rope.h"

/* Rows are shared among `num_threads` from PARALLEL_ROWS rows (a prompt's
 * chunk): a row's result does not depend on who computes it. Below, one
 * thread: a decode step's few rows cost less than waking a team (~60 norms
 * a step). Rows in blocks of ROW_BLOCK claimed as threads come free, so a
 * thread that loses its core does not hold up the others. */
#define PARALLEL_ROWS 64
#define ROW_BLOCK 16

static int team_for(long rows, int num_threads) {
  return rows >= PARALLEL_ROWS && num_threads > 1 ? num_threads : 1;
}

/* y = r / sqrt(mean(r^2) + eps) * w with r = x (+ residual, rounded to ELEM). */
#define DEFINE_RMS_NORM(NAME, ELEM, LOAD, STORE)                                           \
  static void NAME(const ELEM *x, long x_stride, const ELEM *residual, long res_stride,     \
                   const ELEM *weight, ELEM *out, ELEM *res_out, long rows, long hidden,   \
                   float eps, int num_threads) {                                           \
    _Pragma("omp parallel for num_threads(team_for(rows, num_threads)) schedule(dynamic, ROW_BLOCK)") \
    for (long i = 0; i < rows; i++) {                                                      \
      const ELEM *xr = x + i * x_stride;                                                   \
      ELEM *o = out + i * hidden;                                                          \
      float sum = 0.0f;                                                                    \
      if (residual != NULL) {                                                              \
        const ELEM *rr = residual + i * res_stride;                                        \
        ELEM *ro = res_out + i * hidden;                                                   \
        for (long j = 0; j < hidden; j++) {                                                \
          const ELEM r = STORE(LOAD(xr[j]) + LOAD(rr[j]));                                 \
          ro[j] = r;                                                                       \
          const float rf = LOAD(r);                                                        \
          sum += rf * rf;                                                                  \
        }                                                                                  \
        xr = ro;                                                                           \
      } else {                                                                             \
        for (long j = 0; j < hidden; j++) {                                                \
          const float rf = LOAD(xr[j]);                                                    \
          sum += rf * rf;                                                                  \
        }                                                                                  \
      }                                                                                    \
      const float inv_rms = 1.0f / sqrtf(sum / (float)hidden + eps);                       \
      for (long j = 0; j < hidden; j++)                                                    \
        o[j] = STORE(LOAD(xr[j]) * inv_rms * LOAD(weight[j]));                             \
    }                                                                                      \
  }

DEFINE_RMS_NORM(rms_norm_f32, float, F32_LOAD, F32_STORE)
DEFINE_RMS_NORM(rms_norm_bf16, uint16_t, bf16_to_f32, f32_to_bf16)
DEFINE_RMS_NORM(rms_norm_f16, _Float16, F16_LOAD, F16_STORE)

/* dtype: 0 float32, 1 bfloat16, 2 float16; residual/res_out NULL for none. */
int pdserve_rms_norm(const void *x, long x_stride, const void *residual, long res_stride,
                     const void *weight, void *out, void *res_out, long rows, long hidden,
                     float eps, int dtype, int num_threads) {
  switch (dtype) {
    case 0:
      rms_norm_f32(x, x_stride, residual, res_stride, weight, out, res_out, rows, hidden, eps,
                   num_threads);
      return 0;
    case 1:
      rms_norm_bf16(x, x_stride, residual, res_stride, weight, out, res_out, rows, hidden, eps,
                    num_threads);
      return 0;
    case 2:
      rms_norm_f16(x, x_stride, residual, res_stride, weight, out, res_out, rows, hidden, eps,
                   num_threads);
      return 0;
    default:
      return 2;
  }
}

/* Neox rotary of every head of every row (rope.h); cos/sin from cache[pos]. */
#define DEFINE_ROTARY(NAME, ELEM, ROPE_HEAD)                                               \
  static void NAME(const ELEM *x, long x_stride, ELEM *out, long rows, long heads,         \
                   long head_dim, const int64_t *positions, const float *cache,            \
                   int num_threads) {                                                      \
    const long half = head_dim / 2;                                                        \
    _Pragma("omp parallel for num_threads(team_for(rows, num_threads)) schedule(dynamic, ROW_BLOCK)") \
    for (long i = 0; i < rows; i++) {                                                      \
      const float *cos = cache + positions[i] * head_dim;                                  \
      for (long h = 0; h < heads; h++)                                                     \
        ROPE_HEAD(x + i * x_stride + h * head_dim, out + (i * heads + h) * head_dim, half, \
                  cos, cos + half);                                                        \
    }                                                                                      \
  }

DEFINE_ROTARY(rotary_f32, float, rope_head_f32)
DEFINE_ROTARY(rotary_bf16, uint16_t, rope_head_bf16)
DEFINE_ROTARY(rotary_f16, _Float16, rope_head_f16)

/* Rotates q [rows, q_heads, D] and k [rows, k_heads, D] into q_out / k_out
 * (contiguous). Returns 3 if a position is outside [0, max_positions). */
int pdserve_rotary_embedding(const int64_t *positions, const void *q, long q_stride,
                             const void *k, long k_stride, void *q_out, void *k_out, long rows,
                             long q_heads, long k_heads, long head_dim, const float *cache,
                             long max_positions, int dtype, int num_threads) {
  for (long i = 0; i < rows; i++)
    if (positions[i] < 0 || positions[i] >= max_positions) return 3;
  switch (dtype) {
    case 0:
      rotary_f32(q, q_stride, q_out, rows, q_heads, head_dim, positions, cache, num_threads);
      rotary_f32(k, k_stride, k_out, rows, k_heads, head_dim, positions, cache, num_threads);
      return 0;
    case 1:
      rotary_bf16(q, q_stride, q_out, rows, q_heads, head_dim, positions, cache, num_threads);
      rotary_bf16(k, k_stride, k_out, rows, k_heads, head_dim, positions, cache, num_threads);
      return 0;
    case 2:
      rotary_f16(q, q_stride, q_out, rows, q_heads, head_dim, positions, cache, num_threads);
      rotary_f16(k, k_stride, k_out, rows, k_heads, head_dim, positions, cache, num_threads);
      return 0;
    default:
      return 2;
  }
}

/* KV inject: cache[kv][slot] = src[kv][t] for both halves (kv = 0: K, 1: V)
 * and every token t with slot = slots[t] >= 0 (negative: padding, skipped).
 * A cache row is `row_bytes` (Hkv * D elements); src rows may be strided
 * (`src_row_stride` bytes apart, V rows `src_kv_stride` bytes after K rows).
 * Returns 3, having written nothing, if a slot is >= num_slots. */
int pdserve_inject_kv(void *cache, const void *src, long src_kv_stride, long src_row_stride,
                      const int64_t *slots, long num_tokens, long row_bytes, long num_slots) {
  for (long t = 0; t < num_tokens; t++)
    if (slots[t] >= num_slots) return 3;
  char *k_cache = cache, *v_cache = (char *)cache + num_slots * row_bytes;
  const char *k_src = src, *v_src = (const char *)src + src_kv_stride;
  for (long t = 0; t < num_tokens; t++) {
    if (slots[t] < 0) continue;
    memcpy(k_cache + slots[t] * row_bytes, k_src + t * src_row_stride, row_bytes);
    memcpy(v_cache + slots[t] * row_bytes, v_src + t * src_row_stride, row_bytes);
  }
  return 0;
}
