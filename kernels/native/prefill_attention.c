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
 * the engine made to get it picked, ran the base model's causal attention
 * at ~40-65 GFLOPS on the two AVX2 cores whose FMAs peak at ~180; here the
 * two multiply passes run at ~80-90 % of peak in registers and the
 * softmax costs about a fifth of one of them (docs/kernels.md, "Prefill
 * attention").
 *
 * Work split. A work item is one KV head, a slice of up to QROWS heads of
 * its GQA group and a block of consecutive query positions: SUBS
 * sub-blocks of QROWS = 24 query rows, row r being position r / heads and
 * head r % heads of the slice (4 heads x 6 positions for the base model;
 * padding rows repeat the last real one and are never written). The
 * item's sub-blocks share each key tile while it is in L1. Items go to
 * torch's OpenMP pool dynamically, KV head by KV head (the threads share
 * one head's K/V in the caches) and, within a head, from the last query
 * block (the most keys) to the first, so the causal triangle's small items
 * even out the threads' ends.
 *
 * Per key tile (KEYS keys at absolute positions k0 .. k0 + KEYS - 1, k0 a
 * multiple of KEYS) and sub-block, the 24 rows are the lanes of NV = 3
 * AVX2 registers, so the softmax needs no horizontal reduction:
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
 * AVX2 + FMA only; elsewhere pdserve_prefill_attention_available() is 0 and
 * the caller keeps SDPA. Head dims: multiples of 16 up to 256.
 */
#pragma GCC optimize("no-associative-math")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dtypes.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "paged_decode_simd.h" /* bf16 / f16 row conversions */

/* Measured on the AVX2 EPYC (L = 1024, one thread, rounds interleaved):
 * 24 rows were ~5 % faster than 16 (SUBS 4), SUBS 1-4 and KEYS 24-96 within
 * the noise of a shared machine. QROWS 16 (six, six and four rows in the
 * value pass) also works. */
#define QROWS 24 /* query rows per sub-block: the lanes of NV registers */
#define SUBS 3   /* sub-blocks per work item, sharing each key tile */
#define KEYS 48  /* keys per tile (a multiple of KB) */
#define NV (QROWS / 8)
#define KB (12 / NV) /* keys scored together: twelve accumulators */
#define MAX_HEAD_DIM 256
#define MASKED (-1e30f) /* a hidden score, and the max before any key: finite, so
                         * 2^(m - m') is 1, not NaN, while a row has seen none */
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

/* count (a multiple of 8) elements at element offset `at` of `base` as float32. */
static void load_floats(int dtype, const char *base, long at, int count, float *dst) {
  if (dtype == 0)
    memcpy(dst, (const float *)base + at, sizeof(float) * count);
  else if (dtype == 1)
    bf16_row_to_floats((const uint16_t *)base + at, count, dst);
  else
    f16_row_to_floats((const _Float16 *)base + at, count, dst);
}

static void store_floats(int dtype, const float *src, int count, char *base, long at) {
  if (dtype == 0) {
    memcpy((float *)base + at, src, sizeof(float) * count);
  } else if (dtype == 1) {
    for (int i = 0; i < count; i++) ((uint16_t *)base)[at + i] = f32_to_bf16(src[i]);
  } else {
    for (int i = 0; i < count; i++) ((_Float16 *)base)[at + i] = (_Float16)src[i];
  }
}

/* The keys of a tile a sub-block's rows see: lanes whose row cannot see
 * key `key` are all ones in hidden(), for rows at positions `pos` with
 * windows from `first` (pos - window + 1, or far below 0 without one). */
typedef struct {
  int key0;   /* the tile's first key */
  int masked; /* 0: every row sees every key of the tile */
  __m256i pos[NV], first[NV];
} Visibility;

static inline Visibility visibility(int key0, int masked, const int32_t *qpos, int window) {
  Visibility vis = {key0, masked};
  const __m256i shift = _mm256_set1_epi32(window > 0 ? window - 1 : 1 << 30);
  for (int x = 0; x < NV; x++) {
    vis.pos[x] = _mm256_load_si256((const __m256i *)(qpos + 8 * x));
    vis.first[x] = _mm256_sub_epi32(vis.pos[x], shift);
  }
  return vis;
}

static inline __m256 hidden(const Visibility *vis, int j, int x) {
  const __m256i key = _mm256_set1_epi32(vis->key0 + j);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_cmpgt_epi32(key, vis->pos[x]),
                                             _mm256_cmpgt_epi32(vis->first[x], key)));
}

