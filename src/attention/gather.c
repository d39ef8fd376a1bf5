/*
 * gather.c: attention's reads of retained rows through a cache's page table,
 * and their exact partition into parts for threads.
 *
 * Owns: the loops that touch pages. A page keeps the keys of all stored (KV)
 * heads, [H_kv][block_tokens][d_h], in one contiguous run (and the values in
 * the next), so a block is read as one stream per KV head, with one table
 * lookup per block, never one per element. Query head h reads KV head
 * h / (H / H_kv); the G = H / H_kv query heads of a group are consecutive,
 * and one grouped kernel call (dot_group, axpy_group) scores or mixes a
 * block's rows of a KV head for all G at once, so each row is loaded and
 * widened once per step, not G times. For every query head, positions are still visited in order
 * 0 .. len-1 and then the candidate, the order the full-prefix reference
 * uses, and every dot product and axpy goes through the dispatched kernels,
 * whose results do not depend on how many rows of a block are handed over at
 * once (kernels.h), so the sums agree bit for bit with the reference and
 * across block sizes. A block's rows for one head go to the multi-row
 * kernels in one call, so several rows are in flight. Pages hold the pool's
 * dtype: the narrow kernels widen the stored rows exactly and then compute
 * as the f64 ones (kernels.h), so the order and the bits are those of the
 * f64 kernels on the widened rows. The candidate row is f64 already rounded
 * to the dtype (incremental.c). fp8 pages hold elements: scores use scale *
 * k_scale, outputs are multiplied by v_scale at the end (kvpi_cache_kv_scales).
 *
 * Windows (docs/DESIGN.md, Sliding windows and sinks): a cache bound with
 * a window W and sinks S (kvpi_cache_window, its record's) attends to the
 * retained positions [0, sinks) and [lo, len) only. The loops walk pieces,
 * not blocks: the blocks covering [0, sinks), then those covering
 * [lo, len), each clipped to its range (piece_at), so no position is tested
 * and no other block's table entry is read (the pager may release it).
 * Scores and weights are packed per head, [keys] = the attended positions
 * in order, then the candidate; without a window a piece is a whole block
 * and the loops are those of full attention.
 *
 * A job at KVP_ACCUM_FAST on narrow pages runs the fast level instead
 * (docs/DESIGN.md, Accumulation levels): the lane's queries times scale and
 * log2(e) rounded to f32 once (in runs of heads that fit FAST_FLOATS on the
 * stack), the fast grouped kernels writing f32 scores in base 2, the f32
 * softmax (softmax_fast) in place, the f32 weights read in place by the
 * fast axpy, and f32 accumulators on the stack written to the f64 outputs
 * at the end of the part. The f32 scores and weights live packed in the
 * first half of the job's f64 weights buffer ([B][H][keys] floats), so no
 * caller sizes anything new: a quarter less traffic per position than f64
 * scores. Each output is still one chain over the positions in order inside
 * one part, so the partition below holds for both levels.
 *
 * The partition (one decode step, every lane): each phase is cut into parts
 * that share no output element, and each output element is computed inside
 * one part by exactly the serial loop's operations, in its order. So the
 * bits are the same for any executor, any thread count and any order of the
 * parts; the partition is a function of the shape only, and it is exact, not
 * a "flash-decoding" split (whose per-chunk max and sum would round the
 * softmax differently; docs/DESIGN.md, Threads).
 *   scores   part = (lane, chunk of whole pieces): a score is one dot
 *            product, independent of every other. A chunk holds about
 *            chunk_bytes of keys (256 KiB); a lane's last chunk also scores
 *            the candidate.
 *   softmax  part = a run of (lane, head) rows, about softmax_elements
 *            (32768): each row is one kvpi_softmax call, as serially.
 *   values   part = (lane, run of KV heads, feature slice): each output
 *            feature is summed over positions in order by one axpy chain,
 *            so splitting the heads, or the features [f0, f0 + w) of a head,
 *            changes no operation (axpy is elementwise and adds rows in
 *            order, kernels.h). About value_units (4) parts: a lane's KV
 *            heads in up to that many runs, and only when a lane has fewer
 *            KV heads than that, each head cut into S slices (a power of
 *            two, w = d_h / S a multiple of 8): one long sequence with few
 *            KV heads. Inside a part, blocks are outer and its heads inner,
 *            so each page's value rows of the run are one stream; on one
 *            thread a lane is one part (the whole page's values in one
 *            stream: short runs per page would cost the prefetcher).
 * A cache with fewer than min_parallel_bytes (256 KiB) of keys in all its
 * lanes runs every phase on the calling thread: a hand-off costs more.
 * Callers: incremental.c, and bench/ and src/cli (to time the real loops).
 */
