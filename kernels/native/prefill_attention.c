/* Causal prefill attention for CPU pods: the new tokens of one sequence
 * against all its keys, flash-style (no score matrix), read in place.
 *
 * Built with the other sources into one library (kernels/native/loader.py).
 * Contract (kernels.native.prefill_attention):
 *   q   [n, Hq, D]   element type T, rows `q_stride` elements apart
 *   k,v [L, Hkv, D]  element type T, rows `k_stride` / `v_stride` apart
 *   out [n, Hq, D]   element type T, rows `out_stride` apart
 * (within a row the heads are D apart, each head's D elements contiguous,
 * so q and v can be views of the qkv projection's rows). T is float32,
 * bfloat16 or float16; arithmetic is float32. Query i sits at position
 * L - n + i and sees the keys j <= its position (and j > position - window
 * when window > 0); query head h reads KV head h / (Hq / Hkv).
 *
 * No row is ever all masked: a query always sees its own key. So a row's
 * sum of probabilities ends >= 1 (the key at its final max contributes
 * 2^0), the final division is safe, and nothing needs a NaN guard.
 *
 * Why: torch's CPU flash SDPA, with the transposes and contiguous copies
 * the engine made to get it picked, ran at well under the FMAs' peak; this
 * is 1.4-2.25x it (docs/kernels.md, "Prefill attention", with the figures).
 *
 * Work split. A work item is one KV head, a slice of up to QROWS heads of
 * its GQA group and a block of consecutive query positions: SUBS
 * sub-blocks of QROWS query rows (24 on AVX2, 32 on AVX-512), row r being
 * position r / heads and head r % heads of the slice (AVX2: 4 heads x 6
 * positions for the base model;
 * padding rows repeat the last real one and are never written). The
 * item's sub-blocks share each key tile while it is in L1. Items go to
 * torch's OpenMP pool dynamically, KV head by KV head (the threads share
 * one head's K/V in the caches) and, within a head, from the last query
 * block (the most keys) to the first, so the causal triangle's small items
 * even out the threads' ends.
 *
 * Per key tile (KEYS keys at absolute positions k0 .. k0 + KEYS - 1, k0 a
 * multiple of KEYS) and sub-block, the rows are the lanes of NV registers
 * (AVX2: 24 rows in 3 ymm; AVX-512: 32 in 2 zmm), so the softmax needs no
 * horizontal reduction (counts below for AVX2; AVX-512 scores eight keys
 * at a time with sixteen FMAs per dimension and takes the values eight
 * rows by 32 dimensions in sixteen registers):
 *   scores  S^T[key][row] = K[key] . Q^T[.][row] (queries scaled by
 *           scale * log2 e and transposed once per item), four keys at a
 *           time: per dimension three loads of Q^T, four broadcasts of K,
 *           twelve FMAs; the tile's hidden scores set to MASKED and each
 *           row's new max m' taken as they are stored;
 *   softmax per lane: alpha = 2^(m - m'), l = alpha l + sum 2^(s - m')
 *           (exp2_nonpositive8); hidden keys' probabilities are zeroed;
 *   values  O[row] = alpha O[row] + sum_key p V[key], six rows by 16
 *           dimensions in twelve registers over the tile.
 * Only the tiles that cross a row's diagonal or window edge are masked.
 * A sub-block skips the tiles none of its rows sees and trims the others
 * to the keys some row sees. K and V are first repacked (converted to
 * float32) with each head's rows contiguous, by all threads, when several
 * items read each key or the type is not float32; otherwise float32 rows
 * are read in place.
 *
 * Invariant: a row's result is bit-identical whatever n (a whole prompt,
 * or a chunk after a cached prefix), the rows it shares an item with, or
 * the thread count. Tiles sit on absolute key positions; each lane's
 * arithmetic is its own and in key order; a key a trim or skip leaves out
 * is hidden from the row, and a hidden key changes nothing (its
 * probability is an exact 0, a tile with no key visible has alpha
 * 2^0 = 1). This file is built without -fassociative-math (the pragma
 * below) so no compiler reordering can break that.
 *
 * AVX2 + FMA, or AVX-512F (prefill_attention_simd.h), with bfloat16
 * scores by vdpbf16ps where the host has AVX512-BF16 (`pairs`); elsewhere
 * pdserve_prefill_attention_available() is 0 and the caller keeps SDPA.
 * Head dims: multiples of 16 up to 256.
 */
