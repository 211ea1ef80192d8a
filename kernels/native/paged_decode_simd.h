/* The inner loops of paged_decode.c, on K and V rows already float32 (in
 * the cache, or converted into scratch):
 *   dot_tile          TILE scores: q . k[j] for j < TILE;
 *   softmax_row       a row of scores into probabilities (soft-capped
 *                     first); entries n .. n + CHUNK - 1 (a short last
 *                     chunk's) become 0, so the value pass takes whole chunks;
 *   accumulate_group  acc[g] += sum_j p[g][j] v[j] over CHUNK rows, for the
 *                     query heads g of one KV head;
 *   *_to_floats       a row of bfloat16 / float16 as float32.
 * AVX-512F where the compiler targets it (paged_decode_avx512.h: TILE 16),
 * else AVX2 + FMA (+ F16C for float16; TILE 8), else the portable 16-lane
 * GCC vectors of vec.h (the library is built with -march=native). Each
 * path sums in its own order (lanes, accumulator split, reduction tree),
 * so their results differ in the last bits; every one is checked against
 * the torch reference. D is a multiple of 16 throughout.
 */
#ifndef PDSERVE_NATIVE_PAGED_DECODE_SIMD_H
#define PDSERVE_NATIVE_PAGED_DECODE_SIMD_H

#include <math.h>
#include <stdint.h>

#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define TILE 16 /* scores reduced together: one AVX-512 register */
#else
#define TILE 8 /* scores reduced together: one AVX2 register */
#endif
#define CHUNK 32 /* tokens per step of a pass: whole tiles */

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) per lane, as vec.h's vexp (Cephes' polynomial on x - n ln2, 2^n
 * in the exponent bits), written for 8 lanes: GCC lowers the 16-lane
 * version to AVX2 with spills and lane-by-lane inserts. */
static inline __m256 exp8(__m256 x) {
  /* min/max return their second operand, x, when either is NaN: NaN stays NaN */
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-87.3365447504f), x);
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                   _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* tanh(x) per lane, as vec.h's vtanh. */
static inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f)), ax = _mm256_xor_ps(x, sign);
  const __m256 e = exp8(_mm256_add_ps(ax, ax)), one = _mm256_set1_ps(1.0f);
  const __m256 large =
      _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  const __m256 s = _mm256_mul_ps(x, x);
  __m256 p = _mm256_set1_ps(-5.70498872745e-3f);
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-5.37397155531e-2f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, s), x, x);
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_xor_ps(large, sign), small, is_small);
}

static inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float lanes_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

#endif

#if defined(__AVX512F__)
#include "paged_decode_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
/* Eight accumulators (enough to cover the FMA latency), reduced together at
 * the end rather than one horizontal sum per score. */
static inline void dot_tile(const float *q, const float *const k[TILE], int D, float *out) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0,
         s7 = s0;
  for (int d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    s0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[0] + d), s0);
    s1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[1] + d), s1);
    s2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[2] + d), s2);
    s3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[3] + d), s3);
    s4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[4] + d), s4);
    s5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[5] + d), s5);
    s6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[6] + d), s6);
    s7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k[7] + d), s7);
  }
  /* hadd adds neighbouring lanes within each 128-bit half: after two
   * rounds lane j of u0 (j < 4) holds s_j's low-half sum and lane 4 + j its
   * high-half sum, u1 the same for s4..s7; adding the halves gives
   * [sum s0, ..., sum s7]. */
  const __m256 t0 = _mm256_hadd_ps(s0, s1), t1 = _mm256_hadd_ps(s2, s3);
  const __m256 t2 = _mm256_hadd_ps(s4, s5), t3 = _mm256_hadd_ps(s6, s7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                      _mm256_permute2f128_ps(u0, u1, 0x31)));
}

/* 64 dims at a time, their sums in eight registers over the whole chunk
 * (one broadcast weight and eight FMAs per row); then 16 at a time, two
 * interleaved sums per register to halve the dependency chain. */
static inline void accumulate(float *acc, const float *p, const float *const v[CHUNK], int D) {
  int d = 0;
  for (; d + 64 <= D; d += 64) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8),
           a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24),
           a4 = _mm256_loadu_ps(acc + d + 32), a5 = _mm256_loadu_ps(acc + d + 40),
           a6 = _mm256_loadu_ps(acc + d + 48), a7 = _mm256_loadu_ps(acc + d + 56);
    for (int j = 0; j < CHUNK; j++) {
      const __m256 w = _mm256_broadcast_ss(p + j);
      const float *x = v[j] + d;
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 24), a3);
      a4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 32), a4);
      a5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 40), a5);
      a6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 48), a6);
      a7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 56), a7);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
    _mm256_storeu_ps(acc + d + 32, a4);
    _mm256_storeu_ps(acc + d + 40, a5);
    _mm256_storeu_ps(acc + d + 48, a6);
    _mm256_storeu_ps(acc + d + 56, a7);
  }
  for (; d < D; d += 16) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 b0 = _mm256_setzero_ps(), b1 = b0;
    for (int j = 0; j < CHUNK; j += 2) {
      const __m256 w = _mm256_broadcast_ss(p + j), u = _mm256_broadcast_ss(p + j + 1);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + d), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[j] + d + 8), a1);
      b0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v[j + 1] + d), b0);
      b1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(v[j + 1] + d + 8), b1);
    }
    _mm256_storeu_ps(acc + d, _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(acc + d + 8, _mm256_add_ps(a1, b1));
  }
}

