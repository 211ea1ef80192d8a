/* Paged decode attention for CPU pods, reading K/V in place from the paged cache.
 *
 * Built and loaded by kernels/native/__init__.py (the host's C compiler, at
 * first use; see there). Same contract as kernels.dispatch.paged_decode_attention:
 *   q      [B, Hq, D]                   element type T, rows `q_stride` elements apart
 *   cache  [2, num_blocks, BS, Hkv, D]  element type T, contiguous
 *   tables [B, W] int32 (rows `table_stride` apart), lens [B] int32
 *   out    [B, Hq, D]                   element type T, contiguous
 * T is float32, bfloat16 or float16; arithmetic is float32. `softcap` > 0
 * soft-caps each scaled score s to softcap * tanh(s / softcap) (Gemma 2);
 * 0 leaves scores as they are. D must be a
 * multiple of 16 (one 16-float vector per 16 dims).
 *
 * A work item is one sequence and a range of its KV heads. For each visible
 * token it loads the token's K row once (all heads of the range are
 * adjacent in memory) and scores it against the Hq / Hkv query heads of each
 * KV head; then a softmax per query head; then one pass over the V rows
 * accumulating the weighted sum. Every K/V row is read once, in place.
 * Items are dealt round-robin to `num_threads` OpenMP threads.
 *
 * Bounds: a context length above W * BS or a used block id outside
 * [0, num_blocks) stops the item with status 3 instead of reading out of
 * bounds; table entries past a sequence's last block are never read.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"
#include "vec.h"

typedef struct {
  const void *q, *cache;
  const int32_t *tables, *lens;
  void *out;
  long q_stride; /* elements between rows of `q` (>= num_q_heads * head_dim) */
  int batch, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size, table_width;
  long table_stride; /* elements between rows of `tables` (>= table_width) */
  int window; /* 0: no sliding window */
  float scale;
  float softcap; /* 0: none; else scores become softcap * tanh(score / softcap) */
  int heads_per_item; /* KV heads per work item (divides num_kv_heads) */
  int first_item, item_step;
  int status;
} Job;

static inline float hsum(vfloat v) {
  float s = 0.0f;
  for (int i = 0; i < LANES; i++) s += v[i];
  return s;
}

/* One kernel per element type: ELEM is the storage type, LOADV loads 16
 * elements as floats, LOAD1/STORE1 convert one element. */
#define DEFINE_KERNEL(NAME, ELEM, LOADV, LOAD1, STORE1)                                     \
  static void NAME(Job *job, float *scores, vfloat *query, vfloat *acc) {                   \
    const int group = job->num_q_heads / job->num_kv_heads;                                 \
    const int D = job->head_dim, BS = job->block_size, chunks = D / LANES;                  \
    const int heads = job->heads_per_item, items_per_seq = job->num_kv_heads / heads;       \
    const int rows = heads * group; /* query heads of one item */                          \
    const long token_stride = (long)job->num_kv_heads * D;                                  \
    const long block_stride = (long)BS * token_stride;                                      \
    const long value_offset = (long)job->num_blocks * block_stride;                         \
    const ELEM *cache = (const ELEM *)job->cache;                                           \
    const int num_items = job->batch * items_per_seq;                                       \
    for (int item = job->first_item; item < num_items; item += job->item_step) {            \
      const int b = item / items_per_seq, h0 = (item % items_per_seq) * heads;              \
      const long head0 = ((long)b * job->num_q_heads + (long)h0 * group) * D;               \
      ELEM *out = (ELEM *)job->out + head0;                                                 \
      const int len = job->lens[b];                                                         \
      if (len < 0 || len > job->table_width * BS) { job->status = 3; break; }               \
      const int start = (job->window > 0 && len > job->window) ? len - job->window : 0;     \
      const int n = len - start;                                                            \
      if (n == 0) {                                                                         \
        for (long i = 0; i < (long)rows * D; i++) out[i] = STORE1(0.0f);                    \
        continue;                                                                           \
      }                                                                                     \
      const int32_t *table = job->tables + (long)b * job->table_stride;                     \
      int bad_block = 0;                                                                    \
      for (int i = start / BS; i <= (len - 1) / BS; i++)                                    \
        bad_block |= table[i] < 0 || table[i] >= job->num_blocks;                           \
      if (bad_block) { job->status = 3; break; }                                            \
      const ELEM *q = (const ELEM *)job->q + b * job->q_stride + (long)h0 * group * D;     \
      for (int r = 0; r < rows; r++)                                                        \
        for (int c = 0; c < chunks; c++) {                                                  \
          vfloat v;                                                                         \
          for (int i = 0; i < LANES; i++) v[i] = LOAD1(q[(long)r * D + c * LANES + i]);    \
          query[r * chunks + c] = v * job->scale;                                           \
        }                                                                                   \
      for (int t = start; t < len; t++) {                                                   \
        const ELEM *k = cache + (long)table[t / BS] * block_stride                          \
                        + (long)(t % BS) * token_stride + (long)h0 * D;                     \
        for (int h = 0; h < heads; h++)                                                     \
          for (int g = 0; g < group; g++) {                                                 \
            const int r = h * group + g;                                                    \
            vfloat s = {0};                                                                 \
            for (int c = 0; c < chunks; c++)                                                \
              s += query[r * chunks + c] * LOADV(k + (long)h * D + c * LANES);              \
            const float score = hsum(s);                                                    \
            scores[(long)r * n + (t - start)] =                                             \
                job->softcap > 0.0f ? job->softcap * tanhf(score / job->softcap) : score;   \
          }                                                                                 \
      }                                                                                     \
      for (int r = 0; r < rows; r++) {                                                      \
        float *row = scores + (long)r * n;                                                  \
        float top = row[0];                                                                 \
        for (int i = 1; i < n; i++) top = row[i] > top ? row[i] : top;                      \
        float sum = 0.0f;                                                                   \
        for (int i = 0; i < n; i++) { row[i] = expf(row[i] - top); sum += row[i]; }         \
        const float inv = 1.0f / sum;                                                       \
        for (int i = 0; i < n; i++) row[i] *= inv;                                          \
        for (int c = 0; c < chunks; c++) acc[r * chunks + c] = (vfloat){0};                 \
      }                                                                                     \
      for (int t = start; t < len; t++) {                                                   \
        const ELEM *v = cache + value_offset + (long)table[t / BS] * block_stride           \
                        + (long)(t % BS) * token_stride + (long)h0 * D;                     \
        for (int h = 0; h < heads; h++)                                                     \
          for (int c = 0; c < chunks; c++) {                                                \
            const vfloat value = LOADV(v + (long)h * D + c * LANES);                        \
            for (int g = 0; g < group; g++) {                                               \
              const int r = h * group + g;                                                  \
              acc[r * chunks + c] += scores[(long)r * n + (t - start)] * value;             \
            }                                                                               \
          }                                                                                 \
      }                                                                                     \
      for (int r = 0; r < rows; r++)                                                        \
        for (int c = 0; c < chunks; c++)                                                    \
          for (int i = 0; i < LANES; i++)                                                   \
            out[(long)r * D + c * LANES + i] = STORE1(acc[r * chunks + c][i]);              \
    }                                                                                       \
  }

