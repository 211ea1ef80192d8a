/* Fused ops of the CPU decode step: SwiGLU's activation and the attention
 * block of a decode step from the qkv projection's output.
 *
 * Built with the other sources into one library (kernels/native/loader.py).
 * A CPU decode step at batch 8 streams ~10-20 MB of weights per linear,
 * which evicts everything the small ops between two linears touch, so each
 * of those ops pays cold caches for its own Python and torch dispatch as
 * much as for its data (docs/kernels.md, "Fused decode ops"). These turn
 * what lies between two linears into one call each.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"
#include "exports.h"
#include "paged_decode_simd.h" /* exp8 */
#include "rope.h"
#include "vec.h"

/* Rows worth a second thread: below this many elements the fork costs more. */
#define SILU_PARALLEL_MIN (1L << 16)

/* out[i, j] = silu(x[i, j]) * x[i, inter + j]. silu(g) = g / (1 + exp(-g)) in
 * float32, rounded to the element type before the product, as torch's
 * `F.silu(gate) * up` rounds. `inter` a multiple of 16 takes the vector path. */
#define DEFINE_SILU_MUL(NAME, ELEM, LOADV, STOREV, ROUNDV, LOAD, STORE)                   \
  static void NAME(const ELEM *x, long x_stride, ELEM *out, long rows, long inter,         \
                   int num_threads) {                                                      \
    if (rows * inter < SILU_PARALLEL_MIN) num_threads = 1;                                 \
    _Pragma("omp parallel for num_threads(num_threads) schedule(static)")                  \
    for (long i = 0; i < rows; i++) {                                                      \
      const ELEM *gate = x + i * x_stride, *up = gate + inter;                             \
      ELEM *o = out + i * inter;                                                           \
      long j = 0;                                                                          \
      for (; j + LANES <= inter; j += LANES) {                                             \
        const vfloat g = LOADV(gate + j), u = LOADV(up + j);                               \
        STOREV(o + j, ROUNDV(g / (1.0f + vexp(-g))) * u);                                  \
      }                                                                                    \
      for (; j < inter; j++) {                                                             \
        const float g = LOAD(gate[j]);                                                     \
        o[j] = STORE(LOAD(STORE(g / (1.0f + expf(-g)))) * LOAD(up[j]));                    \
      }                                                                                    \
    }                                                                                      \
  }

#if defined(__AVX512F__)
/* AVX-512: 16 lanes at a time with paged_decode_avx512.h's exp16 (GCC's
 * lowering of vec.h's vexp left the bfloat16 path at ~2x the float32 one:
 * 9 against 4 us for a batch-8 row block of SmolLM2, and a 2,048-row
 * bfloat16 prefill layer 1.13 ms against 0.74 now). */
static inline __m512 silu16(__m512 g) {
  const __m512 minus_g = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u)));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(minus_g)));
}

/* v rounded to bfloat16 (nearest even; NaN stays NaN, quieted: dtypes.h's
 * rule), still as float32 bits (the low 16 zero). */
static inline __m512i bf16_rounded16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v), low = _mm512_set1_epi32((int)0xffff0000u);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(
      _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), low);
  const __m512i quiet = _mm512_and_si512(_mm512_or_si512(bits, _mm512_set1_epi32(0x400000)), low);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet);
}

static inline __m512 load_bf16x16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* silu rounded to bfloat16 before the product, as torch's F.silu(gate) * up. */
static void silu_mul_bf16(const uint16_t *x, long x_stride, uint16_t *out, long rows,
                          long inter, int num_threads) {
  if (rows * inter < SILU_PARALLEL_MIN) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long i = 0; i < rows; i++) {
    const uint16_t *gate = x + i * x_stride, *up = gate + inter;
    uint16_t *o = out + i * inter;
    long j = 0;
    for (; j + 16 <= inter; j += 16) {
      const __m512 silu = _mm512_castsi512_ps(bf16_rounded16(silu16(load_bf16x16(gate + j))));
      const __m512i product = bf16_rounded16(_mm512_mul_ps(silu, load_bf16x16(up + j)));
      _mm256_storeu_si256((__m256i *)(o + j),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(product, 16)));
    }
    for (; j < inter; j++) {
      const float g = bf16_to_f32(gate[j]);
      o[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g)))) * bf16_to_f32(up[j]));
    }
  }
}
#else
DEFINE_SILU_MUL(silu_mul_bf16, uint16_t, load_bf16, store_bf16, round_bf16, bf16_to_f32,
                f32_to_bf16)
#endif

/* float32: the same arithmetic, 16 lanes with exp16 on AVX-512, 8 with
 * exp8 on AVX2 (GCC compiles the 16-lane vexp to AVX2 with spills: SiLU
 * was ~1.2 ms of a batch-8 decode step of the base model), else vec.h's
 * 16-lane vectors. */
static void silu_mul_f32(const float *x, long x_stride, float *out, long rows, long inter,
                         int num_threads) {
  if (rows * inter < SILU_PARALLEL_MIN) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long i = 0; i < rows; i++) {
    const float *gate = x + i * x_stride, *up = gate + inter;
    float *o = out + i * inter;
    long j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= inter; j += 16)
      _mm512_storeu_ps(o + j, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + j)),
                                            _mm512_loadu_ps(up + j)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= inter; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
      _mm256_storeu_ps(o + j, _mm256_mul_ps(silu, _mm256_loadu_ps(up + j)));
    }
