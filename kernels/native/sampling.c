/* A sampling step's reductions over float32 logits rows, in one pass or two
 * per row instead of torch's several (engine/sampler.py).
 *
 * Built with the other sources into one library (kernels/native/loader.py).
 * Per row of `vocab` logits (rows `stride` floats apart):
 *   argmax  the first index of the row's maximum, as torch.argmax picks it
 *           (the first NaN when the row has one);
 *   max     that maximum (NaN for a row with a NaN);
 *   logsum  log(sum_j exp(x_j - max)), when `logsum` is not NULL: the
 *           log-softmax of x_j is then (x_j - max) - logsum, the formula
 *           torch's log_softmax uses. Summed in float64, so the 49,152-term
 *           sum of a real vocabulary keeps float32's precision. NaN for a
 *           row with a NaN or with every entry -inf (as log_softmax gives).
 * Why: a CPU decode step spent ~0.5 ms in argmax, log_softmax, the rows'
 * copy and topk(1) for the chosen token's logprob (8 rows of SmolLM2's
 * 49,152 logits); torch's argmax is not vectorised on CPU (~100 us here
 * where its amax takes ~10). Rows are shared among the threads whole, so a
 * row's results do not depend on the thread count.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

/* Rows worth a second thread: below this many logits the fork costs more. */
#define STATS_PARALLEL_MIN (1L << 15)

typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef double vdouble8 __attribute__((vector_size(8 * sizeof(double))));

/* The row's maximum and the first index holding it, in one pass: each lane
 * keeps its own first maximum (a strict > never moves it to a later tie),
 * then the lowest index among the lanes holding the row's maximum. Whether
 * the row has a NaN is noted; the caller then looks for the first one. */
static float row_max(const float *x, long vocab, long *index, int *has_nan) {
  vfloat top = (vfloat){0} - INFINITY;
  vint at = {0}, nan = {0}, lane_index;
  for (int lane = 0; lane < LANES; lane++) lane_index[lane] = lane;
  long j = 0;
  for (; j + LANES <= vocab; j += LANES) {
    const vfloat v = load_f32(x + j);
    const vint higher = (vint)(v > top);
    nan |= (vint)(v != v);
    top = vselect(higher, v, top);
    at = (higher & (lane_index + (int32_t)j)) | (~higher & at);
  }
  float m = -INFINITY;
  long best = vocab;
  int any_nan = 0;
  for (int lane = 0; lane < LANES; lane++) any_nan |= nan[lane] != 0;
  for (int lane = 0; lane < LANES; lane++)
    if (top[lane] > m) m = top[lane];
  for (int lane = 0; lane < LANES; lane++)
    if (top[lane] == m && at[lane] < best) best = at[lane];
  if (best == vocab) best = 0; /* no full chunk, or every entry -inf */
  for (; j < vocab; j++) {
    any_nan |= x[j] != x[j];
    if (x[j] > m) m = x[j], best = j;
  }
  if (m == -INFINITY) best = 0; /* every entry -inf: torch's argmax says 0 */
  *index = best;
  *has_nan = any_nan;
  return m;
}

static long first_nan(const float *x, long vocab) {
  for (long j = 0; j < vocab; j++)
    if (x[j] != x[j]) return j;
  return 0;
}

/* log(sum exp(x_j - m)) for a finite m: exp in float32 (vec.h), summed in
 * float32 over blocks of SUM_BLOCK entries (two lanes of partial sums per
 * vector lane), each block's sums then added in float64, so a 49,152-term
 * sum keeps float32's precision without a conversion per term. */
#define SUM_BLOCK 512
static float row_logsum(const float *x, long vocab, float m) {
  vdouble8 total = {0};
  long j = 0;
  while (j + LANES <= vocab) {
    vfloat a = {0}, b = {0};
    const long end = j + SUM_BLOCK <= vocab ? j + SUM_BLOCK : vocab - (vocab - j) % LANES;
    for (; j + 2 * LANES <= end; j += 2 * LANES) {
      a += vexp(load_f32(x + j) - m);
      b += vexp(load_f32(x + j + LANES) - m);
    }
    if (j < end) a += vexp(load_f32(x + j) - m), j += LANES;
    const vfloat s = a + b;
    vfloat8 half[2];
    memcpy(half, &s, sizeof half);
    total += __builtin_convertvector(half[0], vdouble8) + __builtin_convertvector(half[1], vdouble8);
  }
  double sum = 0.0;
  for (int lane = 0; lane < 8; lane++) sum += total[lane];
  for (; j < vocab; j++) sum += expf(x[j] - m);
  return (float)log(sum);
}

/* Returns 0, or 2 for a shape this kernel does not take. */
int pdserve_logit_stats(const float *x, long stride, long rows, long vocab, int64_t *argmax,
                        float *max_out, float *logsum, int num_threads) {
  if (rows < 0 || vocab <= 0 || stride < vocab) return 2;
  if (rows * vocab < STATS_PARALLEL_MIN || rows < 2) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long i = 0; i < rows; i++) {
    const float *row = x + i * stride;
    int has_nan;
    long index;
    const float m = row_max(row, vocab, &index, &has_nan);
    argmax[i] = has_nan ? first_nan(row, vocab) : index;
    max_out[i] = has_nan ? NAN : m;
    if (logsum != NULL) logsum[i] = has_nan || isinf(m) ? NAN : row_logsum(row, vocab, m);
  }
  return 0;
}