#include "attention/gather.h"

#include <math.h>
#include <string.h>

#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/error.h"

/*
 * The grain of the partition (gather.h): defaults, and the test hook's
 * current values. Global state, written only by kvpi_gather_grain_set while
 * no attention runs.
 */
#define DEFAULT_GRAIN                                                                        \
    {                                                                                        \
        .chunk_bytes = (size_t)256 << 10,        /* keys per scores part */                  \
        .min_parallel_bytes = (size_t)256 << 10, /* keys in all lanes worth a hand-off */    \
        .softmax_elements = 32768,               /* softmax elements per part */             \
        .value_units = 4,                        /* value parts wanted in all lanes */       \
    }
static const kvpi_gather_grain default_grain = DEFAULT_GRAIN;
static kvpi_gather_grain grain = DEFAULT_GRAIN;

void kvpi_gather_grain_set(const kvpi_gather_grain *g)
{
    grain = g != NULL ? *g : default_grain;
}

kvpi_gather_grain kvpi_gather_grain_get(void)
{
    return grain;
}

/*
 * The attended retained positions of a lane whose query sits at q = len
 * with a candidate, len - 1 without (0 for an empty cache): the cache's
 * window rule (layer_internal.h, kvpi_window_span_at).
 */
static kvpi_window_span span_of(const kvp_cache *cache, int candidate)
{
    size_t window = 0;
    size_t sinks = 0;
    kvpi_cache_window(cache, &window, &sinks);
    size_t q = candidate || cache->len == 0 ? cache->len : cache->len - 1;
    return kvpi_window_span_at(window, sinks, q);
}

/* Blocks holding positions [p0, p1). */
static size_t blocks_between(size_t p0, size_t p1, size_t bt)
{
    return p1 <= p0 ? 0 : (p1 - 1) / bt - p0 / bt + 1;
}

/*
 * The pieces of a lane's retained attended positions: the blocks covering
 * the sinks [0, sinks), then those covering the window's retained part
 * [lo, len). A block holding both is two pieces. Full attention: one piece
 * per block, whole blocks, in order.
 */
static size_t pieces_of(const kvp_cache *cache, kvpi_window_span sp)
{
    size_t bt = cache->block_tokens;
    return blocks_between(0, sp.sinks, bt) + blocks_between(sp.lo, cache->len, bt);
}

/*
 * The fast level's scratch on the stack (f32): a run of query heads' queries
 * and one candidate row for the scores, a run of heads' accumulators for the
 * values. Heads wider than FAST_FLOATS features are computed exactly.
 */
#define FAST_FLOATS 4096

/* What a phase needs of a lane of its cache: shape, kernels, row format, scales. */
typedef struct gather_view {
    const kvp_cache *cache;
    const kvpi_kernels *k;
    const uint32_t *table;
    kvpi_rows kind;
    size_t d;          /* head width */
    size_t bt;         /* block tokens */
    size_t group;      /* query heads per KV head */
    size_t kph;        /* scores per (lane, query head): the attended retained positions,
                          + 1 with a candidate (last) */
    kvpi_window_span sp; /* the attended retained positions: [0, sinks), [lo, len) */
    size_t pieces;     /* pieces_of */
    size_t elem;       /* bytes per stored element */
    int fast;          /* the fast level applies */
    int prefetch;      /* ask for the next block's rows ahead (narrow rows) */
    double k_scale;    /* fp8 scales (1.0 otherwise) */
    double v_scale;
} gather_view;

static gather_view view_of(const kvp_cache *cache, size_t heads, int candidate, size_t lane,
                           kvp_accum accum)
{
    kvpi_window_span sp = span_of(cache, candidate);
    gather_view v = {
        .cache = cache,
        .k = kvpi_kernels_active(),
        .table = kvpi_cache_lane_table(cache, lane),
        .kind = (kvpi_rows)kvpi_cache_dtype(cache),
        .d = cache->head_width,
        .bt = cache->block_tokens,
        .group = heads / cache->heads,
        .kph = sp.sinks + (cache->len - sp.lo) + (candidate != 0),
        .sp = sp,
        .pieces = pieces_of(cache, sp),
        .elem = cache->pool->element_bytes,
    };
    v.fast = accum == KVP_ACCUM_FAST && v.kind != KVPI_ROWS_F64 && v.d <= FAST_FLOATS;
    v.prefetch = v.kind != KVPI_ROWS_F64;
    kvpi_cache_kv_scales(cache, &v.k_scale, &v.v_scale);
    if (v.kind != KVPI_ROWS_E4M3) {
        v.k_scale = 1.0;
        v.v_scale = 1.0;
    }
    return v;
}

