/* The dense projections of a bfloat16 model, decode and prefill rows alike:
 * bfloat16 x [M, K] times a bfloat16 weight packed in 16-column panels.
 *
 * A bfloat16 decode step streams every weight once, like a float32 one
 * (gemm.c), but half the bytes. On a CPU without bfloat16 arithmetic (the
 * project's AVX2 EPYC: oneDNN has no bfloat16 linear there) the dense path
 * multiplies a float32 copy of each weight (engine/layers/linear.py,
 * `Linear.prepack_onednn`), so a bfloat16 step read as many bytes as a
 * float32 one. This kernel reads the bfloat16 panels and widens them in
 * registers (a bfloat16 value is the top half of the float32 with the same
 * value, so widening is exact: one unpack against zero).
 *
 * Arithmetic: x is widened to float32, every product is exact in float32,
 * each output element is ONE fused multiply-add chain over k = 0 .. K - 1 in
 * order (then + the float32 bias), rounded once to bfloat16 (nearest even,
 * as torch rounds): a bfloat16 GEMM with float32 accumulation, like oneDNN's
 * and torch's, up to summation order; a row's result does not depend on M,
 * on which rows share its group, or on the thread count.
 *
 * Layout: `panels` [ceil(N / 16)][K][16] uint16 (bfloat16 bits). Within a
 * panel row the 16 columns are stored in the order the unpacks produce
 * natural order from (pack_panels_bf16 in kernels/native/__init__.py):
 * positions 0-3 hold columns 0-3, 4-7 columns 8-11, 8-11 columns 4-7,
 * 12-15 columns 12-15. `_mm256_unpacklo_epi16(0, w)` then yields columns
 * 0-7 as float32 and `_mm256_unpackhi_epi16(0, w)` columns 8-15.
 *
 * A separate file from gemm.c because only the panel load, the x widening
 * and the rounding store differ, and each is in the hot loop or its edge;
 * the blocking (k-blocks kept in L1 while every 4-row group uses them,
 * prefetch ahead) is gemm.c's, at twice the k rows per byte.
 *
 * Where the CPU has AVX512-BF16 and K is even, the panels hold k in pairs
 * and `vdpbf16ps` multiplies them instead (gemm_pairs, below; no widening):
 * as fast as oneDNN's bfloat16 linear on prefill rows, faster on decode rows.
 *
 * AVX2 + FMA only; elsewhere pdserve_gemm_bf16_available() is 0 and the
 * caller keeps the float32 dense path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "exports.h"
#include "gemm_panels.h"

#define KC 128       /* k rows of a panel per pass: 4 KB of bfloat16, stays in L1 */
#define MB 96        /* rows per block (accumulators: MB x 16 floats, 6 KB) */
#define PREFETCH 128 /* k rows ahead (4 KB) the first row group prefetches */

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
/* One k row of the panel: 16 bfloat16 (32 bytes) widened to two float32 x 8. */
#define K_LOOP(BODY)                                                                    \
  const __m256i zero = _mm256_setzero_si256();                                          \
  _Pragma("GCC unroll 4")                                                               \
  for (long k = 0; k < kc; k++) {                                                       \
    PREFETCH_PANEL(prefetch, p + (k + PREFETCH) * PANEL, p + (k + KC) * PANEL);         \
    const __m256i w = _mm256_loadu_si256((const __m256i *)(p + k * PANEL));             \
    const __m256 b0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w));             \
    const __m256 b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w));             \
    BODY                                                                                \
  }

static inline void rows4(const float *x, long x_stride, const uint16_t *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0); LOAD_ROW(1); LOAD_ROW(2); LOAD_ROW(3);
  K_LOOP(FMA_ROW(0); FMA_ROW(1); FMA_ROW(2); FMA_ROW(3);)
  STORE_ROW(0); STORE_ROW(1); STORE_ROW(2); STORE_ROW(3);
}

static inline void rows2(const float *x, long x_stride, const uint16_t *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0); LOAD_ROW(1);
  K_LOOP(FMA_ROW(0); FMA_ROW(1);)
  STORE_ROW(0); STORE_ROW(1);
}