DEFINE_KERNEL(run_f32, float, load_f32, F32_LOAD, F32_STORE)
DEFINE_KERNEL(run_bf16, uint16_t, load_bf16, bf16_to_f32, f32_to_bf16)
DEFINE_KERNEL(run_f16, _Float16, load_f16, F16_LOAD, F16_STORE)

typedef void (*Kernel)(Job *, float *, vfloat *, vfloat *);

typedef struct {
  Job job;
  Kernel kernel;
} ThreadJob;

/* Per-thread scratch: scores for every query head of an item over the
 * longest context, and the item's queries and accumulators. */
static void run_job(ThreadJob *work) {
  Job *job = &work->job;
  long max_len = 0;
  for (int b = 0; b < job->batch; b++)
    if (job->lens[b] > max_len) max_len = job->lens[b];
  const long rows = (long)job->heads_per_item * (job->num_q_heads / job->num_kv_heads);
  const long chunks = job->head_dim / LANES;
  float *scores = malloc(sizeof(float) * (rows * max_len + 1));
  vfloat *vectors = aligned_alloc(sizeof(vfloat), sizeof(vfloat) * 2 * rows * chunks);
  if (scores == NULL || vectors == NULL) {
    job->status = 1;
  } else {
    work->kernel(job, scores, vectors, vectors + rows * chunks);
  }
  free(scores);
  free(vectors);
}

#define MAX_THREADS 64

/* dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0 on success; otherwise
 * `out` is undefined and the code says why: 1 out of memory, 2 unsupported
 * shape or dtype, 3 a context length or block id out of range. */
int pdserve_paged_decode_attention(const void *q, long q_stride, const void *cache,
                                   const int32_t *tables, const int32_t *lens, void *out,
                                   int dtype, int batch, int num_q_heads, int num_kv_heads,
                                   int head_dim, int num_blocks, int block_size,
                                   int table_width, long table_stride, int window, float scale,
                                   float softcap, int num_threads) {
  if (batch <= 0) return 0;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return 2;
  if (head_dim <= 0 || head_dim % LANES != 0) return 2;
  Kernel kernel = dtype == 0 ? run_f32 : dtype == 1 ? run_bf16 : dtype == 2 ? run_f16 : NULL;
  if (kernel == NULL) return 2;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  /* Whole sequences per item when there are enough of them to keep every
   * thread busy; otherwise split each sequence's KV heads. */
  int heads_per_item = num_kv_heads;
  while (batch * (num_kv_heads / heads_per_item) < num_threads && heads_per_item % 2 == 0)
    heads_per_item /= 2;
  const int num_items = batch * (num_kv_heads / heads_per_item);
  if (num_threads > num_items) num_threads = num_items;
  ThreadJob jobs[MAX_THREADS];
  for (int i = 0; i < num_threads; i++) {
    jobs[i].job = (Job){q, cache, tables, lens, out, q_stride, batch, num_q_heads,
                        num_kv_heads, head_dim, num_blocks, block_size, table_width, table_stride,
                        window, scale, softcap,
                        heads_per_item, i, num_threads, 0};
    jobs[i].kernel = kernel;
  }
  /* OpenMP from the libgomp torch already loaded (same soname, so the
   * loader reuses it): the work runs on torch's own thread pool, whose
   * workers are awake between ops, instead of threads competing with them. */
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
  for (int i = 0; i < num_threads; i++) run_job(&jobs[i]);
  int status = 0;
  for (int i = 0; i < num_threads; i++)
    if (jobs[i].job.status > status) status = jobs[i].job.status;
  return status;
}