/*
 * Asks for the `bytes` at p ahead of their use: a KV head's rows of the next
 * block, fetched while this block's are computed. Pages are scattered over
 * the slab, so the hardware prefetcher would start over at every page. Only
 * for narrow rows at the exact level, where widening makes the kernels slow
 * enough for it to pay: f64 rows ran 3-5% slower with this burst. f64 rows
 * of a group of several heads instead hand the next block to the kernel
 * (`ahead`), which asks one line per line it reads (kernels.h): 57% -> 67%
 * of read for f64 32/8 heads; one head per KV head asks for nothing (74%
 * with, 79% without).
 */
static void prefetch_rows(const void *p, size_t bytes)
{
    for (size_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch((const unsigned char *)p + i, 0, 3);
    }
}

/*
 * Piece i of the lane (pieces_of): rows [r0, r0 + rows) of block `block`,
 * whose scores and weights sit at [at, at + rows) of a head's row.
 */
typedef struct piece {
    size_t block, r0, rows, at;
} piece;

static piece piece_at(const gather_view *v, size_t i)
{
    size_t sink_blocks = blocks_between(0, v->sp.sinks, v->bt);
    size_t p0 = 0;
    size_t p1 = v->sp.sinks;
    size_t block = i;
    size_t base = 0; /* the compact index of position p0 */
    if (i >= sink_blocks) {
        p0 = v->sp.lo;
        p1 = v->cache->len;
        block = v->sp.lo / v->bt + (i - sink_blocks);
        base = v->sp.sinks;
    }
    size_t start = block * v->bt > p0 ? block * v->bt : p0;
    size_t end = (block + 1) * v->bt < p1 ? (block + 1) * v->bt : p1;
    return (piece){block, start - block * v->bt, end - start, base + (start - p0)};
}

/* The key (value) rows of KV head kv in piece `pc`. */
static const void *piece_keys(const gather_view *v, piece pc, size_t kv)
{
    return (const unsigned char *)kvpi_cache_page_keys(v->cache, v->table[pc.block], kv) +
           pc.r0 * v->d * v->elem;
}

static const unsigned char *piece_values(const gather_view *v, piece pc, size_t kv)
{
    return (const unsigned char *)kvpi_cache_page_values(v->cache, v->table[pc.block], kv) +
           pc.r0 * v->d * v->elem;
}

/*
 * Exact scores of every query head at blocks [b0, b1): each KV head's rows
 * scored against its whole group at once (dot_group), then the candidate's.
 * scale already includes an fp8 k_scale.
 */
static void scores_exact(const gather_view *v, const double *queries, const double *candidates,
                         size_t b0, size_t b1, double scale, double *scores)
{
    size_t kv_heads = v->cache->heads;
    for (size_t i = b0; i < b1; i++) {
        piece pc = piece_at(v, i);
        piece next = i + 1 < v->pieces ? piece_at(v, i + 1) : pc;
        for (size_t kv = 0; kv < kv_heads; kv++) {
            size_t h = kv * v->group;
            const void *ahead = NULL;
            if (i + 1 < v->pieces) {
                if (v->prefetch) {
                    prefetch_rows(piece_keys(v, next, kv), next.rows * v->d * v->elem);
                } else if (v->group > 1) {
                    ahead = piece_keys(v, next, kv); /* f64: the kernel asks as it goes */
                }
            }
            v->k->dot_group(v->kind, queries + h * v->d, v->group, piece_keys(v, pc, kv), v->d,
                            pc.rows, v->d, scale, scores + h * v->kph + pc.at, v->kph, ahead);
        }
    }
    for (size_t head = 0; candidates != NULL && head < kv_heads * v->group; head++) {
        scores[head * v->kph + v->kph - 1] =
            v->k->dot(queries + head * v->d, candidates + (head / v->group) * v->d, v->d) * scale;
    }
}

