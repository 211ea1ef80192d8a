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
 * Prefill rows (M >= LARGE_M) are compute-bound: register tiles over rows
 * of x first packed k-interleaved (gemm_large): 6 rows x 16 columns in ymm
 * registers, or with AVX-512 12 rows x two panels in zmm registers
 * (gemm_tiles.h).
 *
 * Layout: `panels` [ceil(N / 16)][K][16] float32: panel j holds output
 * columns 16 j .. 16 j + 15 (zero past N), K-major, so a panel streams
 * sequentially. Each output element is one fused multiply-add chain over
 * k = 0 .. K - 1 in order, from 0, then + bias, on either path: a row's
 * result does not depend on M, on which rows share its group, on the path
 * or on the thread count.
 *
 * AVX2 + FMA only (the library is built with -march=native), with decode
 * groups and prefill tiles on AVX-512 where the CPU has it; elsewhere pdserve_gemm_available()
 * is 0 and the caller keeps oneDNN.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "gemm_panels.h"
#include "exports.h"
#include "gemm_tiles.h"

#define MB 96        /* rows per block (accumulators: MB x 16 floats, 6 KB) */

/* Prefill rows are packed first, 6 at a time with k interleaved ([K][6]):
 * a tile then reads one sequential stream, where 6 rows K floats apart
 * would share L1 sets (K = 1024: all 6 in one set) and defeat the
 * prefetchers. A block of up to MB_L rows sweeps each panel's KC_L x 16
 * blocks in turn (with AVX-512, two panels' at once: 16 KB, half of L1):
 * the block stays in L1 while the block's tiles use it, and the tiles
 * prefetch the stream's next block into L2 (the weights are read M / MB_L
 * times, so they come from memory, not cache). The tiles keep their
 * partial sums in `acc` between k-blocks: a store and a load are exact, so
 * each output is still one chain. The sizes below were measured against
 * oneDNN's prepacked inner product (`pdserve bench prefill-gemm`;
 * docs/benchmarks.md, "Prefill GEMM"): KC_L 128 rather than 256 once two
 * panels share L1, MB_L 384 rather than 192 to read the weights fewer
 * times, with no loss on AVX2. */
#define LARGE_M 24       /* rows from which the tiles beat the decode groups */
#define KC_L 128         /* k rows of a panel block: 8 KB a panel */
#define MB_L 384         /* rows a panel block serves (acc: 2 x 24 KB, two panels) */
#define SPLIT_ROWS_MIN 192 /* rows a thread needs to take rows, not panels (gemm_large) */

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

/* The prefetch of a stream's next block (KC_L panel rows) shared out among
 * the `units` tile calls of a k-block: the first waits on the block and
 * prefetches nothing, the others take equal shares (a lone unit takes it
 * all). Sets *from to the unit's first row; returns its row count. */
static inline long prefetch_share(long unit, long units, long *from) {
  const long helpers = units > 1 ? units - 1 : 1, share = (KC_L + helpers - 1) / helpers;
  const long h = units > 1 ? unit - 1 : unit;
  *from = h < 0 ? 0 : h * share;
  if (h < 0 || *from >= KC_L) return 0;
  return KC_L - *from < share ? KC_L - *from : share;
}

/* Rows x[m .. rows) (past the last whole tile) times one k-block p (k rows
 * k0 .. k0 + kc) into acc, straight from x in decode groups; the block at
 * k0 = 0 starts their sums at 0. */