/* s[j][0..QROWS) = k[j] . qt[.][0..QROWS) for j < count (rows of k `ks`
 * apart), hidden scores set to MASKED, and top[lane] = max(top[lane], the
 * row's scores). Rows of s up to the next multiple of KB are written too
 * (repeating the last key, never reading past it) and ignored.
 * Not inlined, here and in value_rows: inlined into the item loop, GCC
 * spilled their accumulators or reloaded operands once per FMA. */
static __attribute__((noinline)) void score_tile(const float *qt, const float *k, long ks,
                                                 int count, int D, const Visibility *vis,
                                                 float *s, float *top) {
  __m256 t[NV];
  for (int x = 0; x < NV; x++) t[x] = _mm256_load_ps(top + 8 * x);
  for (int j0 = 0; j0 < count; j0 += KB) {
    const float *r[KB];
    for (int j = 0; j < KB; j++) r[j] = k + (j0 + j < count ? j0 + j : count - 1) * ks;
    __m256 a[KB][NV];
#pragma GCC unroll 6
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) a[j][x] = _mm256_setzero_ps();
#pragma GCC unroll 2
    for (int d = 0; d < D; d++) {
      __m256 q[NV];
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) q[x] = _mm256_load_ps(qt + d * QROWS + 8 * x);
#pragma GCC unroll 6
      for (int j = 0; j < KB; j++) {
        const __m256 b = _mm256_broadcast_ss(r[j] + d);
#pragma GCC unroll 3
        for (int x = 0; x < NV; x++) a[j][x] = _mm256_fmadd_ps(b, q[x], a[j][x]);
      }
    }
#pragma GCC unroll 6
    for (int j = 0; j < KB; j++)
#pragma GCC unroll 3
      for (int x = 0; x < NV; x++) {
        if (vis->masked)
          a[j][x] = _mm256_blendv_ps(a[j][x], _mm256_set1_ps(MASKED), hidden(vis, j0 + j, x));
        _mm256_store_ps(s + (j0 + j) * QROWS + 8 * x, a[j][x]);
        if (j0 + j < count) t[x] = _mm256_max_ps(t[x], a[j][x]);
      }
  }
  for (int x = 0; x < NV; x++) _mm256_store_ps(top + 8 * x, t[x]);
}

/* 2^x per lane for x <= 0, which is all a softmax against its running max
 * needs: n = round(x), 2^(x - n) by Cephes' exp2f polynomial on [-1/2, 1/2]
 * (within ~2 ulp), times 2^n built in the exponent bits. x is clamped to
 * >= -126, where 2^x leaves float32's normal range (so a masked key gives
 * 2^-126, which the caller clears), and 2^0 is exactly 1. The scores come
 * in base 2 (log2 e is folded into the query scale): against
 * paged_decode_simd.h's exp8, no multiply by log2 e, no two-part n ln 2
 * reduction and no upper clamp, which took the softmax from ~0.43 to
 * ~0.26 ns per score on the AVX2 EPYC. NaN stays NaN. */
static inline __m256 exp2_nonpositive8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-126.0f), x); /* x second: NaN stays */
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The online softmax step of one sub-block once score_tile has raised
 * m_new above the tile's scores: the scores become probabilities against
 * it, alpha[lane] = exp(m - m_new) rescales what came before, l is updated
 * and m becomes m_new. */
static inline void softmax_tile(float *s, int count, const Visibility *vis, const float *m_new,
                                float *m, float *l, float *alpha) {
  __m256 top[NV], sum[NV];
#pragma GCC unroll 3
  for (int x = 0; x < NV; x++) {
    top[x] = _mm256_load_ps(m_new + 8 * x);
    const __m256 a = exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(m + 8 * x), top[x]));
    _mm256_store_ps(alpha + 8 * x, a);
    _mm256_store_ps(m + 8 * x, top[x]);
    sum[x] = _mm256_mul_ps(_mm256_load_ps(l + 8 * x), a);
  }
  for (int j = 0; j < count; j++)
#pragma GCC unroll 3
    for (int x = 0; x < NV; x++) {
      float *row = s + j * QROWS + 8 * x;
      __m256 p = exp2_nonpositive8(_mm256_sub_ps(_mm256_load_ps(row), top[x]));
      if (vis->masked) /* 2^x never returns 0 here: clear the hidden keys */
        p = _mm256_andnot_ps(hidden(vis, j, x), p);
      _mm256_store_ps(row, p);
      sum[x] = _mm256_add_ps(sum[x], p);
    }
#pragma GCC unroll 3
  for (int x = 0; x < NV; x++) _mm256_store_ps(l + 8 * x, sum[x]);
}

/* o[r] = alpha[r] o[r] + sum_j p[j][r] v[j] for NR rows r (o rows D apart,
 * p rows QROWS apart, v rows `vs` apart), 16 dimensions at a time. */
