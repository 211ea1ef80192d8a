/* The AVX-512F inner loops of prefill_attention.c: those of
 * prefill_attention_simd.h (see there; it includes this file where the
 * compiler targets AVX-512F) on sub-blocks of QROWS = 32 query rows, the
 * lanes of two zmm registers, hidden keys as lane masks. Each lane's
 * arithmetic (FMA order, exp2 polynomial) is the AVX2 path's, so a real
 * row's result is the same on both; only which rows share a sub-block
 * differs. */
#ifndef PDSERVE_NATIVE_PREFILL_ATTENTION_AVX512_H
#define PDSERVE_NATIVE_PREFILL_ATTENTION_AVX512_H
#if defined(__AVX512F__)

#include <immintrin.h>
#include <stdint.h>

#define QROWS 32 /* query rows per sub-block: the lanes of NV registers */
#define NV (QROWS / 16)
#define KB 8 /* keys scored together: sixteen accumulators, eight row pointers */
#define MASKED (-1e30f) /* as in prefill_attention_simd.h */

/* As the AVX2 Visibility (prefill_attention_simd.h), hidden() a lane mask. */
typedef struct {
  int key0;   /* the tile's first key */
  int masked; /* 0: every row sees every key of the tile */
  __m512i pos[NV], first[NV];
} Visibility;

static inline Visibility visibility(int key0, int masked, const int32_t *qpos, int window) {
  Visibility vis = {.key0 = key0, .masked = masked};
  const __m512i shift = _mm512_set1_epi32(window > 0 ? window - 1 : 1 << 30);
  for (int x = 0; x < NV; x++) {
    vis.pos[x] = _mm512_loadu_si512(qpos + 16 * x);
    vis.first[x] = _mm512_sub_epi32(vis.pos[x], shift);
  }
  return vis;
}

static inline __mmask16 hidden(const Visibility *vis, int j, int x) {
  const __m512i key = _mm512_set1_epi32(vis->key0 + j);
  return _mm512_cmpgt_epi32_mask(key, vis->pos[x]) | _mm512_cmpgt_epi32_mask(vis->first[x], key);
}

/* A score step's KB x QROWS sums, times `factor` (1: already scaled, an
 * exact no-op), hidden keys set to MASKED, stored as rows j0.. of s, each
 * row's max raised in t (keys past `count` are stored, not counted). */
static inline __attribute__((always_inline)) void store_scores(
    __m512 a[KB][NV], __m512 factor, int j0, int count, const Visibility *vis, float *s,
    __m512 t[NV]) {
#pragma GCC unroll 8
  for (int j = 0; j < KB; j++)
#pragma GCC unroll 2
    for (int x = 0; x < NV; x++) {
      __m512 v = _mm512_mul_ps(a[j][x], factor);
      if (vis->masked)
        v = _mm512_mask_blend_ps(hidden(vis, j0 + j, x), v, _mm512_set1_ps(MASKED));
      _mm512_storeu_ps(s + (j0 + j) * QROWS + 16 * x, v);
      if (j0 + j < count) t[x] = _mm512_max_ps(t[x], v);
    }
}

/* score_tile of the AVX2 path (prefill_attention_simd.h), KB = 8 keys by
 * 32 rows: per dimension two loads of Q^T, eight broadcasts of K, sixteen
 * FMAs (6 and 12 keys, or QROWS 48, measured the same within ~3 %). */
static __attribute__((noinline)) void score_tile(const float *qt, const float *k, long ks,
                                                 int count, int D, const Visibility *vis,
                                                 float *s, float *top) {
  __m512 t[NV];
  for (int x = 0; x < NV; x++) t[x] = _mm512_loadu_ps(top + 16 * x);
  for (int j0 = 0; j0 < count; j0 += KB) {
    const float *r[KB];
    for (int j = 0; j < KB; j++) r[j] = k + (j0 + j < count ? j0 + j : count - 1) * ks;
    __m512 a[KB][NV];
#pragma GCC unroll 8
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 2
      for (int x = 0; x < NV; x++) a[j][x] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int d = 0; d < D; d++) {
      __m512 q[NV];
#pragma GCC unroll 2
      for (int x = 0; x < NV; x++) q[x] = _mm512_loadu_ps(qt + d * QROWS + 16 * x);
#pragma GCC unroll 8
      for (int j = 0; j < KB; j++) {
        const __m512 b = _mm512_set1_ps(r[j][d]);
#pragma GCC unroll 2
        for (int x = 0; x < NV; x++) a[j][x] = _mm512_fmadd_ps(b, q[x], a[j][x]);
      }
    }
    store_scores(a, _mm512_set1_ps(1.0f), j0, count, vis, s, t);
  }
  for (int x = 0; x < NV; x++) _mm512_storeu_ps(top + 16 * x, t[x]);
}

#if defined(__AVX512BF16__)
/* bfloat16 scores by vdpbf16ps (prefill_attention.c takes this path for a
 * bfloat16 prompt where the host has AVX512-BF16): the item's queries as
 * they are stored, transposed in pairs of dims (qt[p][row] holds row's
 * dims 2p and 2p + 1, 32 bits), and K packed as bfloat16; per pair of
 * dims two loads of Q^T, eight broadcast K pairs and sixteen vdpbf16ps,
 * half the float32 path's work per key and dim. Each product is exact in
 * float32; a score's sum goes two dims a step, and scale * log2 e
 * multiplies the sum instead of q, so the scores differ from the float32
 * path's in the last bits. Each lane's arithmetic is still its own, in key
 * and dim order: a row's result does not depend on the rows beside it, n
 * or the thread count. */