/*
 * The fast kernels' prefetch hint (kernels.h, dot_group_fast's `ahead`): KV
 * head kv's keys in the lane's next piece (`next`), which the kernels ask for one
 * line per 64 bytes they read of this block's: memory streams while they
 * compute. (A burst of requests per block, as the exact level makes, stalls
 * until the fill buffers free, so memory and compute took turns: bf16 GQA
 * scores ran at their sum.) NULL after the last piece.
 */
static const void *fast_ahead_keys(const gather_view *v, size_t i, piece next, size_t kv)
{
    return v->prefetch && i + 1 < v->pieces ? piece_keys(v, next, kv) : NULL;
}

/*
 * Fast scores of query heads [h0, h1) (their f32 queries at q32) at blocks
 * [b0, b1), then against the candidate: every row, the candidate's too, is
 * one kvpi_fast_dot per head (the candidate's elements are exact in f32).
 */
static void scores_fast_run(const gather_view *v, const float *q32, size_t h0, size_t h1,
                            const double *candidates, size_t b0, size_t b1, float *scores)
{
    for (size_t i = b0; i < b1; i++) {
        piece pc = piece_at(v, i);
        piece next = i + 1 < v->pieces ? piece_at(v, i + 1) : pc;
        for (size_t h = h0; h < h1;) {
            size_t kv = h / v->group;
            size_t end = (kv + 1) * v->group < h1 ? (kv + 1) * v->group : h1;
            v->k->dot_group_fast(v->kind, q32 + (h - h0) * v->d, end - h, piece_keys(v, pc, kv),
                                 v->d, pc.rows, v->d, scores + h * v->kph + pc.at, v->kph,
                                 fast_ahead_keys(v, i, next, kv));
            h = end;
        }
    }
    float cand32[FAST_FLOATS];
    for (size_t h = h0; candidates != NULL && h < h1;) {
        size_t kv = h / v->group;
        size_t end = (kv + 1) * v->group < h1 ? (kv + 1) * v->group : h1;
        for (size_t f = 0; f < v->d; f++) {
            cand32[f] = (float)candidates[kv * v->d + f];
        }
        v->k->dot_group_fast(KVPI_ROWS_F32, q32 + (h - h0) * v->d, end - h, cand32, v->d, 1,
                             v->d, scores + h * v->kph + v->kph - 1, v->kph, NULL);
        h = end;
    }
}

/*
 * Fast scores, f32 and in base 2: each query element times c = scale *
 * log2(e) (in f64; scale includes an fp8 k_scale) rounded to f32 once, in
 * runs of heads that fit the scratch; then one kvpi_fast_dot per score.
 */
static void scores_fast(const gather_view *v, size_t heads, const double *queries,
                        const double *candidates, size_t b0, size_t b1, double scale,
                        float *scores)
{
    float q32[FAST_FLOATS];
    double c = scale * KVPI_LOG2E;
    size_t per = FAST_FLOATS / v->d;
    for (size_t h0 = 0; h0 < heads; h0 += per) {
        size_t h1 = h0 + per < heads ? h0 + per : heads;
        for (size_t i = 0; i < (h1 - h0) * v->d; i++) {
            q32[i] = (float)(queries[h0 * v->d + i] * c);
        }
        scores_fast_run(v, q32, h0, h1, candidates, b0, b1, scores);
    }
}

/*
 * Scores of the `heads` query heads of `lane` at the retained positions of
 * blocks [b0, b1), and of the candidate unless candidates is NULL. scores is
 * the lane's [H][keys_per_head] (len + 1 when the job has a candidate, len
 * without). For fp8 pages the candidate holds elements, like the pages, and
 * scale is multiplied by the cache's k_scale once. At the fast level scores
 * are f32 (the lane's [H][keys_per_head] floats), else f64.
 */
static void scores_blocks(const kvp_cache *cache, size_t heads, int candidate,
                          const double *queries, const double *candidates, size_t lane,
                          size_t b0, size_t b1, double scale, void *scores, kvp_accum accum)
{
    gather_view v = view_of(cache, heads, candidate, lane, accum);
    scale *= v.k_scale;
    if (v.fast) {
        scores_fast(&v, heads, queries, candidates, b0, b1, scale, scores);
    } else {
        scores_exact(&v, queries, candidates, b0, b1, scale, scores);
    }
}

