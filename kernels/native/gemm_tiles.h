/* The register tiles of gemm.c (float32 panels): decode-row groups read
 * straight from x, and prefill tiles over rows packed k-interleaved. Each
 * adds to its accumulators one fused multiply-add chain per output over k
 * in order, so every tile gives a row the same result bit for bit.
 * Included by gemm.c only (AVX2 + FMA builds). */
#ifndef PDSERVE_NATIVE_GEMM_TILES_H
#define PDSERVE_NATIVE_GEMM_TILES_H

#include <immintrin.h>

#include "gemm_panels.h"

#define KC 64        /* k rows of a panel per pass: 4 KB, stays in L1 (tuned below) */
#define PREFETCH 64  /* k rows ahead (4 KB) the first row group prefetches */
/* KC and PREFETCH measured on the AVX2 EPYC (interleaved A/B over the base
 * model's weights, two threads): KC 256 / PREFETCH 32 -> 64 / 64 took 8
 * rows from 22.9-25.9 to 20.0-21.8 ms and 16 rows from 32.8-35.4 to
 * 29.1-31.8 ms; 32 and 128 rows of KC, 32 and 128 of PREFETCH were no better. */

/* c<r><h>: row r, columns 8h .. 8h + 7 of the panel. */
#define LOAD_ROW(r) \
  __m256 c##r##0 = _mm256_load_ps(acc + (r) * PANEL), c##r##1 = _mm256_load_ps(acc + (r) * PANEL + 8)
#define STORE_ROW(r) \
  (_mm256_store_ps(acc + (r) * PANEL, c##r##0), _mm256_store_ps(acc + (r) * PANEL + 8, c##r##1))
#define FMA_ROW(r)                                                         \
  do {                                                                     \
    const __m256 a = _mm256_broadcast_ss(x + (r) * x_stride + k);          \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                             \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                             \
  } while (0)
/* prefetch: NEAR (the first group: PREFETCH rows ahead, into L1), NEXT_BLOCK
 * (the later groups: the panel's next KC rows, into L2, so memory stays busy
 * while they compute from L1), or NONE. */
#define K_LOOP(BODY)                                                                    \
  _Pragma("GCC unroll 4")                                                               \
  for (long k = 0; k < kc; k++) {                                                       \
    PREFETCH_PANEL(prefetch, p + (k + PREFETCH) * PANEL, p + (k + KC) * PANEL);         \
    const __m256 b0 = _mm256_loadu_ps(p + k * PANEL), b1 = _mm256_loadu_ps(p + k * PANEL + 8); \
    BODY                                                                                \
  }

/* acc[r][0..15] += x[r][0..kc) . p[0..kc)[0..15] for a group of 4, 2 or 1 rows. */
static inline void rows4(const float *x, long x_stride, const float *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0); LOAD_ROW(1); LOAD_ROW(2); LOAD_ROW(3);
  K_LOOP(FMA_ROW(0); FMA_ROW(1); FMA_ROW(2); FMA_ROW(3);)
  STORE_ROW(0); STORE_ROW(1); STORE_ROW(2); STORE_ROW(3);
}

static inline void rows2(const float *x, long x_stride, const float *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0); LOAD_ROW(1);
  K_LOOP(FMA_ROW(0); FMA_ROW(1);)
  STORE_ROW(0); STORE_ROW(1);
}

static inline void rows1(const float *x, long x_stride, const float *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0);
  K_LOOP(FMA_ROW(0);)
  STORE_ROW(0);
}

#if defined(__AVX512F__)
/* With AVX-512 a panel row (16 floats) is one register, and the row's
 * broadcast folds into the multiply-add as a memory operand: one load and
 * one instruction per row per k, against two loads, a broadcast and two
 * multiply-adds with AVX2, and 32 registers hold 8 rows' accumulators.
 * Only whole groups of 8 take it: a group of 4 or fewer has as many
 * 16-wide chains as rows, each waiting on its last multiply-add, where the
 * AVX2 groups have two 8-wide chains a row (1 row: 12.7 against 12.1 ms).
 * Each output is the same multiply-add chain over k in order as on the
 * AVX2 path (bit for bit), so the choice does not change a result. On the
 * AVX-512 EPYC, one thread, over the base model's projections (`pdserve
 * bench decode-gemm --threads 1`, with the panels on huge pages either
 * way), medians of two runs: 8 rows 23.6-23.8 -> 19.3-19.5 ms, 16 rows
 * 43.3-43.4 -> 35.0-36.7 ms, both ~1.2x faster than the AVX2 groups
 * (benchmarks/results/engine-2026-11-27-hugepages-avx512/README.md, "Huge
 * pages and AVX-512 decode groups"). */
