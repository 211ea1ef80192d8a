/* The AVX-512F inner loops of paged_decode.c: dot_tile, accumulate_group
 * and softmax_row of paged_decode_simd.h (see there; it includes this file
 * after defining TILE = 16 and CHUNK where the compiler targets AVX-512F),
 * with 16-wide FMAs over D, V rows loaded once per block of a KV head's
 * query heads, and a 16-lane exp and tanh. */
#ifndef PDSERVE_NATIVE_PAGED_DECODE_AVX512_H
#define PDSERVE_NATIVE_PAGED_DECODE_AVX512_H
#if defined(__AVX512F__)

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* The sixteen sums of s[0..16)'s lanes, in key order, one per lane. A
 * transpose-and-add tree. Within each 128-bit lane: unpack + add leaves 8
 * registers of [a02 b02 a13 b13] (a = s[2i], b = s[2i + 1], aXY = a_X +
 * a_Y), then shuffle + add 4 registers whose 128-bit lane L holds lane L's
 * sums of four keys. Across 128-bit lanes: two rounds of shuffle_f32x4 +
 * add sum the four lanes, leaving keys 0-3, 4-7, 8-11, 12-15 in order. */
static inline __m512 sum_lanes16(const __m512 s[16]) {
  __m512 t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(s[2 * i], s[2 * i + 1]),
                         _mm512_unpackhi_ps(s[2 * i], s[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                  _mm512_shuffle_f32x4(u[0], u[1], 0xee));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                  _mm512_shuffle_f32x4(u[2], u[3], 0xee));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

/* Sixteen accumulators, one per key, reduced together at the end into the
 * sixteen scores: D / 16 loads of q and D FMAs per key, no horizontal sum
 * per score. */
static inline void dot_tile(const float *q, const float *const k[TILE], int D, float *out) {
  __m512 s[TILE];
#pragma GCC unroll 16
  for (int j = 0; j < TILE; j++) s[j] = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    const __m512 x = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < TILE; j++) s[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(k[j] + d), s[j]);
  }
  _mm512_storeu_ps(out, sum_lanes16(s));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* dot_tile of bfloat16 q and K rows read in place, times `scale`:
 * vdpbf16ps multiplies 32 pairs per instruction (each product exact in
 * float32, as the widened rows' were), half the loads and multiplies of
 * the float32 path and no K rows converted into scratch. A head dim that is
 * an odd multiple of 16 takes its last 16 under a mask (zero pairs add 0).
 * The sums go in another order than dot_tile's on widened rows, with the
 * scale applied to the sum, not to q: results differ in the last bits. */
#define PDSERVE_DECODE_BF16_SCORES 1
static inline void dot_tile_bf16(const uint16_t *q, const uint16_t *const k[TILE], int D,
                                 float scale, float *out) {
  __m512 s[TILE];
#pragma GCC unroll 16
  for (int j = 0; j < TILE; j++) s[j] = _mm512_setzero_ps();
  int d = 0;
  for (; d + 32 <= D; d += 32) {
    const __m512bh x = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
    for (int j = 0; j < TILE; j++)
      s[j] = _mm512_dpbf16_ps(s[j], x, (__m512bh)_mm512_loadu_si512(k[j] + d));
  }
  if (d < D) {
    const __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, q + d);
#pragma GCC unroll 16
    for (int j = 0; j < TILE; j++)
      s[j] = _mm512_dpbf16_ps(s[j], x, (__m512bh)_mm512_maskz_loadu_epi16(0xffff, k[j] + d));
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum_lanes16(s), _mm512_set1_ps(scale)));
}
#endif

/* Sixteen dims of a V row from dim d: float32 rows as they are, bfloat16
 * rows (`bf16`, a constant where these are inlined) widened in registers,
 * exactly (a bfloat16 is the top half of the float32 of the same value), so
 * a bfloat16 cache takes the same arithmetic as its float32 copy did
 * without writing one. */
static inline __attribute__((always_inline)) __m512 v_load(const void *row, int d, const int bf16) {
  if (bf16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))),
        16));
  return _mm512_loadu_ps((const float *)row + d);
}