static void rest_rows(const float *x, long x_stride, long m, long rows, const float *p,
                      long k0, long kc, float *acc) {
  if (k0 == 0) memset(acc + m * PANEL, 0, sizeof(float) * PANEL * (rows - m));
  for (; m + 4 <= rows; m += 4)
    rows4(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
  for (; m + 2 <= rows; m += 2)
    rows2(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
  if (m < rows) rows1(x + m * x_stride + k0, x_stride, p, kc, acc + m * PANEL, NONE);
}

/* Rows ap's tiles and x[tiles * 6 .. rows) times one panel's k-blocks into
 * acc; the tiles share out the prefetch of the stream's next block: this
 * panel's next KC_L rows, or the next panel's first. One tile prefetching
 * it all took 1.13x the CPU time at 32 rows, where a block's compute barely
 * covers its stream. */
static void panel_large(const float *x, long x_stride, long rows, const float *ap,
                        const float *pj, long K, float *acc) {
  const long tiles = rows / MR;
  for (long k0 = 0; k0 < K; k0 += KC_L) {
    const long kc = K - k0 < KC_L ? K - k0 : KC_L;
    const float *p = pj + k0 * PANEL;
    for (long t = 0; t < tiles; t++) {
      long from;
      const long count = prefetch_share(t, tiles, &from);
      rows6(ap + t * MR * K + MR * k0, p, kc, acc + t * MR * PANEL, k0 == 0,
            p + (kc + from) * PANEL, count);
    }
    rest_rows(x, x_stride, tiles * MR, rows, p, k0, kc, acc);
  }
}

#if defined(__AVX512F__)
/* panel_large for panels pj and pj + K * PANEL at once: the tiles take both,
 * the rows past the last whole tile each panel in turn. */
static void pair_large(const float *x, long x_stride, long rows, const float *ap,
                       const float *pj, long K, float *acc0, float *acc1) {
  const long tiles = rows / MR, units = tiles / 2 + tiles % 2;
  const float *pk = pj + K * PANEL;
  for (long k0 = 0; k0 < K; k0 += KC_L) {
    const long kc = K - k0 < KC_L ? K - k0 : KC_L;
    const float *p0 = pj + k0 * PANEL, *p1 = pk + k0 * PANEL;
    for (long t = 0; t < tiles; t += 2) {
      long from;
      const long count = prefetch_share(t / 2, units, &from);
      const float *a = ap + t * MR * K + MR * k0;
      float *c0 = acc0 + t * MR * PANEL, *c1 = acc1 + t * MR * PANEL;
      if (t + 1 < tiles) {
        pair_rows12(a, a + MR * K, p0, p1, kc, c0, c1, k0 == 0, p0 + (kc + from) * PANEL,
                    p1 + (kc + from) * PANEL, count);
      } else { /* a last odd tile: the ymm tile, panel by panel */
        rows6(a, p0, kc, c0, k0 == 0, p0 + (kc + from) * PANEL, count);
        rows6(a, p1, kc, c1, k0 == 0, p1 + (kc + from) * PANEL, count);
      }
    }
    rest_rows(x, x_stride, tiles * MR, rows, p0, k0, kc, acc0);
    rest_rows(x, x_stride, tiles * MR, rows, p1, k0, kc, acc1);
  }
}
#endif

/* Rows x[0 .. rows) times panels j0 .. j1 - 1 into out[0 .. rows): `ap`
 * holds their whole tiles packed, the last rows % 6 are read from x. `acc`
 * holds 2 * MB_L rows of one panel. */
static void block_large(const float *x, long x_stride, long rows, const float *ap,
                        const float *panels, long K, long N, long j0, long j1,
                        const float *bias, float *out, long out_stride, float *acc) {
  long j = j0;
#if defined(__AVX512F__)
  for (; j + 2 <= j1; j += 2) {
    pair_large(x, x_stride, rows, ap, panels + j * K * PANEL, K, acc, acc + MB_L * PANEL);
    store_panel(acc, rows, j, N, bias, out, out_stride);
    store_panel(acc + MB_L * PANEL, rows, j + 1, N, bias, out, out_stride);
  }
#endif
  for (; j < j1; j++) {
    panel_large(x, x_stride, rows, ap, panels + j * K * PANEL, K, acc);
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
      float acc[2 * MB_L * PANEL] __attribute__((aligned(64)));
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
    float acc[2 * MB_L * PANEL] __attribute__((aligned(64)));
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
