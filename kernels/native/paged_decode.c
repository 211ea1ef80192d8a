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
 * A work item is one sequence and a range of its KV heads. Its visible
 * tokens are taken CHUNK at a time (a chunk may cross block boundaries;
 * the last one may be short). Three passes (paged_decode_simd.h has their
 * inner loops: AVX-512 or AVX2 where the host has it, TILE 16 or 8):
 *   scores  per chunk and KV head: the chunk's K rows (used in place for
 *           float32, else converted once into a small buffer) are scored
 *           against each of the Hq / Hkv query heads of that KV head, TILE
 *           dot products at a time with one reduction for all of them;
 *   softmax per query head over its row of scores (soft-capped first);
 *   values  per chunk and KV head: each query head's accumulator takes the
 *           chunk's V rows weighted by its CHUNK probabilities.
 * Before this layout one score was one dot product and one horizontal sum,
 * with the softcap test and a scalar expf per score: ~5-13x slower
 * (docs/kernels.md, "Decode attention").
 * Every K/V row is read from the cache once, in place; each (chunk, KV
 * head) step requests the next step's rows as it goes (prefetch_next_step).
 * One pass with an online softmax per chunk (a token's K and V rows read
 * together) measured slower: the per-chunk max, sum and rescale of every
 * query head cost more than the second stream over the rows saves.
 * Items are claimed one at a time from a shared counter by `num_threads`
 * OpenMP threads: a thread that loses its core to another process for a
 * while (the router, the pod's gRPC thread), or draws the longer
 * sequences, leaves the rest to the others instead of holding up the
 * step, as a fixed share each would.
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
#include "exports.h"
#include "paged_decode_simd.h"
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
  int *next_item; /* shared by the threads: the next unclaimed item */
  int status;
} Job;

/* A storage type: n elements (n a multiple of LANES) to and from float32.
 * K and V rows of float32 are read in place; the others are converted a
 * row at a time into scratch, once per chunk. */
typedef struct {
  size_t size;
  int is_float32; /* rows are used in place, never converted */
  void (*to_floats)(const void *src, long n, float *dst);
  void (*from_floats)(const float *src, long n, void *dst);
} Dtype;

static void f32_to_floats(const void *src, long n, float *dst) {
  memcpy(dst, src, sizeof(float) * n);
}
static void f32_from_floats(const float *src, long n, void *dst) {
  memcpy(dst, src, sizeof(float) * n);
}
static void bf16_to_floats(const void *src, long n, float *dst) {
  bf16_row_to_floats(src, n, dst);
}
static void bf16_from_floats(const float *src, long n, void *dst) {
  for (long i = 0; i < n; i += LANES) store_bf16((uint16_t *)dst + i, load_f32(src + i));
}
static void f16_to_floats(const void *src, long n, float *dst) {
  f16_row_to_floats(src, n, dst);
}
static void f16_from_floats(const float *src, long n, void *dst) {
  for (long i = 0; i < n; i += LANES) store_f16((_Float16 *)dst + i, load_f32(src + i));
}

static const Dtype DTYPES[3] = {
    {sizeof(float), 1, f32_to_floats, f32_from_floats},
    {sizeof(uint16_t), 0, bf16_to_floats, bf16_from_floats},
    {sizeof(_Float16), 0, f16_to_floats, f16_from_floats},
};

/* Per-thread scratch (64-byte aligned); `stride` floats between rows of
 * `scores`: a multiple of LANES with room for a last chunk's CHUNK scores
 * past the longest context. */
typedef struct {
  float *scores; /* [rows, stride]: scores, then probabilities */
  float *query;  /* [rows, D]: the item's query heads times `scale` */
  float *acc;    /* [rows, D]: the weighted sums of V */
  float *rows;   /* [CHUNK, D]: one chunk's K or V rows of one head as float32 */
  long stride;
} Scratch;

/* The work item being run: sequence b, KV heads [h0, h0 + heads). */
typedef struct {
  int b, h0, heads, group, start, len; /* visible tokens: [start, len) */
  const int32_t *table;
} Item;

/* Element offsets (into one half of the cache) of the rows of KV head h0 of
 * tokens t0 .. t0 + count - 1; a short chunk repeats its last row, so every
 * chunk has CHUNK readable rows (whose probabilities are 0 past the end). */
static void chunk_offsets(const Job *job, const Item *it, int t0, int count, long off[CHUNK]) {
  const int BS = job->block_size;
  const long token_stride = (long)job->num_kv_heads * job->head_dim;
  int block = t0 / BS, slot = t0 % BS;
  for (int j = 0; j < count; j++) {
    off[j] = ((long)it->table[block] * BS + slot) * token_stride + (long)it->h0 * job->head_dim;
    if (++slot == BS) {
      block++;
      slot = 0;
    }
  }
  for (int j = count; j < CHUNK; j++) off[j] = off[count - 1];
}

/* Float32 rows of head h0 + h for a chunk: in place for float32, else
 * converted into `buf` (each distinct row once). */