#define ZLOAD(r) __m512 z##r = _mm512_loadu_ps(acc + (r) * PANEL)
#define ZSTORE(r) _mm512_storeu_ps(acc + (r) * PANEL, z##r)
#define ZFMA(r) z##r = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * x_stride + k]), b, z##r)
#define ZK_LOOP(BODY)                                                                    \
  _Pragma("GCC unroll 4")                                                               \
  for (long k = 0; k < kc; k++) {                                                       \
    PREFETCH_PANEL(prefetch, p + (k + PREFETCH) * PANEL, p + (k + KC) * PANEL);         \
    const __m512 b = _mm512_loadu_ps(p + k * PANEL);                                    \
    BODY                                                                                \
  }

static inline void zrows8(const float *x, long x_stride, const float *p, long kc, float *acc,
                          int prefetch) {
  ZLOAD(0); ZLOAD(1); ZLOAD(2); ZLOAD(3); ZLOAD(4); ZLOAD(5); ZLOAD(6); ZLOAD(7);
  ZK_LOOP(ZFMA(0); ZFMA(1); ZFMA(2); ZFMA(3); ZFMA(4); ZFMA(5); ZFMA(6); ZFMA(7);)
  ZSTORE(0); ZSTORE(1); ZSTORE(2); ZSTORE(3); ZSTORE(4); ZSTORE(5); ZSTORE(6); ZSTORE(7);
}

#endif

/* Prefill tiles over rows packed [K][MR]. The ymm tile is 6 rows x 16
 * columns: 12 accumulators + the panel's k row (2) + a broadcast fill 15
 * of the 16 ymm registers, for 12 FMAs per 8 loads (rows4: 8 per 6). */
#define MR 6 /* rows of a packed tile */

#define FMA_PACKED(r)                                                      \
  do {                                                                     \
    const __m256 a = _mm256_broadcast_ss(ap + MR * k + (r));               \
    c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                             \
    c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                             \
  } while (0)
#define LOAD_OR_ZERO(r)                                                                    \
  __m256 c##r##0 = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (r) * PANEL),        \
         c##r##1 = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (r) * PANEL + 8)

/* acc[r][0..15] = (first ? 0 : acc[r][0..15]) + ap[0..kc)[r] . p[0..kc)[0..15],
 * r < 6; meanwhile the panel rows pf[0 .. pf_rows) into L2, one a k. */
static inline void rows6(const float *ap, const float *p, long kc, float *acc, int first,
                         const float *pf, long pf_rows) {
  LOAD_OR_ZERO(0); LOAD_OR_ZERO(1); LOAD_OR_ZERO(2);
  LOAD_OR_ZERO(3); LOAD_OR_ZERO(4); LOAD_OR_ZERO(5);
  _Pragma("GCC unroll 4")
  for (long k = 0; k < kc; k++) {
    if (k < pf_rows) _mm_prefetch((const char *)(pf + k * PANEL), _MM_HINT_T1);
    const __m256 b0 = _mm256_load_ps(p + k * PANEL), b1 = _mm256_load_ps(p + k * PANEL + 8);
    FMA_PACKED(0); FMA_PACKED(1); FMA_PACKED(2); FMA_PACKED(3); FMA_PACKED(4); FMA_PACKED(5);
  }
  STORE_ROW(0); STORE_ROW(1); STORE_ROW(2); STORE_ROW(3); STORE_ROW(4); STORE_ROW(5);
}

/* x[0..5][0..K) as ap[k][r], 8 k at a time. */
static void pack_rows6(const float *x, long x_stride, long K, float *ap) {
  long k = 0;
  for (; k + 8 <= K; k += 8) {
    float t[MR][8] __attribute__((aligned(32)));
    for (int r = 0; r < MR; r++) _mm256_store_ps(t[r], _mm256_loadu_ps(x + r * x_stride + k));
    for (int q = 0; q < 8; q++)
      for (int r = 0; r < MR; r++) ap[MR * (k + q) + r] = t[r][q];
  }
  for (; k < K; k++)
    for (int r = 0; r < MR; r++) ap[MR * k + r] = x[r * x_stride + k];
}