/*
 * Features [f0, f0 + w) of the head outputs of the query heads of KV heads
 * [k0, k1), exactly: zero, every retained position in order (a KV head's
 * rows added to its whole group at once, axpy_group), then the candidate;
 * for fp8 pages each output is multiplied by v_scale at the end.
 */
static void values_exact(const gather_view *v, const double *weights, const double *candidates,
                         size_t k0, size_t k1, size_t f0, size_t w, double *outputs)
{
    size_t d = v->d;
    for (size_t head = k0 * v->group; head < k1 * v->group; head++) {
        memset(outputs + head * d + f0, 0, w * sizeof *outputs);
    }
    for (size_t i = 0; i < v->pieces; i++) {
        piece pc = piece_at(v, i);
        piece next = i + 1 < v->pieces ? piece_at(v, i + 1) : pc;
        for (size_t kv = k0; kv < k1; kv++) {
            const unsigned char *vals = piece_values(v, pc, kv);
            size_t h = kv * v->group;
            const unsigned char *ahead = NULL;
            if (i + 1 < v->pieces) {
                ahead = piece_values(v, next, kv) + f0 * v->elem;
                if (v->prefetch) {
                    prefetch_rows(ahead, next.rows * v->d * v->elem);
                }
                ahead = v->prefetch || v->group == 1 ? NULL : ahead;
            }
            v->k->axpy_group(v->kind, outputs + h * d + f0, d, weights + h * v->kph + pc.at,
                             v->kph, v->group, vals + f0 * v->elem, d, pc.rows, w, ahead);
        }
    }
    for (size_t head = k0 * v->group; candidates != NULL && head < k1 * v->group; head++) {
        v->k->axpy(outputs + head * d + f0, weights[head * v->kph + v->kph - 1],
                   candidates + head / v->group * d + f0, w);
    }
    for (size_t head = k0 * v->group; v->kind == KVPI_ROWS_E4M3 && head < k1 * v->group;
         head++) {
        for (size_t f = f0; f < f0 + w; f++) {
            outputs[head * d + f] *= v->v_scale;
        }
    }
}

/*
 * One pass of the fast values: the heads j0 .. j1-1 of each group of KV
 * heads [k0, k1) over features [f0, f0 + w), their f32 accumulators at acc
 * ([k][j][w]). The weights are the softmax's f32 rows, read in place.
 */
typedef struct fast_pass {
    size_t k0, k1, j0, j1, f0, w;
} fast_pass;

/*
 * `count` rows of `kind` (a piece's, or the candidate's one f32 row) whose
 * weights sit at `at` of each head's row, added to the pass's heads.
 */
static void fast_add_rows(const gather_view *v, const fast_pass *p, const float *weights,
                          kvpi_rows kind, const void *rows, size_t at, size_t count, size_t kv,
                          const unsigned char *ahead, float *acc)
{
    size_t nj = p->j1 - p->j0;
    v->k->axpy_group_fast(kind, acc + (kv - p->k0) * nj * p->w, p->w,
                          weights + (kv * v->group + p->j0) * v->kph + at, v->kph, nj, rows,
                          v->d, count, p->w, ahead);
}

static void fast_pass_run(const gather_view *v, const fast_pass *p, const float *weights,
                          const double *candidates, double *outputs)
{
    float acc[FAST_FLOATS];
    size_t nj = p->j1 - p->j0;
    memset(acc, 0, (p->k1 - p->k0) * nj * p->w * sizeof *acc);
    for (size_t i = 0; i < v->pieces; i++) {
        piece pc = piece_at(v, i);
        piece next = i + 1 < v->pieces ? piece_at(v, i + 1) : pc;
        for (size_t kv = p->k0; kv < p->k1; kv++) {
            const unsigned char *vals = piece_values(v, pc, kv);
            /* The next piece's value rows, asked for by the kernels as they go (scores). */
            const unsigned char *ahead =
                v->prefetch && i + 1 < v->pieces ? piece_values(v, next, kv) + p->f0 * v->elem
                                                 : NULL;
            fast_add_rows(v, p, weights, v->kind, vals + p->f0 * v->elem, pc.at, pc.rows, kv,
                          ahead, acc);
        }
    }
    float cand32[FAST_FLOATS];
    for (size_t kv = p->k0; candidates != NULL && kv < p->k1; kv++) {
        for (size_t f = 0; f < p->w; f++) {
            cand32[f] = (float)candidates[kv * v->d + p->f0 + f];
        }
        /* The candidate: one f32 row, the last weight of each head. */
        fast_add_rows(v, p, weights, KVPI_ROWS_F32, cand32, v->kph - 1, 1, kv, NULL, acc);
    }
    for (size_t kv = p->k0; kv < p->k1; kv++) {
        for (size_t j = p->j0; j < p->j1; j++) {
            const float *a = acc + ((kv - p->k0) * nj + (j - p->j0)) * p->w;
            double *out = outputs + (kv * v->group + j) * v->d + p->f0;
            for (size_t f = 0; f < p->w; f++) {
                out[f] = v->kind == KVPI_ROWS_E4M3 ? (double)a[f] * v->v_scale : (double)a[f];
            }
        }
    }
}