#else
    for (; j + LANES <= inter; j += LANES) {
      const vfloat g = load_f32(gate + j);
      store_f32(o + j, g / (1.0f + vexp(-g)) * load_f32(up + j));
    }
#endif
    for (; j < inter; j++) o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
  }
}
DEFINE_SILU_MUL(silu_mul_f16, _Float16, load_f16, store_f16, round_f16, F16_LOAD, F16_STORE)

/* x [rows, 2 * inter] (rows `x_stride` elements apart) -> out [rows, inter]
 * contiguous. dtype: 0 float32, 1 bfloat16, 2 float16. */
int pdserve_silu_and_mul(const void *x, long x_stride, void *out, long rows, long inter,
                         int dtype, int num_threads) {
  switch (dtype) {
    case 0: silu_mul_f32(x, x_stride, out, rows, inter, num_threads); return 0;
    case 1: silu_mul_bf16(x, x_stride, out, rows, inter, num_threads); return 0;
    case 2: silu_mul_f16(x, x_stride, out, rows, inter, num_threads); return 0;
    default: return 2;
  }
}

/* Each row's q heads rotated in place, its k heads rotated into the K cache
 * row of its slot and its v heads copied into the V row; a negative slot
 * (padding) writes nothing. */
#define DEFINE_ROPE_INJECT(NAME, ELEM, ROPE_HEAD)                                          \
  static void NAME(ELEM *qkv, long qkv_stride, const int64_t *positions,                   \
                   const float *cos_sin, const int64_t *slots, ELEM *cache,                \
                   long num_slots, long rows, long q_heads, long kv_heads, long head_dim) { \
    const long half = head_dim / 2, row = kv_heads * head_dim;                             \
    for (long i = 0; i < rows; i++) {                                                      \
      ELEM *q = qkv + i * qkv_stride, *k = q + q_heads * head_dim, *v = k + row;           \
      const float *cos = cos_sin + positions[i] * head_dim, *sin = cos + half;             \
      for (long h = 0; h < q_heads; h++)                                                   \
        ROPE_HEAD(q + h * head_dim, q + h * head_dim, half, cos, sin);                     \
      if (slots[i] < 0) continue;                                                          \
      ELEM *k_row = cache + slots[i] * row, *v_row = k_row + num_slots * row;              \
      for (long h = 0; h < kv_heads; h++)                                                  \
        ROPE_HEAD(k + h * head_dim, k_row + h * head_dim, half, cos, sin);                 \
      memcpy(v_row, v, row * sizeof(ELEM));                                                \
    }                                                                                      \
  }

DEFINE_ROPE_INJECT(rope_inject_f32, float, rope_head_f32)
DEFINE_ROPE_INJECT(rope_inject_bf16, uint16_t, rope_head_bf16)
DEFINE_ROPE_INJECT(rope_inject_f16, _Float16, rope_head_f16)

/* The attention block of a decode step, from the qkv projection's output:
 *   qkv [B, (Hq + 2 Hkv) * D] (rows `qkv_stride` elements apart; q, k, v
 *   columns in that order) -> RoPE of q and k at `positions` (int64 [B],
 *   cos_sin float32 [max_positions, D]), K and V into the cache at `slots`
 *   (int64 [B], negative: padding, not written), then decode attention
 *   (paged_decode.c) of the rotated q over `tables` / `lens` into out
 *   [B, Hq, D] contiguous.
 * The per-layer arguments come first, the step's after them. The q columns
 * of qkv are left rotated (qkv is the caller's scratch).
 * Returns 3, having written nothing, if a position is outside
 * [0, max_positions) or a slot is >= num_blocks * block_size; otherwise the
 * attention's status. */
int pdserve_decode_qkv_attention(void *qkv, long qkv_stride, void *cache, void *out,
                                 const int64_t *positions, const float *cos_sin,
                                 long max_positions, const int64_t *slots,
                                 const int32_t *tables, const int32_t *lens, int dtype,
                                 int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                 int num_blocks, int block_size, int table_width,
                                 long table_stride, int window, float scale, float softcap,
                                 int num_threads) {
  const long num_slots = (long)num_blocks * block_size;
  for (int i = 0; i < batch; i++)
    if (positions[i] < 0 || positions[i] >= max_positions || slots[i] >= num_slots) return 3;
  if (head_dim % 2 != 0) return 2;
  switch (dtype) {
    case 0:
      rope_inject_f32(qkv, qkv_stride, positions, cos_sin, slots, cache, num_slots, batch,
                      num_q_heads, num_kv_heads, head_dim);
      break;
    case 1:
      rope_inject_bf16(qkv, qkv_stride, positions, cos_sin, slots, cache, num_slots, batch,
                       num_q_heads, num_kv_heads, head_dim);
      break;
    case 2:
      rope_inject_f16(qkv, qkv_stride, positions, cos_sin, slots, cache, num_slots, batch,
                      num_q_heads, num_kv_heads, head_dim);
      break;
    default:
      return 2;
  }
  return pdserve_paged_decode_attention(qkv, qkv_stride, cache, tables, lens, out, dtype,
                                        batch, num_q_heads, num_kv_heads, head_dim,
                                        num_blocks, block_size, table_width, table_stride,
                                        window, scale, softcap, num_threads);
}