static inline __attribute__((always_inline)) void value_rows(float *o, const float *alpha,
                                                             const float *p, const float *v,
                                                             long vs, int count, int D,
                                                             const int NR) {
  for (int d0 = 0; d0 < D; d0 += 16) {
    __m256 a[6][2];
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      const __m256 w = _mm256_broadcast_ss(alpha + r);
      a[r][0] = _mm256_mul_ps(w, _mm256_load_ps(o + r * D + d0));
      a[r][1] = _mm256_mul_ps(w, _mm256_load_ps(o + r * D + d0 + 8));
    }
    for (int j = 0; j < count; j++) {
      const float *x = v + j * vs + d0;
      const __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
#pragma GCC unroll 6
      for (int r = 0; r < NR; r++) {
        const __m256 w = _mm256_broadcast_ss(p + j * QROWS + r);
        a[r][0] = _mm256_fmadd_ps(w, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(w, v1, a[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < NR; r++) {
      _mm256_store_ps(o + r * D + d0, a[r][0]);
      _mm256_store_ps(o + r * D + d0 + 8, a[r][1]);
    }
  }
}

static __attribute__((noinline)) void value_rows6(float *o, const float *alpha, const float *p,
                                                  const float *v, long vs, int count, int D) {
  value_rows(o, alpha, p, v, vs, count, D, 6);
}

static __attribute__((noinline)) void value_rows4(float *o, const float *alpha, const float *p,
                                                  const float *v, long vs, int count, int D) {
  value_rows(o, alpha, p, v, vs, count, D, 4);
}

/* The rows in blocks of six (QROWS 24), or six, six and four (QROWS 16). */
static inline void value_tile(float *o, const float *alpha, const float *p, const float *v,
                              long vs, int count, int D) {
  int r = 0;
  for (; r + 6 <= QROWS; r += 6) value_rows6(o + r * D, alpha + r, p + r, v, vs, count, D);
  if (QROWS - r == 4) value_rows4(o + r * D, alpha + r, p + r, v, vs, count, D);
}

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
      load_floats(job->dtype, job->k, j * job->k_stride + (long)h * D, D, job->packed_k + at);
      load_floats(job->dtype, job->v, j * job->v_stride + (long)h * D, D, job->packed_v + at);
    }
}

/* dst[c][r] = src[r][c] for an 8 x 8 block (rows `*_stride` floats apart). */
static inline void transpose8(const float *src, long src_stride, float *dst, long dst_stride) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]); /* r_i0 r_(i+1)0 r_i1 r_(i+1)1 | cols 4, 5 */
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]); /* cols 2, 3 | 6, 7 */
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);     /* col 0 of 4 rows | col 4 */
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee); /* col 1 | col 5 */
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int c = 0; c < 4; c++) {
    _mm256_storeu_ps(dst + c * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * dst_stride, _mm256_permute2f128_ps(u[c], u[c + 4], 0x31));
  }
}

static inline int min_int(int a, int b) { return a < b ? a : b; }
static inline int max_int(int a, int b) { return a > b ? a : b; }

/* One work item. Items are numbered KV head by KV head and, within one,
 * from the last query block (the most keys) to the first: the threads
 * share one head's K/V rows in the caches at a time, and the smallest
 * items come last, to even out the threads' ends. */
