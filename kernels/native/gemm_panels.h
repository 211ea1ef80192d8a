/* What gemm.c (float32 panels) and gemm_bf16.c (bfloat16 panels) share:
 * the panel width, the prefetch modes of a row block, and how many threads
 * a call gets. */
#ifndef PDSERVE_NATIVE_GEMM_PANELS_H
#define PDSERVE_NATIVE_GEMM_PANELS_H

#define PANEL 16 /* output columns of one panel: two 8-float AVX registers */
enum { NONE, NEAR, NEXT_BLOCK };
/* A row group's prefetch at one k: NEAR (the first group brings the panel
 * in: `near`, some rows ahead, into L1), NEXT_BLOCK (the later groups find
 * it in L1 and fetch the panel's next block meanwhile: `next`, into L2) or
 * NONE. */
#define PREFETCH_PANEL(prefetch, near, next)                                 \
  do {                                                                      \
    if ((prefetch) == NEAR)                                                 \
      _mm_prefetch((const char *)(near), _MM_HINT_T0);                      \
    else if ((prefetch) == NEXT_BLOCK)                                      \
      _mm_prefetch((const char *)(next), _MM_HINT_T1);                      \
  } while (0)
#define PARALLEL_MIN (1L << 20) /* multiply-adds of a call worth a second thread */

/* Threads for an M x K x N call asked to use `num_threads`: at least one, no
 * more than there are panels to split, and one below PARALLEL_MIN: under
 * ~10 us of work a fork costs more than it saves (torch forks no sooner),
 * so a small model's projections stay on the calling thread. */
static inline int gemm_team(long M, long K, long N, int num_threads) {
  const long num_panels = (N + PANEL - 1) / PANEL;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > num_panels) num_threads = (int)num_panels;
  if (M * K * N < PARALLEL_MIN) num_threads = 1;
  return num_threads;
}

#endif