/*
 * Fast values of KV heads [k0, k1), features [f0, f0 + w): in passes whose
 * f32 accumulators fit FAST_FLOATS (whole groups of several KV heads when
 * they fit; else fewer heads of a group, then narrower features). Every
 * output is one fmaf chain over the positions in order inside one pass, so
 * the passes change no bit.
 */
static void values_fast(const gather_view *v, const float *weights, const double *candidates,
                        size_t k0, size_t k1, size_t f0, size_t w, double *outputs)
{
    if (w == 0) {
        return;
    }
    size_t nj = v->group < FAST_FLOATS / 16 ? v->group : FAST_FLOATS / 16;
    size_t ws = w < FAST_FLOATS / nj ? w : FAST_FLOATS / nj;
    size_t nk = nj == v->group ? FAST_FLOATS / (nj * ws) : 1;
    for (size_t ka = k0; ka < k1; ka += nk) {
        for (size_t ja = 0; ja < v->group; ja += nj) {
            for (size_t fa = 0; fa < w; fa += ws) {
                fast_pass p = {ka, ka + nk < k1 ? ka + nk : k1, ja,
                               ja + nj < v->group ? ja + nj : v->group, f0 + fa,
                               w - fa < ws ? w - fa : ws};
                fast_pass_run(v, &p, weights, candidates, outputs);
            }
        }
    }
}

/*
 * Features [f0, f0 + w) of the head outputs of the query heads (`heads` in
 * all) of KV heads [k0, k1) in `lane`: zero, every retained position in
 * order, then the candidate unless candidates is NULL. Blocks outer, heads
 * inner, so a block's value rows of the range are read as one stream.
 * weights is the lane's [H][keys] (f32 at the fast level, else f64),
 * candidates its [H_kv][d_h] (elements, for fp8), outputs its [H][d_h].
 */
static void values_range(const kvp_cache *cache, size_t heads, const void *weights,
                         const double *candidates, size_t lane, size_t k0, size_t k1, size_t f0,
                         size_t w, double *outputs, kvp_accum accum)
{
    gather_view v = view_of(cache, heads, candidates != NULL, lane, accum);
    if (v.fast) {
        values_fast(&v, weights, candidates, k0, k1, f0, w, outputs);
    } else {
        values_exact(&v, weights, candidates, k0, k1, f0, w, outputs);
    }
}

void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores)
{
    size_t heads = kvpi_cache_query_heads(cache);
    scores_blocks(cache, heads, 1, queries, candidates, lane, 0,
                  pieces_of(cache, span_of(cache, 1)), scale, scores, KVP_ACCUM_EXACT);
}

void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs)
{
    size_t heads = kvpi_cache_query_heads(cache);
    values_range(cache, heads, weights, candidates, lane, 0, cache->heads, 0, cache->head_width,
                 outputs, KVP_ACCUM_EXACT);
}

/* ---- the partition ------------------------------------------------------------ */

/* Blocks per scores chunk. */
static size_t chunk_blocks(const kvp_cache *cache)
{
    size_t page_key_bytes =
        cache->block_tokens * cache->heads * cache->head_width * cache->pool->element_bytes;
    size_t blocks = grain.chunk_bytes / page_key_bytes;
    return blocks > 0 ? blocks : 1;
}

/*
 * Scores chunks per lane, of whole pieces (a window's blocks, gather's
 * pieces_of): at least one (the candidate's, when there is no piece).
 */
static size_t lane_chunks(const kvp_cache *cache, int candidate)
{
    size_t blocks = pieces_of(cache, span_of(cache, candidate));
    size_t per = chunk_blocks(cache);
    return blocks == 0 ? 1 : blocks / per + (blocks % per != 0);
}