static inline void chunk_rows(const Dtype *dt, const void *half, const long off[CHUNK],
                              long head_offset, int count, int D, float *buf,
                              const float *rows[CHUNK]) {
  for (int j = 0; j < count; j++) {
    if (dt->is_float32) {
      rows[j] = (const float *)half + off[j] + head_offset;
    } else {
      dt->to_floats((const char *)half + (off[j] + head_offset) * dt->size, D,
                    buf + (long)j * D);
      rows[j] = buf + (long)j * D;
    }
  }
  for (int j = count; j < CHUNK; j++) rows[j] = rows[count - 1];
}

/* Rows [a, b) of the next (chunk, KV head) step requested: head h + 1 of
 * this chunk (offsets `off`), or head 0 of the next chunk (`next`, when
 * next_count > 0), so they arrive while this step computes: a score step
 * asks for them in slices between its dot products, a value step at once
 * (its weighted sums are one call). A decode step's KV comes from DRAM
 * (the weights evict it between layers), where this pays; other schemes
 * measured no better (docs/kernels.md, "Decode attention"). */
static inline void prefetch_next_step(const Dtype *dt, const void *half, const Item *it, int h,
                                      const long off[CHUNK], const long next[CHUNK],
                                      int next_count, int D, int a, int b) {
  const long *rows = off;
  long head_offset = (long)(h + 1) * D;
  if (h + 1 == it->heads) {
    if (next_count <= 0) return;
    rows = next;
    head_offset = 0;
  }
  const long bytes = (long)D * dt->size;
  for (int j = a; j < b; j++) {
    const char *row = (const char *)half + (rows[j] + head_offset) * dt->size;
    for (long c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 3);
  }
}

/* Raw scores of every query head of the item over its visible tokens. */
static void score_keys(const Job *job, const Dtype *dt, const Item *it, Scratch *s) {
  const int D = job->head_dim;
  for (int t0 = it->start; t0 < it->len; t0 += CHUNK) {
    const int count = it->len - t0 < CHUNK ? it->len - t0 : CHUNK;
    const int t1 = t0 + CHUNK, next_count = it->len - t1 < CHUNK ? it->len - t1 : CHUNK;
    long off[CHUNK], next[CHUNK];
    chunk_offsets(job, it, t0, count, off);
    if (next_count > 0) chunk_offsets(job, it, t1, next_count, next);
    for (int h = 0; h < it->heads; h++) {
      const int tiles = (count + TILE - 1) / TILE, calls = it->group * tiles;
      const float *rows[CHUNK];
#if defined(PDSERVE_DECODE_BF16_SCORES)
      /* bfloat16: q and the K pairs multiplied as stored (no rows converted) */
      const int pairs = dt == &DTYPES[1];
      const uint16_t *rows16[CHUNK];
      const uint16_t *q16 = (const uint16_t *)job->q + (long)it->b * job->q_stride
                            + ((long)it->h0 * it->group + (long)h * it->group) * D;
      if (pairs)
        for (int j = 0; j < CHUNK; j++)
          rows16[j] = (const uint16_t *)job->cache + off[j < count ? j : count - 1] + (long)h * D;
      else
#endif
        chunk_rows(dt, job->cache, off, (long)h * D, count, D, s->rows, rows);
      for (int g = 0; g < it->group; g++) {
        const long r = (long)h * it->group + g;
        float *out = s->scores + r * s->stride + (t0 - it->start);
        for (int j = 0; j < count; j += TILE) {
          const int c = g * tiles + j / TILE;
          prefetch_next_step(dt, job->cache, it, h, off, next, next_count, D,
                             c * CHUNK / calls, (c + 1) * CHUNK / calls);
#if defined(PDSERVE_DECODE_BF16_SCORES)
          if (pairs)
            dot_tile_bf16(q16 + (long)g * D, rows16 + j, D, job->scale, out + j);
          else
#endif
            dot_tile(s->query + r * D, rows + j, D, out + j);
        }
      }
    }
  }
}

/* acc[r] = sum over visible tokens t of p[r, t] * V[t], per query head r. */
static void accumulate_values(const Job *job, const Dtype *dt, const Item *it, Scratch *s) {
  const int D = job->head_dim;
  const char *values = (const char *)job->cache
                       + (long)job->num_blocks * job->block_size * job->num_kv_heads * D * dt->size;
  memset(s->acc, 0, sizeof(float) * it->heads * it->group * D);
  for (int t0 = it->start; t0 < it->len; t0 += CHUNK) {
    const int count = it->len - t0 < CHUNK ? it->len - t0 : CHUNK;
    const int t1 = t0 + CHUNK, next_count = it->len - t1 < CHUNK ? it->len - t1 : CHUNK;
    long off[CHUNK], next[CHUNK];
    chunk_offsets(job, it, t0, count, off);
    if (next_count > 0) chunk_offsets(job, it, t1, next_count, next);
    for (int h = 0; h < it->heads; h++) {
      const long r = (long)h * it->group;
      float *acc = s->acc + r * D;
      const float *p = s->scores + r * s->stride + (t0 - it->start);
#if defined(PDSERVE_DECODE_BF16_VALUES)
      if (dt == &DTYPES[1]) { /* bfloat16 rows widened in registers, not copied */
        const uint16_t *rows[CHUNK];
        for (int j = 0; j < CHUNK; j++)
          rows[j] = (const uint16_t *)values + off[j < count ? j : count - 1] + (long)h * D;
        prefetch_next_step(dt, values, it, h, off, next, next_count, D, 0, CHUNK);
        accumulate_group_bf16(acc, p, s->stride, it->group, rows, D);
        continue;
      }
#endif
      const float *rows[CHUNK];
      chunk_rows(dt, values, off, (long)h * D, count, D, s->rows, rows);
      prefetch_next_step(dt, values, it, h, off, next, next_count, D, 0, CHUNK);
      accumulate_group(acc, p, s->stride, it->group, rows, D);
    }
  }
}