static inline void softmax_row(float *row, int n, float softcap) {
  const int full = n - n % 8;
  if (softcap > 0.0f) {
    const __m256 cap = _mm256_set1_ps(softcap);
    for (int i = 0; i < full; i += 8) {
      const __m256 x = _mm256_div_ps(_mm256_loadu_ps(row + i), cap);
      _mm256_storeu_ps(row + i, _mm256_mul_ps(cap, tanh8(x)));
    }
    for (int i = full; i < n; i++) row[i] = softcap * tanhf(row[i] / softcap);
  }
  __m256 vtop = _mm256_set1_ps(row[0]);
  for (int i = 0; i < full; i += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(row + i));
  float top = lanes_max(vtop);
  for (int i = full; i < n; i++) top = row[i] > top ? row[i] : top;
  const __m256 vt = _mm256_set1_ps(top);
  __m256 vsum = _mm256_setzero_ps();
  for (int i = 0; i < full; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vt));
    _mm256_storeu_ps(row + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = lanes_sum(vsum);
  for (int i = full; i < n; i++) {
    row[i] = expf(row[i] - top);
    sum += row[i];
  }
  const float inv = 1.0f / sum;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int i = 0; i < full; i += 8)
    _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), vinv));
  for (int i = full; i < n; i++) row[i] *= inv;
  for (int i = n; i < n + CHUNK; i++) row[i] = 0.0f;
}
#else
static inline void dot_tile(const float *q, const float *const k[TILE], int D, float *out) {
  for (int j = 0; j < TILE; j++) {
    vfloat s = {0};
    for (int d = 0; d < D; d += LANES) s += load_f32(q + d) * load_f32(k[j] + d);
    float sum = 0.0f;
    for (int i = 0; i < LANES; i++) sum += s[i];
    out[j] = sum;
  }
}

static inline void accumulate(float *acc, const float *p, const float *const v[CHUNK], int D) {
  for (int d = 0; d < D; d += LANES) {
    vfloat a = load_f32(acc + d);
    for (int j = 0; j < CHUNK; j++) a += p[j] * load_f32(v[j] + d);
    store_f32(acc + d, a);
  }
}

static inline void softmax_row(float *row, int n, float softcap) {
  const int full = n - n % LANES;
  if (softcap > 0.0f) {
    for (int i = 0; i < full; i += LANES)
      store_f32(row + i, softcap * vtanh(load_f32(row + i) / softcap));
    for (int i = full; i < n; i++) row[i] = softcap * tanhf(row[i] / softcap);
  }
  vfloat vtop = (vfloat){0} + row[0];
  for (int i = 0; i < full; i += LANES) {
    const vfloat x = load_f32(row + i);
    vtop = vselect(x > vtop, x, vtop);
  }
  float top = row[0];
  for (int i = 0; i < LANES; i++) top = vtop[i] > top ? vtop[i] : top;
  for (int i = full; i < n; i++) top = row[i] > top ? row[i] : top;
  vfloat vsum = {0};
  for (int i = 0; i < full; i += LANES) {
    const vfloat e = vexp(load_f32(row + i) - top);
    store_f32(row + i, e);
    vsum += e;
  }
  float sum = 0.0f;
  for (int i = 0; i < LANES; i++) sum += vsum[i];
  for (int i = full; i < n; i++) {
    row[i] = expf(row[i] - top);
    sum += row[i];
  }
  const float inv = 1.0f / sum;
  for (int i = 0; i < full; i += LANES) store_f32(row + i, load_f32(row + i) * inv);
  for (int i = full; i < n; i++) row[i] *= inv;
  for (int i = n; i < n + CHUNK; i++) row[i] = 0.0f;
}
#endif

#if !defined(__AVX512F__)
/* acc[g] += sum_j p[g][j] v[j] for G query heads (acc rows D apart, p rows
 * `ps` apart): one head at a time here. */
static inline void accumulate_group(float *acc, const float *p, long ps, int G,
                                    const float *const v[CHUNK], int D) {
  for (int g = 0; g < G; g++) accumulate(acc + (long)g * D, p + g * ps, v, D);
}
#endif

#if defined(__AVX512F__) && defined(__F16C__)
/* 16 at a time (n is a multiple of 16 for every caller: D is), 8 for a tail. */
static inline void bf16_row_to_floats(const uint16_t *src, long n, float *dst) {
  long i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  for (; i < n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
}

static inline void f16_row_to_floats(const _Float16 *src, long n, float *dst) {
  long i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
  for (; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}
#elif defined(__AVX2__) && defined(__F16C__) /* every AVX2 CPU has F16C */
/* GCC scalarises vec.h's 16-lane float16 conversion here (16 scalar
 * converts per load); these take one to three instructions per 8. */
static inline void bf16_row_to_floats(const uint16_t *src, long n, float *dst) {
  for (long i = 0; i < n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
}

static inline void f16_row_to_floats(const _Float16 *src, long n, float *dst) {
  for (long i = 0; i < n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
}
#else
static inline void bf16_row_to_floats(const uint16_t *src, long n, float *dst) {
  for (long i = 0; i < n; i += LANES) store_f32(dst + i, load_bf16(src + i));
}

static inline void f16_row_to_floats(const _Float16 *src, long n, float *dst) {
  for (long i = 0; i < n; i += LANES) store_f32(dst + i, load_f16(src + i));
}
#endif

#endif