static inline void rows1(const float *x, long x_stride, const uint16_t *p, long kc, float *acc,
                         int prefetch) {
  LOAD_ROW(0);
  K_LOOP(FMA_ROW(0);)
  STORE_ROW(0);
}

/* n bfloat16 -> float32, exact. */
static void widen(const uint16_t *src, float *dst, long n) {
  long i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
    _mm256_storeu_si256((__m256i *)(dst + i),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  for (; i < n; i++) {
    const uint32_t bits = (uint32_t)src[i] << 16;
    memcpy(dst + i, &bits, sizeof bits);
  }
}

/* 8 float32 -> bfloat16 bits in the low 16 of each 32-bit lane, rounded to
 * nearest even; a NaN stays a (quiet) NaN, as dtypes.h's f32_to_bf16. */
static inline __m256i round8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* out[0..cols) = bfloat16(acc[0..cols) (+ bias)); acc holds a panel's 16 columns. */
static inline void store_row(const float *acc, const float *bias, long cols, uint16_t *out) {
  __m256 lo = _mm256_load_ps(acc), hi = _mm256_load_ps(acc + 8);
  if (bias != NULL) {
    if (cols == PANEL) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    } else {
      float b[PANEL] __attribute__((aligned(32))) = {0};
      memcpy(b, bias, sizeof(float) * cols);
      lo = _mm256_add_ps(lo, _mm256_load_ps(b));
      hi = _mm256_add_ps(hi, _mm256_load_ps(b + 8));
    }
  }
  /* packus interleaves the two 128-bit lanes; permute 0xD8 restores order. */
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(round8(lo), round8(hi)),
                                                  0xD8);
  if (cols == PANEL) {
    _mm256_storeu_si256((__m256i *)out, packed);
  } else {
    uint16_t tmp[PANEL] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)tmp, packed);
    memcpy(out, tmp, sizeof(uint16_t) * cols);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* With AVX512-BF16 the panels hold k in pairs instead (pack_panels_bf16
 * chooses the same way, `pdserve_gemm_bf16_pairs`): for K even, a panel's
 * pair row q is 32 bfloat16, (W[c][2q], W[c][2q + 1]) for c = 0 .. 15, and
 * one `vdpbf16ps` takes a row's pair (x[2q], x[2q + 1]), broadcast, against
 * it: 16 columns x 2 k multiply-adds in one instruction, where the widening
 * path needs an unpack and two multiply-adds for 16 x 1, so a decode step
 * reads the bfloat16 bytes at the rate they arrive. x is read as bfloat16
 * pairs in place (no widening copy).
 *
 * Arithmetic: the instruction adds x[2q + 1] W[c][2q + 1], then x[2q] W[c][2q]
 * to the float32 sum, each product exact and each addition rounded to
 * nearest even (bfloat16 subnormal inputs and float32 subnormal results are
 * taken as zero, as the instruction defines). Each output is ONE such chain
 * over q in order, so a row's result still does not depend on M, its group
 * or the thread count; against the widening path's chain the order within
 * a pair differs (up to summation order, as oneDNN's bfloat16 linear). */
#define KP 128       /* k pairs of a panel per pass: 8 KB, stays in L1 */
#define PF_PAIRS 64  /* pairs ahead (4 KB) the first row group prefetches */

typedef int32_t pair_t __attribute__((aligned(2), may_alias));

#define PLOAD(r) __m512 z##r = _mm512_loadu_ps(acc + (r) * PANEL)
#define PSTORE(r) _mm512_storeu_ps(acc + (r) * PANEL, z##r)
/* z_r += the row's pair q, broadcast from memory ({1to16}), dot w. Written
 * out because GCC does not fold `_mm512_set1_epi32` of a load into
 * vdpbf16ps: its separate vpbroadcastd per row made a 16-row group 10-13 %
 * slower at prefill sizes (docs/benchmarks.md, "bfloat16 pairs at prefill
 * sizes"). The two operands' products are the same whichever holds x, and
 * the instruction adds them in the same order, so the result is too. */
#define PDOT(r)                                                         \
  __asm__("vdpbf16ps %1%{1to16%}, %2, %0"                               \
          : "+v"(z##r)                                                  \
          : "m"(((const pair_t *)(x + (r) * x_stride))[q]), "v"(w))
#define PK_LOOP(BODY)                                                                   \
  _Pragma("GCC unroll 4")                                                               \
  for (long q = 0; q < qc; q++) {                                                       \
    PREFETCH_PANEL(prefetch, p + (q + PF_PAIRS) * 2 * PANEL, p + (q + KP) * 2 * PANEL); \
    const __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(p + q * 2 * PANEL)); \
    BODY                                                                                \
  }

static inline void prows16(const uint16_t *x, long x_stride, const uint16_t *p, long qc,
                           float *acc, int prefetch) {
  PLOAD(0); PLOAD(1); PLOAD(2); PLOAD(3); PLOAD(4); PLOAD(5); PLOAD(6); PLOAD(7);
  PLOAD(8); PLOAD(9); PLOAD(10); PLOAD(11); PLOAD(12); PLOAD(13); PLOAD(14); PLOAD(15);
  PK_LOOP(PDOT(0); PDOT(1); PDOT(2); PDOT(3); PDOT(4); PDOT(5); PDOT(6); PDOT(7);
          PDOT(8); PDOT(9); PDOT(10); PDOT(11); PDOT(12); PDOT(13); PDOT(14); PDOT(15);)
  PSTORE(0); PSTORE(1); PSTORE(2); PSTORE(3); PSTORE(4); PSTORE(5); PSTORE(6); PSTORE(7);
  PSTORE(8); PSTORE(9); PSTORE(10); PSTORE(11); PSTORE(12); PSTORE(13); PSTORE(14); PSTORE(15);
}

static inline void prows8(const uint16_t *x, long x_stride, const uint16_t *p, long qc,
                          float *acc, int prefetch) {
  PLOAD(0); PLOAD(1); PLOAD(2); PLOAD(3); PLOAD(4); PLOAD(5); PLOAD(6); PLOAD(7);
  PK_LOOP(PDOT(0); PDOT(1); PDOT(2); PDOT(3); PDOT(4); PDOT(5); PDOT(6); PDOT(7);)
  PSTORE(0); PSTORE(1); PSTORE(2); PSTORE(3); PSTORE(4); PSTORE(5); PSTORE(6); PSTORE(7);
}

static inline void prows4(const uint16_t *x, long x_stride, const uint16_t *p, long qc,
                          float *acc, int prefetch) {
  PLOAD(0); PLOAD(1); PLOAD(2); PLOAD(3);
  PK_LOOP(PDOT(0); PDOT(1); PDOT(2); PDOT(3);)
  PSTORE(0); PSTORE(1); PSTORE(2); PSTORE(3);
}

static inline void prows1(const uint16_t *x, long x_stride, const uint16_t *p, long qc,
                          float *acc, int prefetch) {
  PLOAD(0);
  PK_LOOP(PDOT(0);)
  PSTORE(0);
}

int pdserve_gemm_bf16_pairs(void) { return 1; }

/* pdserve_gemm_panels_bf16 for K even on panels of k pairs. */
static void gemm_pairs(const uint16_t *x, long x_stride, long M, const uint16_t *panels,
                       long K, long N, const float *bias, uint16_t *out, long out_stride,
                       int num_threads) {
  const long num_panels = (N + PANEL - 1) / PANEL, pairs = K / 2;
  /* The threads take the panels of each block of rows 8 at a time, as
   * they come free, and go on to the next block without a barrier (a
   * prefill chunk is several): a thread that starts late or loses its core
   * to another process for a while holds up no other. Against a fixed
   * half each, 8-12 % faster at decode sizes on two threads (both kernels
   * in one process, alternating). */
#pragma omp parallel num_threads(num_threads)
  {
    float acc[MB * PANEL] __attribute__((aligned(64)));
    for (long m0 = 0; m0 < M; m0 += MB) {
      const long rows = M - m0 < MB ? M - m0 : MB;
      const uint16_t *xb = x + m0 * x_stride;
#pragma omp for schedule(dynamic, 8) nowait
      for (long j = 0; j < num_panels; j++) {
        const uint16_t *pj = panels + j * K * PANEL;
        memset(acc, 0, sizeof(float) * PANEL * rows);
        for (long q0 = 0; q0 < pairs; q0 += KP) {
          const long qc = pairs - q0 < KP ? pairs - q0 : KP;
          const uint16_t *p = pj + q0 * 2 * PANEL;
          const int later = q0 + KP < pairs ? NEXT_BLOCK : NONE;
          int prefetch = NEAR;
          long m = 0;
          for (; m + 16 <= rows; m += 16, prefetch = later)
            prows16(xb + m * x_stride + 2 * q0, x_stride, p, qc, acc + m * PANEL, prefetch);
          for (; m + 8 <= rows; m += 8, prefetch = later)
            prows8(xb + m * x_stride + 2 * q0, x_stride, p, qc, acc + m * PANEL, prefetch);
          for (; m + 4 <= rows; m += 4, prefetch = later)
            prows4(xb + m * x_stride + 2 * q0, x_stride, p, qc, acc + m * PANEL, prefetch);
          for (; m < rows; m++, prefetch = later)
            prows1(xb + m * x_stride + 2 * q0, x_stride, p, qc, acc + m * PANEL, prefetch);
        }
        const long cols = (j + 1) * PANEL <= N ? PANEL : N - j * PANEL;
        for (long m = 0; m < rows; m++)
          store_row(acc + m * PANEL, bias == NULL ? NULL : bias + j * PANEL, cols,
                    out + (m0 + m) * out_stride + j * PANEL);
      }
    }
  }
}
#else
int pdserve_gemm_bf16_pairs(void) { return 0; }
#endif

/* Prefill rows (M >= WIDEN_M) are compute-bound: the panels are widened to
 * float32 (natural column order), PANELS_WIDE at a time, and gemm.c's
 * float32 tiles multiply the widened rows by them into a float32 chunk,
 * rounded once per output as store_row rounds. The same chain per output
 * as the decode groups' (widening is exact), so a row's result does not
 * change; the tiles ran a 1,024-row prefill of SmolLM2's projections in
 * about half the time of the widening groups (docs/benchmarks.md, "Prefill
 * GEMM"). */
#define WIDEN_M 24       /* rows from which gemm.c takes its prefill tiles */
#define PANELS_WIDE 64   /* panels widened per call of the float32 GEMM */

/* x [M, K] float32 (widened) times the bfloat16 panels, through float32 panels. */
static int gemm_widened(const float *x, long M, const uint16_t *panels, long K, long N,
                        const float *bias, uint16_t *out, long out_stride, int num_threads) {
  const long num_panels = (N + PANEL - 1) / PANEL;
  const long width = num_panels < PANELS_WIDE ? num_panels : PANELS_WIDE;
  float *wide = aligned_alloc(64, sizeof(float) * width * K * PANEL);
  float *res = aligned_alloc(64, sizeof(float) * M * width * PANEL);
  int code = wide == NULL || res == NULL;
  for (long j0 = 0; j0 < num_panels && code == 0; j0 += width) {
    const long count = num_panels - j0 < width ? num_panels - j0 : width;
    const long cols = (j0 + count) * PANEL <= N ? count * PANEL : N - j0 * PANEL;
    const __m256i zero = _mm256_setzero_si256();
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long r = 0; r < count * K; r++) {
      const __m256i w = _mm256_loadu_si256((const __m256i *)(panels + (j0 * K + r) * PANEL));
      _mm256_store_ps(wide + r * PANEL, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w)));
      _mm256_store_ps(wide + r * PANEL + 8, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w)));
    }
    code = pdserve_gemm_panels(x, K, M, wide, K, cols, bias == NULL ? NULL : bias + j0 * PANEL,
                               res, width * PANEL, num_threads);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long m = 0; m < M; m++)
      for (long c = 0; c < cols; c += PANEL)
        store_row(res + m * width * PANEL + c, NULL, cols - c < PANEL ? cols - c : PANEL,
                  out + m * out_stride + j0 * PANEL + c);
  }
  free(wide);
  free(res);
  return code;
}