/*
 * The values phase's parts per lane: `ranges` runs of KV heads, each cut
 * into `slices` feature slices (a power of two, each a multiple of 8
 * features), about value_units parts in all.
 */
typedef struct value_layout {
    size_t ranges;
    size_t slices;
} value_layout;

static value_layout value_layout_of(const kvp_cache *cache)
{
    size_t want = grain.value_units / cache->batch_size +
                  (grain.value_units % cache->batch_size != 0);
    value_layout v = {want < cache->heads ? want : cache->heads, 1};
    if (v.ranges == 0) {
        v.ranges = 1;
    }
    while (v.ranges * v.slices < want && (cache->head_width / v.slices) % 16 == 0) {
        v.slices *= 2;
    }
    return v;
}

/* Query heads of a job: its own count, or its cache's binding's. */
static size_t job_heads(const kvpi_gather_job *job)
{
    return job->heads != 0 ? job->heads : kvpi_cache_query_heads(job->cache);
}

/* The job runs the fast level (view_of's test): its scores and weights are f32. */
static int job_fast(const kvpi_gather_job *job)
{
    return job->accum == KVP_ACCUM_FAST && kvpi_cache_dtype(job->cache) != KVP_F64 &&
           job->cache->head_width <= FAST_FLOATS;
}

/* The lane's scores (weights) row block, [H][keys], in the job's element type. */
static void *job_lane_weights(const kvpi_gather_job *job, size_t lane, size_t heads, size_t keys)
{
    size_t at = lane * heads * keys;
    return job_fast(job) ? (void *)((float *)(void *)job->weights + at)
                         : (void *)(job->weights + at);
}

/*
 * Scores per (lane, query head) row: the attended retained positions (all
 * of them without a window), and the candidate if any.
 */
static size_t job_keys(const kvpi_gather_job *job)
{
    kvpi_window_span sp = span_of(job->cache, job->keys != NULL);
    return sp.sinks + (job->cache->len - sp.lo) + (job->keys != NULL);
}

/* Softmax parts of `rows` rows of `keys` scores each (none when keys is 0). */
static size_t softmax_parts(size_t rows, size_t keys)
{
    if (keys == 0) {
        return 0;
    }
    size_t per = grain.softmax_elements / keys;
    per = per > 0 ? per : 1;
    return rows / per + (rows % per != 0);
}

size_t kvpi_gather_score_parts(const kvp_cache *cache)
{
    return cache->batch_size * lane_chunks(cache, 1);
}

size_t kvpi_gather_softmax_parts(const kvp_cache *cache)
{
    kvpi_window_span sp = span_of(cache, 1);
    return softmax_parts(cache->batch_size * kvpi_cache_query_heads(cache),
                         kvpi_window_keys(sp, cache->len));
}

size_t kvpi_gather_value_parts(const kvp_cache *cache)
{
    value_layout v = value_layout_of(cache);
    return cache->batch_size * v.ranges * v.slices;
}

/* par, unless the job reads too few bytes of keys for a hand-off to pay. */
static const kvpi_parallel *worth(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    const kvp_cache *cache = job->cache;
    size_t bytes = cache->batch_size * job_keys(job) * cache->heads * cache->head_width *
                   cache->pool->element_bytes;
    return bytes >= grain.min_parallel_bytes ? par : NULL;
}

static void score_part(void *ctx, size_t part)
{
    const kvpi_gather_job *job = ctx;
    const kvp_cache *cache = job->cache;
    int candidate = job->keys != NULL;
    size_t chunks = lane_chunks(cache, candidate);
    size_t lane = part / chunks;
    size_t chunk = part % chunks;
    size_t per = chunk_blocks(cache);
    size_t blocks = pieces_of(cache, span_of(cache, candidate));
    size_t b0 = chunk * per;
    size_t b1 = b0 + per < blocks ? b0 + per : blocks;
    size_t heads = job_heads(job);
    size_t kv_width = cache->heads * cache->head_width;
    const double *candidates =
        job->keys != NULL && chunk + 1 == chunks ? job->keys + lane * kv_width : NULL;
    size_t keys = job_keys(job);
    scores_blocks(cache, heads, candidate, job->queries + lane * heads * cache->head_width, candidates,
                  lane, b0, b1, job->scale, job_lane_weights(job, lane, heads, keys),
                  job->accum);
}