#pragma GCC optimize("no-associative-math")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "paged_decode_simd.h" /* bf16 / f16 row conversions */
#include "prefill_attention_simd.h"

/* The sizes measured best (docs/kernels.md, "Prefill attention"). */
#define SUBS 3  /* sub-blocks per work item, sharing each key tile */
#define KEYS 48 /* keys per tile (a multiple of KB) */
#define MAX_HEAD_DIM 256
#define MAX_THREADS 64
#define PACK_MIN_BLOCKS 4 /* float32 K/V are repacked from this many query blocks on */
#define PACK_ROWS 64      /* keys per packing task */

typedef struct {
  const char *q, *k, *v;
  char *out;
  long q_stride, k_stride, v_stride, out_stride; /* elements */
  int dtype, n, L, num_q_heads, num_kv_heads, D, window;
  float scale;
  int group;       /* Hq / Hkv */
  int slice_heads; /* query heads per item (the last slice may have fewer) */
  int slices;      /* head slices per KV head */
  int positions;   /* query positions per item */
  int blocks;      /* query blocks: ceil(n / positions) */
  /* K and V of keys [first_key, L) repacked as float32 [Hkv][L - first_key][D]
   * (NULL: float32 rows read in place). */
  float *packed_k, *packed_v;
  int first_key;
  int pairs; /* bfloat16 scores by vdpbf16ps: packed_k holds bfloat16 rows */
} Job;

/* Per-thread scratch, one 64-byte aligned block. */
typedef struct {
  float *qt;          /* [SUBS][D][QROWS]: scaled queries, transposed */
  float *o;           /* [SUBS][QROWS][D]: unnormalised outputs */
  float *m, *l;       /* [SUBS][QROWS]: running max and sum of each row */
  float *s;           /* [KEYS][QROWS]: a tile's scores, then probabilities */
  float *alpha;       /* [QROWS]: the tile's rescale of each row */
  int32_t *qpos;      /* [SUBS][QROWS]: each row's position */
} Scratch;

/* The float32 rows of head h from key `key` on, and their stride. */
static inline const float *key_rows(const Job *job, const float *packed, const char *base,
                                    long stride, int h, int key, long *rows_stride) {
  const int D = job->D;
  if (packed != NULL) {
    *rows_stride = D;
    return packed + ((long)h * (job->L - job->first_key) + key - job->first_key) * D;
  }
  *rows_stride = stride;
  return (const float *)base + key * stride + (long)h * D;
}

/* Rows [lo, hi) of every head of k and v into the packed layout. */
static void pack_rows(const Job *job, int lo, int hi) {
  const int D = job->D, width = job->L - job->first_key;
  for (int j = lo; j < hi; j++)
    for (int h = 0; h < job->num_kv_heads; h++) {
      const long at = ((long)h * width + j - job->first_key) * D;
      if (job->pairs)
        memcpy((uint16_t *)job->packed_k + at, (const uint16_t *)job->k + j * job->k_stride
               + (long)h * D, sizeof(uint16_t) * D);
      else
        load_floats(job->dtype, job->k, j * job->k_stride + (long)h * D, D, job->packed_k + at);
      load_floats(job->dtype, job->v, j * job->v_stride + (long)h * D, D, job->packed_v + at);
    }
}

static inline int min_int(int a, int b) { return a < b ? a : b; }
static inline int max_int(int a, int b) { return a > b ? a : b; }

/* A work item: query heads [head0, head0 + heads) of KV head h at query
 * positions i0 .. i0 + count - 1, as `rows` rows (row r: position
 * i0 + r / heads, head head0 + r % heads) in `subs` sub-blocks. */