/* acc[d..D) += sum_j p[j] v[j][d..D), 16 dims at a time over four sets of rows. */
static inline __attribute__((always_inline)) void accumulate_from(
    float *acc, const float *p, const void *const v[CHUNK], int d, int D, const int bf16) {
  for (; d < D; d += 16) {
    __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_setzero_ps(), a2 = a1, a3 = a1;
    for (int j = 0; j < CHUNK; j += 4) {
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), v_load(v[j], d, bf16), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[j + 1]), v_load(v[j + 1], d, bf16), a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[j + 2]), v_load(v[j + 2], d, bf16), a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[j + 3]), v_load(v[j + 3], d, bf16), a3);
    }
    _mm512_storeu_ps(acc + d, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

/* 64 dims at a time in four registers, twice: even rows into one set,
 * odd rows into the other (eight independent FMA chains over the chunk),
 * added at the end; then 16 dims at a time over four sets of rows. */
static inline __attribute__((always_inline)) void accumulate(
    float *acc, const float *p, const void *const v[CHUNK], int D, const int bf16) {
  int d = 0;
  for (; d + 64 <= D; d += 64) {
    __m512 a0 = _mm512_loadu_ps(acc + d), a1 = _mm512_loadu_ps(acc + d + 16),
           a2 = _mm512_loadu_ps(acc + d + 32), a3 = _mm512_loadu_ps(acc + d + 48);
    __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0;
    for (int j = 0; j < CHUNK; j += 2) {
      const __m512 w = _mm512_set1_ps(p[j]), u = _mm512_set1_ps(p[j + 1]);
      a0 = _mm512_fmadd_ps(w, v_load(v[j], d, bf16), a0);
      a1 = _mm512_fmadd_ps(w, v_load(v[j], d + 16, bf16), a1);
      a2 = _mm512_fmadd_ps(w, v_load(v[j], d + 32, bf16), a2);
      a3 = _mm512_fmadd_ps(w, v_load(v[j], d + 48, bf16), a3);
      b0 = _mm512_fmadd_ps(u, v_load(v[j + 1], d, bf16), b0);
      b1 = _mm512_fmadd_ps(u, v_load(v[j + 1], d + 16, bf16), b1);
      b2 = _mm512_fmadd_ps(u, v_load(v[j + 1], d + 32, bf16), b2);
      b3 = _mm512_fmadd_ps(u, v_load(v[j + 1], d + 48, bf16), b3);
    }
    _mm512_storeu_ps(acc + d, _mm512_add_ps(a0, b0));
    _mm512_storeu_ps(acc + d + 16, _mm512_add_ps(a1, b1));
    _mm512_storeu_ps(acc + d + 32, _mm512_add_ps(a2, b2));
    _mm512_storeu_ps(acc + d + 48, _mm512_add_ps(a3, b3));
  }
  accumulate_from(acc, p, v, d, D, bf16);
}

/* acc[g] += sum_j p[g][j] v[j] for the G query heads of one KV head (acc
 * rows D apart, p rows `ps` apart): each V row is loaded once for a block
 * of HB heads (64 dims in four registers per head, HB broadcasts and 4 HB
 * FMAs per row) instead of once per head. */
static inline __attribute__((always_inline)) void accumulate_block(
    float *acc, const float *p, long ps, const void *const v[CHUNK], int d, int D, const int HB,
    const int bf16) {
  __m512 a[4][4];
#pragma GCC unroll 4
  for (int i = 0; i < HB; i++)
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) a[i][k] = _mm512_loadu_ps(acc + i * D + d + 16 * k);
  for (int j = 0; j < CHUNK; j++) {
    const __m512 x0 = v_load(v[j], d, bf16), x1 = v_load(v[j], d + 16, bf16),
                 x2 = v_load(v[j], d + 32, bf16), x3 = v_load(v[j], d + 48, bf16);
#pragma GCC unroll 4
    for (int i = 0; i < HB; i++) {
      const __m512 w = _mm512_set1_ps(p[i * ps + j]);
      a[i][0] = _mm512_fmadd_ps(w, x0, a[i][0]);
      a[i][1] = _mm512_fmadd_ps(w, x1, a[i][1]);
      a[i][2] = _mm512_fmadd_ps(w, x2, a[i][2]);
      a[i][3] = _mm512_fmadd_ps(w, x3, a[i][3]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < HB; i++)
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) _mm512_storeu_ps(acc + i * D + d + 16 * k, a[i][k]);
}

static inline __attribute__((always_inline)) void accumulate_rows(
    float *acc, const float *p, long ps, int G, const void *const v[CHUNK], int D,
    const int bf16) {
  /* blocks of 2-4 heads: 8-16 independent FMA chains; a lone head keeps
   * accumulate's even / odd split */
  const int hb = G % 3 == 0 ? 3 : G % 4 == 0 ? 4 : G % 2 == 0 ? 2 : 1;
  if (hb == 1) {
    for (int g = 0; g < G; g++) accumulate(acc + (long)g * D, p + g * ps, v, D, bf16);
    return;
  }
  const int d64 = D - D % 64;
  for (int g = 0; g < G; g += hb) {
    float *a = acc + (long)g * D;
    const float *w = p + g * ps;
    for (int d = 0; d < d64; d += 64) {
      if (hb == 2)
        accumulate_block(a, w, ps, v, d, D, 2, bf16);
      else if (hb == 3)
        accumulate_block(a, w, ps, v, d, D, 3, bf16);
      else
        accumulate_block(a, w, ps, v, d, D, 4, bf16);
    }
    if (d64 < D)
      for (int i = 0; i < hb; i++)
        accumulate_from(a + (long)i * D, w + i * ps, v, d64, D, bf16);
  }
}

static inline void accumulate_group(float *acc, const float *p, long ps, int G,
                                    const float *const v[CHUNK], int D) {
  accumulate_rows(acc, p, ps, G, (const void *const *)v, D, 0);
}

/* accumulate_group on V rows of bfloat16 read in place (the same sums). */
#define PDSERVE_DECODE_BF16_VALUES 1
static void accumulate_group_bf16(float *acc, const float *p, long ps, int G,
                                  const uint16_t *const v[CHUNK], int D) {
  accumulate_rows(acc, p, ps, G, (const void *const *)v, D, 1);
}

/* exp8 and tanh8 on 16 lanes (the same polynomials and clamps). */
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x); /* x second: NaN stays */
  x = _mm512_max_ps(_mm512_set1_ps(-87.3365447504f), x);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