int pdserve_gemm_bf16_available(void) { return 1; }

/* out[m][n] = bfloat16(sum_k x[m][k] * W[n][k] (+ bias[n])) for m < M, n < N;
 * x and out bfloat16 with rows `x16_stride` / `out_stride` elements apart,
 * bias float32 or NULL. Returns 0, 1 (out of memory) or 2 (a shape it does
 * not take). */
int pdserve_gemm_panels_bf16(const uint16_t *x16, long x16_stride, long M,
                             const uint16_t *panels, long K, long N, const float *bias,
                             uint16_t *out, long out_stride, int num_threads) {
  if (M < 0 || K < 1 || N < 1) return 2;
  if (M == 0) return 0;
  num_threads = gemm_team(M, K, N, num_threads);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (K % 2 == 0) {
    gemm_pairs(x16, x16_stride, M, panels, K, N, bias, out, out_stride, num_threads);
    return 0;
  }
#endif
  const long num_panels = (N + PANEL - 1) / PANEL;
  /* The rows widened once (M is a decode batch: small), K floats apart. */
  float *x = malloc(sizeof(float) * M * K);
  if (x == NULL) return 1;
  for (long m = 0; m < M; m++) widen(x16 + m * x16_stride, x + m * K, K);
  if (M >= WIDEN_M) {
    const int code = gemm_widened(x, M, panels, K, N, bias, out, out_stride, num_threads);
    free(x);
    return code;
  }
#pragma omp parallel num_threads(num_threads)
  {
    float acc[MB * PANEL] __attribute__((aligned(64)));
    const long x_stride = K;  /* the widened rows */
    for (long m0 = 0; m0 < M; m0 += MB) {
      const long rows = M - m0 < MB ? M - m0 : MB;
      const float *xb = x + m0 * x_stride;
#pragma omp for schedule(static)
      for (long j = 0; j < num_panels; j++) {
        const uint16_t *pj = panels + j * K * PANEL;
        memset(acc, 0, sizeof(float) * PANEL * rows);
        for (long k0 = 0; k0 < K; k0 += KC) {
          const long kc = K - k0 < KC ? K - k0 : KC;
          const uint16_t *p = pj + k0 * PANEL;
          long m = 0;
          const int later = k0 + KC < K ? NEXT_BLOCK : NONE;
          int prefetch = NEAR;
          for (; m + 4 <= rows; m += 4, prefetch = later)
            rows4(xb + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, prefetch);
          if (rows - m >= 2) {
            rows2(xb + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, prefetch);
            m += 2;
            prefetch = later;
          }
          if (rows - m == 1) rows1(xb + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, prefetch);
        }
        const long cols = (j + 1) * PANEL <= N ? PANEL : N - j * PANEL;
        for (long m = 0; m < rows; m++)
          store_row(acc + m * PANEL, bias == NULL ? NULL : bias + j * PANEL, cols,
                    out + (m0 + m) * out_stride + j * PANEL);
      }
    }
  }
  free(x);
  return 0;
}

#else /* no AVX2 + FMA: the caller keeps the float32 dense path */

int pdserve_gemm_bf16_available(void) { return 0; }
int pdserve_gemm_bf16_pairs(void) { return 0; }

int pdserve_gemm_panels_bf16(const uint16_t *x16, long x_stride, long M, const uint16_t *panels,
                             long K, long N, const float *bias, uint16_t *out, long out_stride,
                             int num_threads) {
  (void)x16; (void)x_stride; (void)M; (void)panels; (void)K; (void)N; (void)bias; (void)out;
  (void)out_stride; (void)num_threads;
  return 2;
}

#endif