typedef struct {
  int h, head0, heads, i0, count, rows, subs;
} Item;

/* Items are numbered KV head by KV head and, within one, from the last
 * query block (the most keys) to the first: the threads share one head's
 * K/V in the caches at a time, and the smallest items come last, to even
 * out the threads' ends. */
static Item item_at(const Job *job, int index) {
  const int per_head = job->blocks * job->slices, slice = index % job->slices;
  const int block = job->blocks - 1 - (index % per_head) / job->slices;
  Item it = {.h = index / per_head, .i0 = block * job->positions};
  it.head0 = it.h * job->group + slice * job->slice_heads;
  it.heads = min_int(job->slice_heads, job->group - slice * job->slice_heads);
  it.count = min_int(job->positions, job->n - it.i0);
  it.rows = it.heads * it.count;
  it.subs = (it.rows + QROWS - 1) / QROWS;
  return it;
}

/* The item's queries, scaled and transposed, into sc->qt, their positions
 * into sc->qpos (padding rows repeat the last row); m, l and o reset. */
static void load_queries(const Job *job, const Item *it, Scratch *sc) {
  const int D = job->D;
  /* The item's q rows and output rows are far apart in memory (the
   * layer's other items come between): all their lines requested at once,
   * not one row's at a time as they are read. */
  const long size = job->dtype == 0 ? sizeof(float) : sizeof(uint16_t);
  const long bytes = it->heads * D * size;
  for (int i = it->i0; i < it->i0 + it->count; i++) {
    const char *src = job->q + (i * job->q_stride + (long)it->head0 * D) * size;
    const char *dst = job->out + (i * job->out_stride + (long)it->head0 * D) * size;
    for (long c = 0; c < bytes; c += 64) {
      _mm_prefetch(src + c, _MM_HINT_T0);
      __builtin_prefetch(dst + c, 1, 3);
    }
  }
  /* Scaled into o (free until the first tile), then transposed. */
  const __m256 scale = _mm256_set1_ps(job->scale * 1.44269504088896341f); /* base 2 */
  for (int r = 0; r < it->subs * QROWS; r++) {
    const int real = r < it->rows ? r : it->rows - 1;
    const int i = it->i0 + real / it->heads, head = it->head0 + real % it->heads;
    float *row = sc->o + (long)r * D;
    sc->qpos[r] = job->L - job->n + i;
#if defined(PREFILL_PAIRS)
    if (job->pairs) { /* as stored, in pairs: scaled with the scores */
      const uint16_t *q = (const uint16_t *)job->q + i * job->q_stride + (long)head * D;
      query_pairs(q, D, (uint32_t *)sc->qt + (long)(r / QROWS) * D / 2 * QROWS, r % QROWS);
      continue;
    }
#endif
    load_floats(job->dtype, job->q, i * job->q_stride + (long)head * D, D, row);
    for (int d = 0; d < D; d += 8)
      _mm256_store_ps(row + d, _mm256_mul_ps(_mm256_load_ps(row + d), scale));
  }
  for (int sub = 0; sub < it->subs && !job->pairs; sub++)
    for (int g = 0; g < QROWS; g += 8)
      for (int d = 0; d < D; d += 8)
        transpose8(sc->o + ((long)sub * QROWS + g) * D + d, D,
                   sc->qt + (long)sub * D * QROWS + (long)d * QROWS + g, QROWS);
  for (int r = 0; r < it->subs * QROWS; r++) {
    sc->m[r] = MASKED;
    sc->l[r] = 0.0f;
  }
  memset(sc->o, 0, sizeof(float) * it->subs * QROWS * D);
}

