/* The dense projections of decode rows: float32 x [M, K] times a weight
 * packed in 16-column panels, for small M.
 *
 * Built with the other sources into one library (kernels/native/loader.py).
 * A decode step at batch 8 streams every weight once for 8 rows of
 * activations. oneDNN's prepacked inner product (the prefill path) does
 * that at ~8 GB/s on this project's AVX2 EPYC, about half of what two cores
 * read, because its small-M kernel computes no faster than the weights
 * arrive and does not overlap the two. This kernel streams each panel once,
 * prefetched ahead, and keeps it in L1 while every 4-row group of the
 * batch uses it, the later groups prefetching the panel's next block
 * meanwhile (docs/benchmarks.md, "Decode GEMM").
 *
 * Layout: `panels` [ceil(N / 16)][K][16] float32: panel j holds output
 * columns 16 j .. 16 j + 15 (zero past N), K-major, so a panel streams
 * sequentially. Each output element is one fused multiply-add chain over
 * k = 0 .. K - 1 in order, then + bias: a row's result does not depend on
 * M, on which rows share its group, or on the thread count.
 *
 * AVX2 + FMA only (the library is built with -march=native); elsewhere
 * pdserve_gemm_available() is 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define PANEL 16
#define KC 64        /* k rows of a panel per pass: 4 KB, stays in L1 (tuned below) */
#define MB 96        /* rows per block (accumulators: MB x 16 floats, 6 KB) */
#define PREFETCH 64  /* k rows ahead (4 KB) the first row group prefetches */
/* KC and PREFETCH measured on the AVX2 EPYC (interleaved A/B over the base
 * model's weights, two threads): KC 256 / PREFETCH 32 -> 64 / 64 took 8
 * rows from 22.9-25.9 to 20.0-21.8 ms and 16 rows from 32.8-35.4 to
 * 29.1-31.8 ms; 32 and 128 rows of KC, 32 and 128 of PREFETCH were no better. */
enum { NONE, NEAR, NEXT_BLOCK };
#define PARALLEL_MIN (1L << 20) /* multiply-adds of a call worth a second thread */

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
    if (prefetch == NEAR)                                                               \
      _mm_prefetch((const char *)(p + (k + PREFETCH) * PANEL), _MM_HINT_T0);            \
    else if (prefetch == NEXT_BLOCK)                                                    \
      _mm_prefetch((const char *)(p + (k + KC) * PANEL), _MM_HINT_T1);                  \
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

int pdserve_gemm_available(void) { return 1; }

/* out[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) for m < M, n < N.
 * x rows `x_stride` floats apart, out rows `out_stride` apart; bias may be
 * NULL. Returns 0, or 2 for a shape it does not take. */
int pdserve_gemm_panels(const float *x, long x_stride, long M, const float *panels, long K,
                        long N, const float *bias, float *out, long out_stride,
                        int num_threads) {
  if (M < 0 || K < 1 || N < 1) return 2;
  if (M == 0) return 0;
  if (num_threads < 1) num_threads = 1;
  const long num_panels = (N + PANEL - 1) / PANEL;
  if (num_threads > num_panels) num_threads = (int)num_panels;
  /* Below ~10 us of work a fork costs more than it saves (torch forks no
   * sooner): a small model's projections stay on the calling thread. */
  if (M * K * N < PARALLEL_MIN) num_threads = 1;
  /* OpenMP from the libgomp torch already loaded (paged_decode.c). */
#pragma omp parallel num_threads(num_threads)
  {
    float acc[MB * PANEL] __attribute__((aligned(64)));
    for (long m0 = 0; m0 < M; m0 += MB) {
      const long rows = M - m0 < MB ? M - m0 : MB;
      const float *xb = x + m0 * x_stride;
#pragma omp for schedule(static)
      for (long j = 0; j < num_panels; j++) {
        const float *pj = panels + j * K * PANEL;
        memset(acc, 0, sizeof(float) * PANEL * rows);
        for (long k0 = 0; k0 < K; k0 += KC) {
          const long kc = K - k0 < KC ? K - k0 : KC;
          const float *p = pj + k0 * PANEL;
          long m = 0;
          /* The first group brings the panel in; the rest find it in L1 and
           * fetch the next block meanwhile (the last block has none). */
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
        for (long m = 0; m < rows; m++) {
          float *o = out + (m0 + m) * out_stride + j * PANEL;
          const float *a = acc + m * PANEL;
          if (bias != NULL)
            for (long c = 0; c < cols; c++) o[c] = a[c] + bias[j * PANEL + c];
          else
            memcpy(o, a, sizeof(float) * cols);
        }
      }
    }
  }
  return 0;
}

#else /* no AVX2 + FMA: the caller keeps oneDNN */

int pdserve_gemm_available(void) { return 0; }

int pdserve_gemm_panels(const float *x, long x_stride, long M, const float *panels, long K,
                        long N, const float *bias, float *out, long out_stride,
                        int num_threads) {
  (void)x; (void)x_stride; (void)M; (void)panels; (void)K; (void)N; (void)bias; (void)out;
  (void)out_stride; (void)num_threads;
  return 2;
}

#endif