/* One work item; 0, or 3 for a context length or used block id out of range. */
static int run_item(const Job *job, const Dtype *dt, int item, Scratch *s) {
  const int items_per_seq = job->num_kv_heads / job->heads_per_item, D = job->head_dim;
  Item it = {.b = item / items_per_seq, .heads = job->heads_per_item,
             .group = job->num_q_heads / job->num_kv_heads};
  it.h0 = (item % items_per_seq) * it.heads;
  const long rows = (long)it.heads * it.group;
  const long head0 = (long)it.h0 * it.group * D; /* first query head's offset in a row */
  char *out = (char *)job->out + ((long)it.b * job->num_q_heads * D + head0) * dt->size;
  it.len = job->lens[it.b];
  if (it.len < 0 || it.len > job->table_width * job->block_size) return 3;
  it.start = (job->window > 0 && it.len > job->window) ? it.len - job->window : 0;
  if (it.len == it.start) { /* all three types' 0.0 is all zero bits */
    memset(out, 0, rows * D * dt->size);
    return 0;
  }
  it.table = job->tables + (long)it.b * job->table_stride;
  for (int i = it.start / job->block_size; i <= (it.len - 1) / job->block_size; i++)
    if (it.table[i] < 0 || it.table[i] >= job->num_blocks) return 3;
  dt->to_floats((const char *)job->q + ((long)it.b * job->q_stride + head0) * dt->size,
                rows * D, s->query);
  for (long i = 0; i < rows * D; i++) s->query[i] *= job->scale;
  score_keys(job, dt, &it, s);
  for (long r = 0; r < rows; r++)
    softmax_row(s->scores + r * s->stride, it.len - it.start, job->softcap);
  accumulate_values(job, dt, &it, s);
  dt->from_floats(s->acc, rows * D, out);
  return 0;
}

typedef struct {
  Job job;
  const Dtype *dtype;
} ThreadJob;

/* Allocates the thread's scratch (one block) and runs its items; the first
 * failing item stops the thread with its status. */
static void run_job(ThreadJob *work) {
  Job *job = &work->job;
  /* A length above the table's span is refused (status 3) before its scores
   * are written: no room for it, however large it is. */
  long max_len = 0;
  for (int b = 0; b < job->batch; b++)
    if (job->lens[b] > max_len) max_len = job->lens[b];
  if (max_len > (long)job->table_width * job->block_size)
    max_len = (long)job->table_width * job->block_size;
  const long rows = (long)job->heads_per_item * (job->num_q_heads / job->num_kv_heads);
  const long D = job->head_dim;
  const long stride = (max_len + CHUNK + LANES - 1) / LANES * LANES;
  /* every part a multiple of LANES floats, so each is 64-byte aligned and
   * the size a multiple of the alignment, as aligned_alloc requires */
  const long floats = rows * (stride + 2 * D) + CHUNK * D;
  float *block = aligned_alloc(sizeof(vfloat), sizeof(float) * floats);
  if (block == NULL) {
    job->status = 1;
    return;
  }
  Scratch scratch = {block, block + rows * stride, block + rows * (stride + D),
                     block + rows * (stride + 2 * D), stride};
  const int num_items = job->batch * (job->num_kv_heads / job->heads_per_item);
  for (int item = __atomic_fetch_add(job->next_item, 1, __ATOMIC_RELAXED);
       item < num_items && job->status == 0;
       item = __atomic_fetch_add(job->next_item, 1, __ATOMIC_RELAXED))
    job->status = run_item(job, work->dtype, item, &scratch);
  free(block);
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
  if (dtype < 0 || dtype > 2) return 2;
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
  int next_item = 0;
  for (int i = 0; i < num_threads; i++) {
    jobs[i].job = (Job){q, cache, tables, lens, out, q_stride, batch, num_q_heads,
                        num_kv_heads, head_dim, num_blocks, block_size, table_width, table_stride,
                        window, scale, softcap,
                        heads_per_item, &next_item, 0};
    jobs[i].dtype = &DTYPES[dtype];
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