/* Every key tile the item's rows see, through every sub-block. */
static void attend_keys(const Job *job, const Item *it, Scratch *sc) {
  const int D = job->D, window = job->window;
  const int first_pos = job->L - job->n + it->i0, last = first_pos + it->count - 1;
  const int lo = window > 0 ? max_int(0, first_pos - window + 1) : 0;
  for (int k0 = lo / KEYS * KEYS; k0 <= last; k0 += KEYS) {
    const int t_lo = max_int(k0, lo), t_hi = min_int(k0 + KEYS, last + 1);
    long ks, vs;
    const float *kt = key_rows(job, job->packed_k, job->k, job->k_stride, it->h, t_lo, &ks);
    const float *vt = key_rows(job, job->packed_v, job->v, job->v_stride, it->h, t_lo, &vs);
    for (int sub = 0; sub < it->subs; sub++) {
      const int32_t *qpos = sc->qpos + sub * QROWS;
      const int first = qpos[0], final = qpos[QROWS - 1]; /* positions ascend by lane */
      const int a = max_int(t_lo, window > 0 ? first - window + 1 : 0);
      const int b = min_int(t_hi, final + 1);
      if (a >= b) continue; /* every key of the tile hidden from every row */
      const int masked = b - 1 > first || (window > 0 && a <= final - window);
      float *m = sc->m + sub * QROWS, *l = sc->l + sub * QROWS;
      const Visibility vis = visibility(a, masked, qpos, window);
      float top[QROWS] __attribute__((aligned(64)));
      memcpy(top, m, sizeof top);
#if defined(PREFILL_PAIRS)
      if (job->pairs)
        score_tile_pairs((const uint32_t *)sc->qt + (long)sub * D / 2 * QROWS,
                         (const uint16_t *)job->packed_k
                             + ((long)it->h * (job->L - job->first_key) + a - job->first_key) * D,
                         D, b - a, D, job->scale * 1.44269504088896341f, &vis, sc->s, top);
      else
#endif
        score_tile(sc->qt + (long)sub * D * QROWS, kt + (a - t_lo) * ks, ks, b - a, D, &vis,
                   sc->s, top);
      softmax_tile(sc->s, b - a, &vis, top, m, l, sc->alpha);
      value_tile(sc->o + (long)sub * QROWS * D, sc->alpha, sc->s, vt + (a - t_lo) * vs, vs,
                 b - a, D);
    }
  }
}

/* The item's rows of out: o / l (l >= 1: a row sees its own key). */
static void store_outputs(const Job *job, const Item *it, Scratch *sc) {
  const int D = job->D;
  for (int r = 0; r < it->rows; r++) {
    const int i = it->i0 + r / it->heads, head = it->head0 + r % it->heads;
    float *o = sc->o + (long)r * D;
    const __m256 inv = _mm256_set1_ps(1.0f / sc->l[r]);
    for (int d = 0; d < D; d += 8)
      _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), inv));
    store_floats(job->dtype, o, D, job->out, i * job->out_stride + (long)head * D);
  }
}

static void run_item(const Job *job, Scratch *sc, int index) {
  const Item it = item_at(job, index);
  load_queries(job, &it, sc);
  attend_keys(job, &it, sc);
  store_outputs(job, &it, sc);
}

static Scratch carve(float *block, int D) {
  Scratch s;
  float *p = block;
  s.qt = p, p += SUBS * D * QROWS;
  s.o = p, p += SUBS * QROWS * D;
  s.m = p, p += SUBS * QROWS;
  s.l = p, p += SUBS * QROWS;
  s.s = p, p += KEYS * QROWS;
  s.alpha = p, p += QROWS;
  s.qpos = (int32_t *)p;
  return s;
}

/* Floats in carve's layout (each part a multiple of 8: 32-byte aligned),
 * rounded up to 64 bytes as aligned_alloc requires. */
static size_t scratch_floats(int D) {
  const size_t floats = (size_t)SUBS * D * QROWS * 2 + SUBS * QROWS * 2 + KEYS * QROWS + QROWS +
                        SUBS * QROWS;
  return (floats + 15) / 16 * 16;
}

int pdserve_prefill_attention_available(void) { return 1; }

/* dtype: 0 float32, 1 bfloat16, 2 float16. window 0: none. Returns 0, or
 * 1 out of memory, 2 a shape or dtype this kernel does not take (the
 * caller falls back); `out` is undefined unless 0. */
