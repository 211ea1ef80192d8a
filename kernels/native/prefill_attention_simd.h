/* The inner loops of prefill_attention.c (see there for the algorithm), on
 * one sub-block of QROWS query rows held as the lanes of NV AVX2 registers
 * and one tile of keys:
 *   score_tile         S^T = K Q^T for the tile, hidden scores masked, each
 *                      row's running max raised;
 *   exp2_nonpositive8  2^x for x <= 0;
 *   softmax_tile       scores into probabilities, the rescale alpha, l;
 *   value_tile         O = alpha O + P V;
 *   transpose8         an 8 x 8 block of floats (the queries' transpose);
 *   load_floats, store_floats  rows of the element type as float32 and back.
 * AVX-512F where the compiler targets it (prefill_attention_avx512.h:
 * QROWS 32 in two zmm, hidden keys as lane masks), else AVX2 + FMA (here:
 * QROWS 24 in three ymm). Included by prefill_attention.c after its
 * no-associative-math pragma, which these loops' bit-for-bit invariant
 * relies on (each lane's arithmetic is its own and in key order on both
 * paths, with the same FMA order and exp2 polynomial, so a real row's
 * result is the same on both: measured equal bit for bit).
 */
#ifndef PDSERVE_NATIVE_PREFILL_ATTENTION_SIMD_H
#define PDSERVE_NATIVE_PREFILL_ATTENTION_SIMD_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "dtypes.h"

#if defined(__AVX512F__)
#include "prefill_attention_avx512.h"
#else /* AVX2 + FMA */
#define QROWS 24 /* query rows per sub-block: the lanes of NV registers */
#define NV (QROWS / 8)
#define KB (12 / NV) /* keys scored together: twelve accumulators */
#define MASKED (-1e30f) /* a hidden score, and the max before any key: finite, so
                         * 2^(m - m') is 1, not NaN, while a row has seen none */

/* The keys of a tile a sub-block's rows see: lanes whose row cannot see
 * key `key` are all ones in hidden(), for rows at positions `pos` with
 * windows from `first` (pos - window + 1, or far below 0 without one). */
typedef struct {
  int key0;   /* the tile's first key */
  int masked; /* 0: every row sees every key of the tile */
  __m256i pos[NV], first[NV];
} Visibility;

static inline Visibility visibility(int key0, int masked, const int32_t *qpos, int window) {
  Visibility vis = {.key0 = key0, .masked = masked};
  const __m256i shift = _mm256_set1_epi32(window > 0 ? window - 1 : 1 << 30);
  for (int x = 0; x < NV; x++) {
    vis.pos[x] = _mm256_load_si256((const __m256i *)(qpos + 8 * x));
    vis.first[x] = _mm256_sub_epi32(vis.pos[x], shift);
  }
  return vis;
}

static inline __m256 hidden(const Visibility *vis, int j, int x) {
  const __m256i key = _mm256_set1_epi32(vis->key0 + j);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(key, vis->pos[x]),
                                             _mm256_cmpgt_epi32(vis->first[x], key)));
}

/* s[j][0..QROWS) = k[j] . qt[.][0..QROWS) for j < count (rows of k `ks`
 * apart), hidden scores set to MASKED, and top[lane] = max(top[lane], the
 * row's scores). Rows of s up to the next multiple of KB are written too
 * (repeating the last key, never reading past it) and ignored.
 * Not inlined, here and in value_rows: inlined into the item loop, GCC
 * spilled their accumulators or reloaded operands once per FMA. */
static __attribute__((noinline)) void score_tile(const float *qt, const float *k, long ks,
                                                 int count, int D, const Visibility *vis,
                                                 float *s, float *top) {
  __m256 t[NV];
  for (int x = 0; x < NV; x++) t[x] = _mm256_load_ps(top + 8 * x);
  for (int j0 = 0; j0 < count; j0 += KB) {
    const float *r[KB];
    for (int j = 0; j < KB; j++) r[j] = k + (j0 + j < count ? j0 + j : count - 1) * ks;
    __m256 a[KB][NV];
#pragma GCC unroll 6
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) a[j][x] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int d = 0; d < D; d++) {
      __m256 q[NV];
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) q[x] = _mm256_load_ps(qt + d * QROWS + 8 * x);
#pragma GCC unroll 6
      for (int j = 0; j < KB; j++) {
        const __m256 b = _mm256_broadcast_ss(r[j] + d);
#pragma GCC unroll 3
        for (int x = 0; x < NV; x++) a[j][x] = _mm256_fmadd_ps(b, q[x], a[j][x]);
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) {
        if (vis->masked)
          a[j][x] = _mm256_blendv_ps(a[j][x], _mm256_set1_ps(MASKED), hidden(vis, j0 + j, x));
        _mm256_store_ps(s + (j0 + j) * QROWS + 8 * x, a[j][x]);
        if (j0 + j < count) t[x] = _mm256_max_ps(t[x], a[j][x]);
      }
  }
  for (int x = 0; x < NV; x++) _mm256_store_ps(top + 8 * x, t[x]);
}

/* 2^x per lane for x <= 0, which is all a softmax against its running max
 * needs: n = round(x), 2^(x - n) by Cephes' exp2f polynomial on [-1/2, 1/2]
 * (within ~2 ulp), times 2^n built in the exponent bits. x is clamped to
 * >= -126, where 2^x leaves float32's normal range (so a masked key gives
 * 2^-126, which the caller clears), and 2^0 is exactly 1. The scores come
 * in base 2 (log2 e is folded into the query scale): against
 * paged_decode_simd.h's exp8, no multiply by log2 e, no two-part n ln 2
 * reduction and no upper clamp, which took the softmax from ~0.43 to
 * ~0.26 ns per score on the AVX2 EPYC. NaN stays NaN. */