#define PREFILL_PAIRS 1
/* Two bfloat16 read as one 32-bit pair (may alias the uint16_t rows). */
typedef uint32_t bf16_pair __attribute__((may_alias, aligned(2)));

static __attribute__((noinline)) void score_tile_pairs(const uint32_t *qt, const uint16_t *k,
                                                       long ks, int count, int D, float scale,
                                                       const Visibility *vis, float *s,
                                                       float *top) {
  __m512 t[NV];
  const __m512 factor = _mm512_set1_ps(scale);
  for (int x = 0; x < NV; x++) t[x] = _mm512_loadu_ps(top + 16 * x);
  for (int j0 = 0; j0 < count; j0 += KB) {
    const bf16_pair *r[KB];
    for (int j = 0; j < KB; j++)
      r[j] = (const bf16_pair *)(k + (j0 + j < count ? j0 + j : count - 1) * ks);
    __m512 a[KB][NV];
#pragma GCC unroll 8
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 2
      for (int x = 0; x < NV; x++) a[j][x] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int p = 0; p < D / 2; p++) {
      __m512bh q[NV];
#pragma GCC unroll 2
      for (int x = 0; x < NV; x++) q[x] = (__m512bh)_mm512_loadu_si512(qt + p * QROWS + 16 * x);
#pragma GCC unroll 8
      for (int j = 0; j < KB; j++) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)r[j][p]);
#pragma GCC unroll 2
        for (int x = 0; x < NV; x++) a[j][x] = _mm512_dpbf16_ps(a[j][x], q[x], b);
      }
    }
    store_scores(a, factor, j0, count, vis, s, t);
  }
  for (int x = 0; x < NV; x++) _mm512_storeu_ps(top + 16 * x, t[x]);
}

/* Row r of the item's Q^T in pairs: the bfloat16 query `q` (D elements). */
static inline void query_pairs(const uint16_t *q, int D, uint32_t *qt, int r) {
  const bf16_pair *pairs = (const bf16_pair *)q;
  for (int p = 0; p < D / 2; p++) qt[p * QROWS + r] = pairs[p];
}
#endif

/* exp2_nonpositive8 of the AVX2 path (prefill_attention_simd.h), on 16 lanes. */
static inline __m512 exp2_nonpositive16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-126.0f), x); /* x second: NaN stays */
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* softmax_tile of the AVX2 path (prefill_attention_simd.h). */
static inline void softmax_tile(float *s, int count, const Visibility *vis, const float *m_new,
                                float *m, float *l, float *alpha) {
  __m512 top[NV], sum[NV];
#pragma GCC unroll 2
  for (int x = 0; x < NV; x++) {
    top[x] = _mm512_loadu_ps(m_new + 16 * x);
    const __m512 a = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(m + 16 * x), top[x]));
    _mm512_storeu_ps(alpha + 16 * x, a);
    _mm512_storeu_ps(m + 16 * x, top[x]);
    sum[x] = _mm512_mul_ps(_mm512_loadu_ps(l + 16 * x), a);
  }
  for (int j = 0; j < count; j++)
#pragma GCC unroll 2
    for (int x = 0; x < NV; x++) {
      float *row = s + j * QROWS + 16 * x;
      __m512 p = exp2_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(row), top[x]));
      if (vis->masked) /* 2^x never returns 0 here: clear the hidden keys */
        p = _mm512_maskz_mov_ps((__mmask16)~hidden(vis, j, x), p);
      _mm512_storeu_ps(row, p);
      sum[x] = _mm512_add_ps(sum[x], p);
    }
#pragma GCC unroll 2
  for (int x = 0; x < NV; x++) _mm512_storeu_ps(l + 16 * x, sum[x]);
}

/* o[r] = alpha[r] o[r] + sum_j p[j][r] v[j] for 8 rows r (o rows D apart,
 * p rows QROWS apart, v rows `vs` apart): 32 dimensions at a time in
 * sixteen registers (two V loads, eight broadcasts, sixteen FMAs per key),
 * then 16 for a head dim that is an odd multiple of 16. */
static __attribute__((noinline)) void value_rows8(float *o, const float *alpha, const float *p,
                                                  const float *v, long vs, int count, int D) {
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) {
    __m512 a[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
      const __m512 w = _mm512_set1_ps(alpha[r]);
      a[r][0] = _mm512_mul_ps(w, _mm512_loadu_ps(o + r * D + d0));
      a[r][1] = _mm512_mul_ps(w, _mm512_loadu_ps(o + r * D + d0 + 16));
    }
    for (int j = 0; j < count; j++) {
      const float *x = v + j * vs + d0;
      const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) {
        const __m512 w = _mm512_set1_ps(p[j * QROWS + r]);
        a[r][0] = _mm512_fmadd_ps(w, v0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(w, v1, a[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) {
      _mm512_storeu_ps(o + r * D + d0, a[r][0]);
      _mm512_storeu_ps(o + r * D + d0 + 16, a[r][1]);
    }
  }
  if (d0 < D) {
    __m512 a[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++)
      a[r] = _mm512_mul_ps(_mm512_set1_ps(alpha[r]), _mm512_loadu_ps(o + r * D + d0));
    for (int j = 0; j < count; j++) {
      const __m512 v0 = _mm512_loadu_ps(v + j * vs + d0);
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++)
        a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * QROWS + r]), v0, a[r]);
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; r++) _mm512_storeu_ps(o + r * D + d0, a[r]);
  }
}

/* The rows in blocks of eight. */
static inline void value_tile(float *o, const float *alpha, const float *p, const float *v,
                              long vs, int count, int D) {
  for (int r = 0; r < QROWS; r += 8) value_rows8(o + r * D, alpha + r, p + r, v, vs, count, D);
}

#endif
#endif