static void softmax_part(void *ctx, size_t part)
{
    const kvpi_gather_job *job = ctx;
    size_t rows = job->cache->batch_size * job_heads(job);
    size_t keys = job_keys(job);
    size_t per = grain.softmax_elements / keys > 0 ? grain.softmax_elements / keys : 1;
    size_t end = (part + 1) * per < rows ? (part + 1) * per : rows;
    for (size_t row = part * per; row < end; row++) {
        if (job_fast(job)) {
            kvpi_softmax_fast((float *)(void *)job->weights + row * keys, keys);
        } else {
            kvpi_softmax(job->weights + row * keys, keys);
        }
    }
}

static void value_part(void *ctx, size_t part)
{
    const kvpi_gather_job *job = ctx;
    const kvp_cache *cache = job->cache;
    value_layout v = value_layout_of(cache);
    size_t per_lane = v.ranges * v.slices;
    size_t lane = part / per_lane;
    size_t range = part % per_lane / v.slices;
    size_t width = cache->head_width / v.slices;
    size_t heads = job_heads(job);
    size_t kv_width = cache->heads * cache->head_width;
    values_range(cache, heads, job_lane_weights(job, lane, heads, job_keys(job)),
                 job->values != NULL ? job->values + lane * kv_width : NULL, lane,
                 range * cache->heads / v.ranges, (range + 1) * cache->heads / v.ranges,
                 part % v.slices * width, width, job->outputs + lane * heads * cache->head_width,
                 job->accum);
}

/* The values of a whole lane in one stream: the phase on one thread. */
static void value_lane(void *ctx, size_t lane)
{
    const kvpi_gather_job *job = ctx;
    const kvp_cache *cache = job->cache;
    size_t heads = job_heads(job);
    values_range(cache, heads, job_lane_weights(job, lane, heads, job_keys(job)),
                 job->values != NULL ? job->values + lane * cache->heads * cache->head_width
                                     : NULL,
                 lane, 0, cache->heads, 0, cache->head_width,
                 job->outputs + lane * heads * cache->head_width, job->accum);
}

void kvpi_gather_scores_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    kvpi_parallel_run(worth(job, par), score_part, (void *)job,
                      job->cache->batch_size * lane_chunks(job->cache, job->keys != NULL));
}

kvp_status kvpi_gather_check_scores(const kvpi_gather_job *job, kvp_error *err)
{
    size_t n = job->cache->batch_size * job_heads(job) * job_keys(job);
    if (!job_fast(job)) {
        return kvpi_check_finite(job->weights, n, KVP_NONFINITE_SCORE, "score", err);
    }
    const float *s = (const float *)(const void *)job->weights;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(s[i])) {
            kvp_error e = kvpi_error_begin(KVP_NONFINITE_SCORE);
            e.what = "score";
            e.index = i;
            e.value = (double)s[i];
            return kvpi_error_emit(err, &e);
        }
    }
    return KVP_OK;
}

void kvpi_gather_widen_weights(const kvpi_gather_job *job)
{
    if (!job_fast(job)) {
        return;
    }
    size_t n = job->cache->batch_size * job_heads(job) * job_keys(job);
    const float *w32 = (const float *)(const void *)job->weights;
    /* Backwards: double i (bytes 8i..8i+7) covers only floats i and above, already read. */
    for (size_t i = n; i-- > 0;) {
        float w = w32[i];
        job->weights[i] = (double)w;
    }
}

size_t kvpi_gather_job_keys(const kvpi_gather_job *job)
{
    return job_keys(job);
}

int kvpi_gather_job_fast(const kvpi_gather_job *job)
{
    return job_fast(job);
}

void kvpi_gather_softmax_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    kvpi_parallel_run(worth(job, par), softmax_part, (void *)job,
                      softmax_parts(job->cache->batch_size * job_heads(job), job_keys(job)));
}

void kvpi_gather_values_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    par = worth(job, par);
    if (par == NULL) {
        kvpi_parallel_run(NULL, value_lane, (void *)job, job->cache->batch_size);
    } else {
        kvpi_parallel_run(par, value_part, (void *)job, kvpi_gather_value_parts(job->cache));
    }
}

void kvpi_gather_attend_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    kvpi_gather_scores_on(job, par);
    kvpi_gather_softmax_on(job, par);
    kvpi_gather_values_on(job, par);
}
