/* The dense projections of float32 models on CPU: x [M, K] times a weight
 * packed in 16-column panels, for decode rows (small M) and prefill rows.
 *
 * Built with the other sources into one library (kernels/native/loader.py).
 *
 * Decode rows (M < LARGE_M = 24). A decode step at batch 8 streams every
 * weight once for 8 rows of activations. oneDNN's prepacked inner product does
 * that at ~8 GB/s on this project's AVX2 EPYC, about half of what two cores
 * read, because its small-M kernel computes no faster than the weights
 * arrive and does not overlap the two. This path streams each panel once,
 * prefetched ahead, and keeps it in L1 while every 4-row group of the
 * batch (8-row with AVX-512) uses it, the later groups prefetching the
 * panel's next block meanwhile (docs/benchmarks.md, "Decode GEMM").
 *
 * Prefill rows (M >= LARGE_M) are compute-bound: a 6-row x 16-column
 * register tile over rows of x first packed k-interleaved (gemm_large).
 *
 * Layout: `panels` [ceil(N / 16)][K][16] float32: panel j holds output
 * columns 16 j .. 16 j + 15 (zero past N), K-major, so a panel streams
 * sequentially. Each output element is one fused multiply-add chain over
 * k = 0 .. K - 1 in order, from 0, then + bias, on either path: a row's
 * result does not depend on M, on which rows share its group, on the path
 * or on the thread count.
 *
 * AVX2 + FMA only (the library is built with -march=native), with decode
 * rows on AVX-512 where the CPU has it; elsewhere pdserve_gemm_available()
 * is 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "gemm_panels.h"

#define KC 64        /* k rows of a panel per pass: 4 KB, stays in L1 (tuned below) */
#define MB 96        /* rows per block (accumulators: MB x 16 floats, 6 KB) */
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
 * (docs/benchmarks.md, "Huge pages and AVX-512 decode groups"). */
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

/* Prefill rows: 6 rows x 16 columns a tile. 12 accumulators + the panel's
 * k row (2) + a broadcast fill 15 of the 16 ymm registers, for 12 FMAs per
 * 8 loads (rows4: 8 per 6). Rows are packed first, 6 at a time with k
 * interleaved ([K][6]): a tile then reads one sequential stream, where 6
 * rows K floats apart would share L1 sets (K = 1024: all 6 in one set) and
 * defeat the prefetchers. A block of up to MB_L rows sweeps each panel's
 * KC_L x 16 blocks in turn: a block stays in L1 while the block's 32 tiles
 * use it, and the tiles prefetch the stream's next block into L2 (the
 * weights are read M / MB_L times, so they come from memory, not cache).
 * The tiles of a block keep their partial sums in `acc` between k-blocks:
 * a store and a load are exact, so each output is still one chain. */
#define LARGE_M 24       /* rows from which this path is the faster (measured below) */
#define MR 6             /* rows of a tile */
#define KC_L 256         /* k rows of a panel block: 16 KB in L1 */
#define MB_L 192         /* rows a panel block serves (accumulators: 12 KB) */
#define SPLIT_ROWS_MIN 192 /* rows a thread needs to take rows, not panels (gemm_large) */
/* Measured on the AVX2 EPYC against oneDNN's prepacked inner product over
 * the base model's per-layer projections at 1,024 rows, two threads,
 * interleaved in one process (the machine shared with other jobs, so
 * ratios of medians; "CPU" = process CPU time, which such sharing disturbs
 * less). Tiles straight from x, KC_L 256 / MB_L 96: 1.01-1.04x. Rows
 * packed: 1.01-1.05x; plus the next block's prefetch: 1.10-1.15x (one
 * thread: 75 -> 82 GFLOPS of ~92 peak; a tile in L1 alone reaches 88-90).
 * k-blocks outermost (x's block in L2, partial sums in out): 0.89-0.98x.
 * All of x packed, then each panel over every block: 1.02x CPU. KC_L 128
 * to 512 by MB_L 96 to 384: 1.11-1.17x CPU, no setting clear of the noise.
 * Rows over panels for the threads with 192 rows a thread and more: 1.11x
 * where the panel split with a barrier per block gave 1.02x while another
 * process held a core. 4-row groups against these tiles, CPU time over
 * every dense weight: 16 rows 58.6 / 62.9 ms, 24 rows 82.5 / 73.3, 32 rows
 * 83.3 / 83.5, 48 rows 145.7 / 116.8 (LARGE_M). After all of it, `pdserve
 * bench prefill-gemm` (06:55 UTC, docs/benchmarks.md, "Prefill GEMM"):
 * 1,192 against 1,369 ms at 1,024 rows (1.15x), 1.12-1.52x from 32 to
 * 2,048 rows. */

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