int pdserve_prefill_attention(const void *q, long q_stride, const void *k, long k_stride,
                              const void *v, long v_stride, void *out, long out_stride,
                              int dtype, int n, int L, int num_q_heads, int num_kv_heads,
                              int head_dim, int window, float scale, int num_threads) {
  if (dtype < 0 || dtype > 2 || n < 0 || L < n || L >= (1 << 30)) return 2;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return 2;
  if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > MAX_HEAD_DIM || window < 0) return 2;
  if (n == 0) return 0;
  Job job = {.q = q, .k = k, .v = v, .out = out, .q_stride = q_stride, .k_stride = k_stride,
             .v_stride = v_stride, .out_stride = out_stride, .dtype = dtype, .n = n, .L = L,
             .num_q_heads = num_q_heads, .num_kv_heads = num_kv_heads, .D = head_dim,
             .window = window, .scale = scale, .group = num_q_heads / num_kv_heads};
  job.slices = (job.group + QROWS - 1) / QROWS;
  job.slice_heads = (job.group + job.slices - 1) / job.slices;
  job.positions = SUBS * QROWS / job.slice_heads;
  job.blocks = (n + job.positions - 1) / job.positions;
  const int items = job.blocks * num_kv_heads * job.slices;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads > items) num_threads = items;
  /* Repacked K/V: each head's rows contiguous (in place, a tile of 48 keys
   * spans 48 pages and few L1 sets: docs/kernels.md). Packing reads each
   * row once more, worth it when several items read every key, and needed
   * anyway to convert a half type once rather than per item. */
  job.first_key = window > 0 && L - n - window + 1 > 0 ? L - n - window + 1 : 0;
  job.packed_k = job.packed_v = NULL;
#if defined(PREFILL_PAIRS)
  job.pairs = dtype == 1; /* packed below: dtype != 0 */
#endif
  if (dtype != 0 || job.blocks >= PACK_MIN_BLOCKS) {
    const size_t floats = (size_t)num_kv_heads * (L - job.first_key) * head_dim;
    job.packed_k = aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
    job.packed_v = aligned_alloc(64, sizeof(float) * ((floats + 15) / 16 * 16));
    if (job.packed_k == NULL || job.packed_v == NULL) {
      free(job.packed_k);
      free(job.packed_v);
      return 1;
    }
  }
  const size_t bytes = sizeof(float) * scratch_floats(head_dim);
  int status = 0;
  /* OpenMP from the libgomp torch already loaded (paged_decode.c). */
#pragma omp parallel num_threads(num_threads)
  {
    if (job.packed_k != NULL) {
#pragma omp for schedule(static)
      for (int j = job.first_key; j < L; j += PACK_ROWS)
        pack_rows(&job, j, j + PACK_ROWS < L ? j + PACK_ROWS : L);
    } /* the loop's barrier: every row packed before any item starts */
    float *block = aligned_alloc(64, bytes);
    if (block == NULL) {
#pragma omp atomic write
      status = 1;
    }
    Scratch scratch = carve(block, head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < items; item++)
      if (block != NULL) run_item(&job, &scratch, item);
    free(block);
  }
  free(job.packed_k);
  free(job.packed_v);
  return status;
}

#else /* no AVX2 + FMA: the caller keeps SDPA */

int pdserve_prefill_attention_available(void) { return 0; }

int pdserve_prefill_attention(const void *q, long q_stride, const void *k, long k_stride,
                              const void *v, long v_stride, void *out, long out_stride,
                              int dtype, int n, int L, int num_q_heads, int num_kv_heads,
                              int head_dim, int window, float scale, int num_threads) {
  (void)q; (void)q_stride; (void)k; (void)k_stride; (void)v; (void)v_stride; (void)out;
  (void)out_stride; (void)dtype; (void)n; (void)L; (void)num_q_heads; (void)num_kv_heads;
  (void)head_dim; (void)window; (void)scale; (void)num_threads;
  return 2;
}

#endif