static inline __m256 exp2_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x); /* x second: NaN stays */
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The online softmax step of one sub-block once score_tile has raised
 * m_new above the tile's scores: the scores become probabilities against
 * it, alpha[lane] = exp(m - m_new) rescales what came before, l is updated
 * and m becomes m_new. */
static inline void softmax_tile(float *s, int count, const Visibility *vis, const float *m_new,
                                float *m, float *l, float *alpha) {
  __m256 top[NV], sum[NV];
#pragma GCC unroll 3
  for (int x = 0; x < NV; x++) {
    top[x] = _mm256_load_ps(m_new + 8 * x);
    const __m256 a = exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(m + 8 * x), top[x]));
    _mm256_store_ps(alpha + 8 * x, a);
    _mm256_store_ps(m + 8 * x, top[x]);
    sum[x] = _mm256_mul_ps(_mm256_load_ps(l + 8 * x), a);
  }
  for (int j = 0; j < count; j++)
#pragma GCC unroll 3
    for (int x = 0; x < NV; x++) {
      float *row = s + j * QROWS + 8 * x;
      __m256 p = exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(row), top[x]));
      if (vis->masked) /* 2^x never returns 0 here: clear the hidden keys */
        p = _mm256_andnot_ps(hidden(vis, j, x), p);
      _mm256_store_ps(row, p);
      sum[x] = _mm256_add_ps(sum[x], p);
    }
#pragma GCC unroll 3
  for (int x = 0; x < NV; x++) _mm256_store_ps(l + 8 * x, sum[x]);
}

/* o[r] = alpha[r] o[r] + sum_j p[j][r] v[j] for NR rows r (o rows D apart,
 * p rows QROWS apart, v rows `vs` apart), 16 dimensions at a time. */
static inline __attribute__((always_inline)) void value_rows(float *o, const float *alpha,
                                                             const float *p, const float *v,
                                                             long vs, int count, int D,
                                                             const int NR) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 a[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      const __m256 w = _mm256_broadcast_ss(alpha + r);
      a[r][0] = _mm256_mul_ps(w, _mm256_load_ps(o + r * D + d0));
      a[r][1] = _mm256_mul_ps(w, _mm256_load_ps(o + r * D + d0 + 8));
    }
    for (int j = 0; j < count; j++) {
      const float *x = v + j * vs + d0;
      const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
#pragma GCC unroll 6
      for (int r = 0; r < NR; r++) {
        const __m256 w = _mm256_broadcast_ss(p + j * QROWS + r);
        a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      _mm256_store_ps(o + r * D + d0, a[r][0]);
      _mm256_store_ps(o + r * D + d0 + 8, a[r][1]);
    }
  }
}

static __attribute__((noinline)) void value_rows6(float *o, const float *alpha, const float *p,
                                                  const float *v, long vs, int count, int D) {
  value_rows(o, alpha, p, v, vs, count, D, 6);
}

static __attribute__((noinline)) void value_rows4(float *o, const float *alpha, const float *p,
                                                  const float *v, long vs, int count, int D) {
  value_rows(o, alpha, p, v, vs, count, D, 4);
}

/* The rows in blocks of six (QROWS 24), or six, six and four (QROWS 16). */
static inline void value_tile(float *o, const float *alpha, const float *p, const float *v,
                              long vs, int count, int D) {
  int r = 0;
  for (; r + 6 <= QROWS; r += 6) value_rows6(o + r * D, alpha + r, p + r, v, vs, count, D);
  if (QROWS - r == 4) value_rows4(o + r * D, alpha + r, p + r, v, vs, count, D);
}

#endif

/* dst[c][r] = src[r][c] for an 8 x 8 block (rows `*_stride` floats apart). */
static inline void transpose8(const float *src, long src_stride, float *dst, long dst_stride) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); /* r_i0 r_(i+1)0 r_i1 r_(i+1)1 | cols 4, 5 */
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* cols 2, 3 | 6, 7 */
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);     /* col 0 of 4 rows | col 4 */
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee); /* col 1 | col 5 */
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int c = 0; c < 4; c++) {
    _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
  }
}

/* Rows in and out of the kernel's float32 (the bf16 / f16 row conversions
 * of paged_decode_simd.h, included before this file). */

/* count (a multiple of 8) elements at element offset `at` of `base` as float32. */
static void load_floats(int dtype, const char *base, long at, int count, float *dst) {
  if (dtype == 0)
    memcpy(dst, (const float *)base + at, sizeof(float) * count);
  else if (dtype == 1)
    bf16_row_to_floats((const uint16_t *)base + at, count, dst);
  else
    f16_row_to_floats((const _Float16 *)base + at, count, dst);
}

static void store_floats(int dtype, const float *src, int count, char *base, long at) {
  if (dtype == 0) {
    memcpy((float *)base + at, src, sizeof(float) * count);
  } else if (dtype == 1) {
    for (int i = 0; i < count; i++) ((uint16_t *)base)[at + i] = f32_to_bf16(src[i]);
  } else {
    for (int i = 0; i < count; i++) ((_Float16 *)base)[at + i] = (_Float16)src[i];
  }
}

#endif