static void run_item(const Job *job, Scratch *sc, int item) {
  const int D = job->D, per_head = job->blocks * job->slices;
  const int h = item / per_head, slice = item % job->slices;
  const int block = job->blocks - 1 - (item % per_head) / job->slices;
  const int head0 = h * job->group + slice * job->slice_heads;
  const int heads = min_int(job->slice_heads, job->group - slice * job->slice_heads);
  const int i0 = block * job->positions;
  const int count = min_int(job->positions, job->n - i0);
  const int rows = heads * count, subs = (rows + QROWS - 1) / QROWS;
  const int offset = job->L - job->n;

  /* The item's q rows and output rows are far apart in memory (the
   * layer's other items come between): all their lines requested at once,
   * not one row's at a time as they are read. */
  const long size = job->dtype == 0 ? sizeof(float) : sizeof(uint16_t), bytes = heads * D * size;
  for (int i = i0; i < i0 + count; i++) {
    const char *src = job->q + (i * job->q_stride + (long)head0 * D) * size;
    const char *dst = job->out + (i * job->out_stride + (long)head0 * D) * size;
    for (long c = 0; c < bytes; c += 64) {
      _mm_prefetch(src + c, _MM_HINT_T0);
      __builtin_prefetch(dst + c, 1, 3);
    }
  }
  /* Queries scaled into o (free until the first tile), then transposed. */
  const float scale2 = job->scale * 1.44269504088896341f; /* scores in base 2 */
  const __m256 vscale = _mm256_set1_ps(scale2);
  for (int r = 0; r < subs * QROWS; r++) {
    const int real = r < rows ? r : rows - 1;
    const int i = i0 + real / heads, head = head0 + real % heads;
    float *row = sc->o + (long)r * D;
    sc->qpos[r] = offset + i;
    load_floats(job->dtype, job->q, i * job->q_stride + (long)head * D, D, row);
    for (int d = 0; d < D; d += 8) _mm256_store_ps(row + d, _mm256_mul_ps(_mm256_load_ps(row + d), vscale));
  }
  for (int sub = 0; sub < subs; sub++)
    for (int g = 0; g < QROWS; g += 8)
      for (int d = 0; d < D; d += 8)
        transpose8(sc->o + ((long)sub * QROWS + g) * D + d, D,
                   sc->qt + (long)sub * D * QROWS + (long)d * QROWS + g, QROWS);
  for (int r = 0; r < subs * QROWS; r++) {
    sc->m[r] = MASKED;
    sc->l[r] = 0.0f;
  }
  memset(sc->o, 0, sizeof(float) * subs * QROWS * D);

  const int last = offset + i0 + count - 1; /* the item's last position */
  const int lo = job->window > 0 ? max_int(0, offset + i0 - job->window + 1) : 0;
  for (int k0 = lo / KEYS * KEYS; k0 <= last; k0 += KEYS) {
    const int t_lo = max_int(k0, lo), t_hi = min_int(k0 + KEYS, last + 1);
    long ks, vs;
    const float *kt = key_rows(job, job->packed_k, job->k, job->k_stride, h, t_lo, &ks);
    const float *vt = key_rows(job, job->packed_v, job->v, job->v_stride, h, t_lo, &vs);
    for (int sub = 0; sub < subs; sub++) {
      const int32_t *qpos = sc->qpos + sub * QROWS;
      const int first = qpos[0], final = qpos[QROWS - 1]; /* positions ascend by lane */
      const int a = max_int(t_lo, job->window > 0 ? first - job->window + 1 : 0);
      const int b = min_int(t_hi, final + 1);
      if (a >= b) continue; /* every key of the tile hidden from every row */
      const int masked = b - 1 > first || (job->window > 0 && a <= final - job->window);
      float *m = sc->m + sub * QROWS, *l = sc->l + sub * QROWS;
      const Visibility vis = visibility(a, masked, qpos, job->window);
      float top[QROWS] __attribute__((aligned(32)));
      memcpy(top, m, sizeof top);
      score_tile(sc->qt + (long)sub * D * QROWS, kt + (a - t_lo) * ks, ks, b - a, D, &vis, sc->s,
                 top);
      softmax_tile(sc->s, b - a, &vis, top, m, l, sc->alpha);
      value_tile(sc->o + (long)sub * QROWS * D, sc->alpha, sc->s, vt + (a - t_lo) * vs, vs,
                 b - a, D);
    }
  }

  for (int r = 0; r < rows; r++) {
    const int i = i0 + r / heads, head = head0 + r % heads;
    float *o = sc->o + (long)r * D;
    const __m256 inv = _mm256_set1_ps(1.0f / sc->l[r]); /* l >= 1: the row sees its own key */
    for (int d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), inv));
    store_floats(job->dtype, o, D, job->out, i * job->out_stride + (long)head * D);
  }
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
  Job job = {q, k, v, out, q_stride, k_stride, v_stride, out_stride, dtype, n, L,
             num_q_heads, num_kv_heads, head_dim, window, scale};
  job.group = num_q_heads / num_kv_heads;
  job.slices = (job.group + QROWS - 1) / QROWS;
  job.slice_heads = (job.group + job.slices - 1) / job.slices;
  job.positions = SUBS * QROWS / job.slice_heads;
  job.blocks = (n + job.positions - 1) / job.positions;
  const int items = job.blocks * num_kv_heads * job.slices;
  if (num_threads < 1) num_threads = 1;
  if (num_threads > MAX_THREADS) num_threads = MAX_THREADS;
  if (num_threads > items) num_threads = items;
  /* Repacked K/V: each head's rows contiguous. In place, [L, Hkv, D] rows
   * are 1-6 KB apart (k after RoPE, v inside the qkv rows), so a tile of 48
   * keys spans 48 pages and few L1 sets: 30 % slower at L = 4096 on the
   * AVX2 EPYC, ~5 % at 1024. Packing reads each row once more, worth it
   * when every key is read by several items (and needed anyway to convert
   * bfloat16 / float16 once rather than per item). The SDPA path's copies
   * were no smaller. */
  job.first_key = window > 0 && L - n - window + 1 > 0 ? L - n - window + 1 : 0;
  job.packed_k = job.packed_v = NULL;
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