static inline __m512 tanh16(__m512 x) {
  /* sign and magnitude through integer ops: and/xor on floats need AVX512DQ */
  const __m512i xi = _mm512_castps_si512(x);
  const __m512i sign = _mm512_and_si512(xi, _mm512_set1_epi32((int)0x80000000u));
  const __m512 ax = _mm512_castsi512_ps(_mm512_xor_si512(xi, sign));
  const __m512 e = exp16(_mm512_add_ps(ax, ax)), one = _mm512_set1_ps(1.0f);
  const __m512 large =
      _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512 s = _mm512_mul_ps(x, x);
  __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(2.06390887954e-2f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-5.37397155531e-2f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(1.33314422036e-1f));
  p = _mm512_fmadd_ps(p, s, _mm512_set1_ps(-3.33332819422e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, s), x, x);
  const __mmask16 is_small = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  const __m512 signed_large =
      _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(large), sign));
  return _mm512_mask_blend_ps(is_small, signed_large, small);
}

/* 16 scores at a time; the last n % 16 under a lane mask (the same vector
 * exp and tanh, no scalar tail). */
static inline void softmax_row(float *row, int n, float softcap) {
  const int full = n - n % 16;
  const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1u);
  if (softcap > 0.0f) {
    const __m512 cap = _mm512_set1_ps(softcap);
    for (int i = 0; i < full; i += 16) {
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(row + i), cap);
      _mm512_storeu_ps(row + i, _mm512_mul_ps(cap, tanh16(x)));
    }
    if (tail) {
      const __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(tail, row + full), cap);
      _mm512_mask_storeu_ps(row + full, tail, _mm512_mul_ps(cap, tanh16(x)));
    }
  }
  __m512 vtop = _mm512_set1_ps(row[0]);
  for (int i = 0; i < full; i += 16) vtop = _mm512_max_ps(vtop, _mm512_loadu_ps(row + i));
  if (tail) vtop = _mm512_mask_max_ps(vtop, tail, vtop, _mm512_maskz_loadu_ps(tail, row + full));
  const __m512 vt = _mm512_set1_ps(_mm512_reduce_max_ps(vtop));
  __m512 vsum = _mm512_setzero_ps();
  for (int i = 0; i < full; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), vt));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (tail) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + full), vt));
    _mm512_mask_storeu_ps(row + full, tail, e);
    vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
  }
  const __m512 vinv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (int i = 0; i < full; i += 16)
    _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), vinv));
  if (tail)
    _mm512_mask_storeu_ps(row + full, tail,
                          _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, row + full), vinv));
  for (int i = n; i < n + CHUNK; i++) row[i] = 0.0f;
}

#endif
#endif