#if defined(__AVX512F__)
/* With AVX-512 a tile is two packed 6-row tiles x two panels (12 rows x 32
 * columns): 24 zmm accumulators, per k two panel loads and twelve
 * broadcasts for 24 multiply-adds of 16 lanes, four times the work per
 * panel load of rows6's ymm tile. Each output is the same chain over k in
 * order from 0 as on every other path, so a row's result does not change
 * (bit for bit). PAIR_* are the first 6 rows (ap), PAIR_*_B the next (bp). */
#define PAIR_LOAD(r)                                                                        \
  __m512 u##r = first ? _mm512_setzero_ps() : _mm512_load_ps(acc0 + (r) * PANEL),           \
         v##r = first ? _mm512_setzero_ps() : _mm512_load_ps(acc1 + (r) * PANEL)
#define PAIR_FMA(r)                                                                         \
  do {                                                                                      \
    const __m512 a = _mm512_set1_ps(ap[MR * k + (r)]);                                      \
    u##r = _mm512_fmadd_ps(a, b0, u##r);                                                    \
    v##r = _mm512_fmadd_ps(a, b1, v##r);                                                    \
  } while (0)
#define PAIR_STORE(r) (_mm512_store_ps(acc0 + (r) * PANEL, u##r), _mm512_store_ps(acc1 + (r) * PANEL, v##r))

#define PAIR_LOAD_B(r)                                                                      \
  __m512 s##r = first ? _mm512_setzero_ps() : _mm512_load_ps(acc0 + (r + 6) * PANEL),       \
         w##r = first ? _mm512_setzero_ps() : _mm512_load_ps(acc1 + (r + 6) * PANEL)
#define PAIR_FMA_B(r)                                                                       \
  do {                                                                                      \
    const __m512 a = _mm512_set1_ps(bp[MR * k + (r)]);                                      \
    s##r = _mm512_fmadd_ps(a, b0, s##r);                                                    \
    w##r = _mm512_fmadd_ps(a, b1, w##r);                                                    \
  } while (0)
#define PAIR_STORE_B(r) (_mm512_store_ps(acc0 + (r + 6) * PANEL, s##r), _mm512_store_ps(acc1 + (r + 6) * PANEL, w##r))

/* acc0/acc1[r][0..15] = (first ? 0 : acc) + (r < 6 ? ap : bp)[0..kc)[r % 6] .
 * p0/p1[0..kc)[0..15], r < 12; meanwhile rows pf0/pf1[0 .. pf_rows) into L2,
 * one each a k. */
static inline void pair_rows12(const float *ap, const float *bp, const float *p0,
                               const float *p1, long kc, float *acc0, float *acc1, int first,
                               const float *pf0, const float *pf1, long pf_rows) {
  PAIR_LOAD(0); PAIR_LOAD(1); PAIR_LOAD(2); PAIR_LOAD(3); PAIR_LOAD(4); PAIR_LOAD(5);
  PAIR_LOAD_B(0); PAIR_LOAD_B(1); PAIR_LOAD_B(2); PAIR_LOAD_B(3); PAIR_LOAD_B(4); PAIR_LOAD_B(5);
  for (long k = 0; k < kc; k++) {
    if (k < pf_rows) {
      _mm_prefetch((const char *)(pf0 + k * PANEL), _MM_HINT_T1);
      _mm_prefetch((const char *)(pf1 + k * PANEL), _MM_HINT_T1);
    }
    const __m512 b0 = _mm512_load_ps(p0 + k * PANEL), b1 = _mm512_load_ps(p1 + k * PANEL);
    PAIR_FMA(0); PAIR_FMA(1); PAIR_FMA(2); PAIR_FMA(3); PAIR_FMA(4); PAIR_FMA(5);
    PAIR_FMA_B(0); PAIR_FMA_B(1); PAIR_FMA_B(2); PAIR_FMA_B(3); PAIR_FMA_B(4); PAIR_FMA_B(5);
  }
  PAIR_STORE(0); PAIR_STORE(1); PAIR_STORE(2); PAIR_STORE(3); PAIR_STORE(4); PAIR_STORE(5);
  PAIR_STORE_B(0); PAIR_STORE_B(1); PAIR_STORE_B(2); PAIR_STORE_B(3); PAIR_STORE_B(4); PAIR_STORE_B(5);
}

#endif

#endif