/* out[0 .. rows)[panel j's columns] = acc (+ bias). */
static void store_panel(const float *acc, long rows, long j, long N, const float *bias,
                        float *out, long out_stride) {
  const long cols = (j + 1) * PANEL <= N ? PANEL : N - j * PANEL;
  const float *bj = bias == NULL ? NULL : bias + j * PANEL;
  for (long m = 0; m < rows; m++) {
    float *o = out + m * out_stride + j * PANEL;
    const float *a = acc + m * PANEL;
    if (cols < PANEL) {
      for (long c = 0; c < cols; c++) o[c] = bj != NULL ? a[c] + bj[c] : a[c];
      continue;
    }
    __m256 a0 = _mm256_load_ps(a), a1 = _mm256_load_ps(a + 8);
    if (bj != NULL) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(bj));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(bj + 8));
    }
    _mm256_storeu_ps(o, a0);
    _mm256_storeu_ps(o + 8, a1);
  }
}

/* Rows x[0 .. rows) times panels j0 .. j1 - 1 into out[0 .. rows): `ap`
 * holds their whole tiles packed, the last rows % 6 are read from x. */
static void block_large(const float *x, long x_stride, long rows, const float *ap,
                        const float *panels, long K, long N, long j0, long j1,
                        const float *bias, float *out, long out_stride, float *acc) {
  const long tiles = rows / MR;
  /* The tiles after the first (which waits on the block) share out the
   * prefetch of the stream's next block: this panel's next KC_L rows, or the
   * next panel's first. One tile prefetching it all took 1.13x the CPU
   * time at 32 rows, where a block's compute barely covers its stream. */
  const long helpers = tiles > 1 ? tiles - 1 : 1, share = (KC_L + helpers - 1) / helpers;
  for (long j = j0; j < j1; j++) {
    for (long k0 = 0; k0 < K; k0 += KC_L) {
      const long kc = K - k0 < KC_L ? K - k0 : KC_L;
      const float *p = panels + (j * K + k0) * PANEL;
      for (long t = 0; t < tiles; t++) {
        const long h = tiles > 1 ? t - 1 : t, from = h * share;
        const long count = h < 0 || from >= KC_L ? 0 : KC_L - from < share ? KC_L - from : share;
        rows6(ap + t * MR * K + MR * k0, p, kc, acc + t * MR * PANEL, k0 == 0,
              p + (kc + from) * PANEL, count);
      }
      long m = tiles * MR;
      if (k0 == 0) memset(acc + m * PANEL, 0, sizeof(float) * PANEL * (rows - m));
      for (; m + 4 <= rows; m += 4)
        rows4(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
      for (; m + 2 <= rows; m += 2)
        rows2(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
      if (m < rows) rows1(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
    }
    store_panel(acc, rows, j, N, bias, out, out_stride);
  }
}

/* Two ways to share the work, neither with a barrier inside the call:
 * - from SPLIT_ROWS_MIN rows a thread, each thread takes whole blocks of
 *   rows (dynamically: a thread that shares its core gets fewer), packs
 *   them into its own buffer and runs every panel over them. The weights
 *   are read once per block, as with the panels shared out.
 * - below, the calling thread packs all rows first (at most ~2 % of the
 *   call's work) and each thread takes a share of the panels: the weights
 *   are read once per block in all.
 * While another process held a core, a barrier cost a scheduler tick
 * (~4 ms) each: packing each block together (a barrier per block) measured
 * 1.02x against 1.11x of oneDNN at 1,024 rows. */
static int gemm_large(const float *x, long x_stride, long M, const float *panels, long K,
                      long N, const float *bias, float *out, long out_stride, int num_threads) {
  const long num_panels = (N + PANEL - 1) / PANEL;
  if (M >= SPLIT_ROWS_MIN * num_threads) {
    long blocks = (M + MB_L - 1) / MB_L;
    blocks = (blocks + num_threads - 1) / num_threads * num_threads;
    const long mb = ((M + blocks - 1) / blocks + MR - 1) / MR * MR;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
      float acc[MB_L * PANEL] __attribute__((aligned(64)));
      float *ap = aligned_alloc(64, sizeof(float) * ((mb * K + 15) / 16 * 16));
      failed = ap == NULL;
#pragma omp for schedule(dynamic, 1) nowait
      for (long m0 = 0; m0 < M; m0 += mb) {
        if (ap == NULL) continue;
        const long rows = M - m0 < mb ? M - m0 : mb;
        for (long t = 0; t < rows / MR; t++)
          pack_rows6(x + (m0 + t * MR) * x_stride, x_stride, K, ap + t * MR * K);
        block_large(x + m0 * x_stride, x_stride, rows, ap, panels, K, N, 0, num_panels, bias,
                    out + m0 * out_stride, out_stride, acc);
      }
      free(ap);
    }
    return failed;
  }
  const long tiles = M / MR;
  float *packed = aligned_alloc(64, sizeof(float) * ((tiles * MR * K + 15) / 16 * 16 + 16));
  if (packed == NULL) return 1;
  for (long t = 0; t < tiles; t++)
    pack_rows6(x + t * MR * x_stride, x_stride, K, packed + t * MR * K);
#pragma omp parallel num_threads(num_threads)
  {
    float acc[MB_L * PANEL] __attribute__((aligned(64)));
    const long team = omp_get_num_threads(), me = omp_get_thread_num();
    const long j0 = num_panels * me / team, j1 = num_panels * (me + 1) / team;
    for (long m0 = 0; m0 < M; m0 += MB_L)
      block_large(x + m0 * x_stride, x_stride, M - m0 < MB_L ? M - m0 : MB_L,
                  packed + m0 * K, panels, K, N, j0, j1, bias, out + m0 * out_stride,
                  out_stride, acc);
  }
  free(packed);
  return 0;
}

int pdserve_gemm_available(void) { return 1; }

/* Decode rows: groups of 4, 2, 1 rows straight from x. */
static void gemm_small(const float *x, long x_stride, long M, const float *panels, long K,
                       long N, const float *bias, float *out, long out_stride,
                       int num_threads) {
  const long num_panels = (N + PANEL - 1) / PANEL;
  /* OpenMP from the libgomp torch already loaded (paged_decode.c). */
#pragma omp parallel num_threads(num_threads)
  {
    float acc[MB * PANEL] __attribute__((aligned(64)));
    for (long m0 = 0; m0 < M; m0 += MB) {
      const long rows = M - m0 < MB ? M - m0 : MB;
      const float *xb = x + m0 * x_stride;
      /* Panels 8 at a time as threads come free, no barrier after a block:
       * 3-6 % faster than fixed halves on two threads (gemm_bf16.c). */
#pragma omp for schedule(dynamic, 8) nowait
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
#if defined(__AVX512F__)
          for (; m + 8 <= rows; m += 8, prefetch = later)
            zrows8(xb + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, prefetch);
#endif
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
}

/* out[m][n] = sum_k x[m][k] * W[n][k] (+ bias[n]) for m < M, n < N.
 * x rows `x_stride` floats apart, out rows `out_stride` apart; bias may be
 * NULL. Returns 0, 1 when out of memory, or 2 for a shape it does not take. */
int pdserve_gemm_panels(const float *x, long x_stride, long M, const float *panels, long K,
                        long N, const float *bias, float *out, long out_stride,
                        int num_threads) {
  if (M < 0 || K < 1 || N < 1) return 2;
  if (M == 0) return 0;
  num_threads = gemm_team(M, K, N, num_threads);
  if (M >= LARGE_M)
    return gemm_large(x, x_stride, M, panels, K, N, bias, out, out_stride, num_threads);
  gemm_small(x, x_stride, M, panels, K, N, bias, out, out_stride, num_threads);
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
