/*
 * prefill.c: one layer's attention for a block of new tokens, one visit per
 * page for the whole block (see prefill.h).
 *
 * Owns: the blocked prefill of one layer. For a block of T rows at
 * positions P_t = len + t (len: the cache's length, the same in every layer
 * while a block runs; nothing is committed until the block is done):
 *   1. Q, K and V of all T rows in one kvpi_project_rows each (a row's bits
 *      do not depend on how many rows it is given, kernels.h);
 *   2. row by row, in order, the checks of kvpi_attention_prepare
 *      (incremental.c): non-finite query, key, value projection; RoPE at
 *      P_t; a key/value the dtype cannot hold; then both are rounded to the
 *      dtype, as the pages would store them;
 *   3. scores: for each page of the retained positions [0, len), every row
 *      scores its query heads against the page's keys (one visit per page
 *      for the block); then row t scores the block's rows 0..t (its own
 *      candidate last) from the rounded f64 rows of step 2;
 *   4. row by row, the finite check of the scores;
 *   5. softmax (kvpi_softmax per row), then the values the same way: each
 *      row's accumulators are zeroed once, get every page's rows, then the
 *      block's rows 0..t;
 *   6. the output projection of all rows, its finite check, and the seed's
 *      validate_append, row by row.
 * Exactness: the token-by-token gather (gather.c) at length P_t reads the
 * positions of a block's page with one dot_rows/axpy_rows call and the
 * candidate with dot/axpy; here a page holding both retained rows and rows
 * of this block is read in two calls (pages, then block rows). By the
 * kernels' contract (kernels.h) a dot_rows row equals dot and does not
 * depend on how many rows are in flight, axpy_rows is one axpy per row in
 * order, and the f32/bf16 kernels equal the f64 ones on the widened rows,
 * which are the rounded f64 rows kept here. So every score and accumulator
 * gets the same operations in the same order: the bits are those of the
 * token-by-token path, for every dtype. A row failing a check stops the
 * rows after it (the caller reports the first failing row), so later
 * stages run on fewer rows. The caller commits the rows' keys and values,
 * token after token, when the block has passed every layer.
 *
 * Windows (docs/DESIGN.md, Sliding windows and sinks): row t attends to
 * its positions of the cache's window rule, in order: the retained sink
 * rows, the retained window rows [lo_t, len), then the block's own rows
 * (sinks reaching past len, then its window rows); only the pages covering
 * the retained ranges are read, and scores are packed [row_keys].
 *
 * Threads: steps 3 and 5 run on `par` in parts (lane, KV head, run of
 * rows): parts write disjoint scores and accumulators, and each element is
 * computed inside one part as above, so the bits do not depend on the
 * executor. The partition depends on the shape only. Other steps run on the
 * calling thread.
 * Callers: src/serve/sequence.c, bench/ and tests/ (through prefill.h).
 */
#include "attention/prefill.h"

#include <math.h>
#include <string.h>

#include "attention/gather.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/dtype.h"
#include "pager/error.h"

/* Parts wanted per step: runs of rows are cut until there are about this many. */
#define WANT_PARTS 4

size_t kvpi_prefill_work_doubles(size_t batch, size_t model_width, size_t heads, size_t kv_width,
                                 size_t keys, size_t layers)
{
    size_t scores = 0;
    size_t kv = 0;
    size_t d = 0;
    size_t sum = 0;
    if (__builtin_mul_overflow(batch, heads, &scores) ||
        __builtin_mul_overflow(scores, keys, &scores) ||
        __builtin_mul_overflow(batch, kv_width, &kv) ||
        __builtin_mul_overflow(kv, 2 * layers, &kv) ||
        __builtin_mul_overflow(batch, 5 * model_width, &d) ||
        __builtin_add_overflow(scores, kv, &sum) || __builtin_add_overflow(sum, d, &sum)) {
        return SIZE_MAX;
    }
    return sum;
}

void kvpi_prefill_work_init(kvpi_prefill_work *w, double *storage, size_t tokens, size_t batch,
                            size_t model_width, size_t heads, size_t kv_width, size_t keys,
                            size_t layers)
{
    size_t d_rows = tokens * batch * model_width;
    size_t kv_rows = layers * tokens * batch * kv_width;
    *w = (kvpi_prefill_work){
        .tokens = tokens,
        .batch = batch,
        .model_width = model_width,
        .heads = heads,
        .kv_width = kv_width,
        .keys = keys,
        .layers = layers,
    };
    double *p = storage;
    double **const slots[] = {&w->input, &w->next, &w->query, &w->head_outputs, &w->output};
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
        *slots[i] = p;
        p += d_rows;
    }
    w->key = p;
    p += kv_rows;
    w->value = p;
    p += kv_rows;
    w->weights = p;
}

/* What the parts of steps 3 and 5 share. */
typedef struct block_job {
    const kvp_cache *cache;
    kvpi_prefill_work *w;
    const double *keys;   /* the layer's slot of w->key: [tokens][B][kv_width] */
    const double *values; /* likewise */
    size_t tokens;        /* rows of the block that take part */
    size_t first;         /* P_0 = cache->len: the retained positions */
    size_t runs;          /* runs of rows per (lane, KV head) */
    double scale;         /* 1 / sqrt(d_h), times an fp8 cache's k_scale (once) */
    size_t window;        /* the cache's window W and sinks S (0, 0: full attention) */
    size_t sinks;
    double v_scale;       /* an fp8 cache's v_scale, multiplied once at the end; else 1 */
} block_job;

/* Row t's attended positions (P_t = first + t; the cache's window rule). */
static kvpi_window_span row_span(const block_job *job, size_t t)
{
    return kvpi_window_span_at(job->window, job->sinks, job->first + t);
}

/* Row t's scores per head: its attended positions, P_t + 1 without a window. */
static size_t row_keys(const block_job *job, size_t t)
{
    return kvpi_window_keys(row_span(job, t), job->first + t);
}

/*
 * Row t's scores of lane `lane`, query head `head`: [row_keys], the sinks,
 * then the window's retained positions, then the block's rows up to t.
 */
static double *row_scores(const block_job *job, size_t t, size_t lane, size_t head)
{
    const kvpi_prefill_work *w = job->w;
    double *row = w->weights + t * w->batch * w->heads * w->keys;
    return row + (lane * kvpi_cache_query_heads(job->cache) + head) * row_keys(job, t);
}

/*
 * The part of block `block`'s retained rows [0, first) that row t attends
 * to, sinks first (which = 0) then window (which = 1): rows [r0, r0 + n)
 * of the block, scores at `at` of the row. n == 0 when none.
 */
typedef struct row_piece {
    size_t r0, n, at;
} row_piece;

static row_piece row_piece_of(const block_job *job, size_t t, size_t block, int which)
{
    kvpi_window_span sp = row_span(job, t);
    size_t bt = job->cache->block_tokens;
    size_t p0 = which == 0 ? 0 : sp.lo;
    size_t p1 = which == 0 ? (sp.sinks < job->first ? sp.sinks : job->first) : job->first;
    size_t start = block * bt > p0 ? block * bt : p0;
    size_t end = (block + 1) * bt < p1 ? (block + 1) * bt : p1;
    if (end <= start) {
        return (row_piece){0, 0, 0};
    }
    return (row_piece){start - block * bt, end - start,
                       (which == 0 ? 0 : sp.sinks) + (start - p0)};
}

/*
 * Row t's attended rows of the block itself (positions first .. P_t), in
 * position order: seg 0 the sinks past the retained rows, [first, sinks);
 * seg 1 the window's part, [max(lo, first), P_t]. Block rows [r0, r0 + n),
 * scores at `at`. When seg 0 has rows the window starts past them (lo >=
 * sinks > first), so no retained window row comes between: the order of
 * the row's positions is retained sinks, retained window, seg 0, seg 1.
 */
static row_piece row_block_piece(const block_job *job, size_t t, int seg)
{
    kvpi_window_span sp = row_span(job, t);
    if (seg == 0) {
        size_t n = sp.sinks > job->first ? sp.sinks - job->first : 0;
        return (row_piece){0, n, job->first};
    }
    size_t r0 = sp.lo > job->first ? sp.lo - job->first : 0;
    return (row_piece){r0, t + 1 - r0, sp.sinks + (job->first + r0 - sp.lo)};
}

/* The block of row t0's window start: rows after it start no earlier. */
static size_t first_window_block(const block_job *job, size_t t0)
{
    return row_span(job, t0).lo / job->cache->block_tokens;
}

/* What one part (a lane, a KV head, rows [t0, t1) of the block) reads, and where. */
typedef struct part_view {
    size_t lane, g, t0, t1;
    size_t d, bt, group, kv_width;
    size_t row_stride; /* from one block row to the next */
    size_t blocks;     /* the cache's mapped pages */
    const uint32_t *table;
    const kvpi_kernels *k;
    kvp_dtype dtype;
} part_view;

static part_view view_of(const block_job *job, size_t part)
{
    const kvp_cache *cache = job->cache;
    part_view v;
    size_t run = part % job->runs;
    size_t rest = part / job->runs;
    v.g = rest % cache->heads;
    v.lane = rest / cache->heads;
    v.t0 = run * job->tokens / job->runs;
    v.t1 = (run + 1) * job->tokens / job->runs;
    v.d = cache->head_width;
    v.bt = cache->block_tokens;
    v.group = kvpi_cache_query_heads(cache) / cache->heads;
    v.kv_width = cache->heads * v.d;
    v.row_stride = job->w->batch * v.kv_width;
    v.blocks = kvpi_cache_mapped_blocks(cache);
    v.table = kvpi_cache_lane_table(cache, v.lane);
    v.k = kvpi_kernels_active();
    v.dtype = kvpi_cache_dtype(cache);
    return v;
}

/*
 * Block `block`'s keys (which: sinks 0, window 1) against rows [t0, t1):
 * each row scores the block rows it attends to, at their place in its row.
 */
static void score_block(const block_job *job, const part_view *v, size_t block, int which)
{
    const kvpi_prefill_work *w = job->w;
    size_t row_bytes = v->d * job->cache->pool->element_bytes;
    const unsigned char *page_keys = kvpi_cache_page_keys(job->cache, v->table[block], v->g);
    for (size_t t = v->t0; t < v->t1; t++) {
        row_piece pc = row_piece_of(job, t, block, which);
        const double *q = w->query + (t * w->batch + v->lane) * w->model_width;
        for (size_t head = v->g * v->group; pc.n > 0 && head < (v->g + 1) * v->group; head++) {
            kvpi_dot_stored_rows(v->k, v->dtype, q + head * v->d, page_keys + pc.r0 * row_bytes,
                                 pc.n, v->d, job->scale,
                                 row_scores(job, t, v->lane, head) + pc.at);
        }
    }
}

/*
 * The blocks [*b0, *b1) any row of the part may read of one kind (which:
 * 0 the sinks, 1 the window's retained part): the sinks of its last row
 * (min(S, lo) grows with t), the window from its first row's start (lo
 * grows with t) to the mapped end. Empty for a part without rows.
 */
static void part_blocks(const block_job *job, const part_view *v, int which, size_t *b0,
                        size_t *b1)
{
    size_t bt = job->cache->block_tokens;
    *b0 = 0;
    *b1 = 0;
    if (v->t0 >= v->t1) {
        return;
    }
    if (which == 0) {
        size_t sinks = row_span(job, v->t1 - 1).sinks;
        sinks = sinks < job->first ? sinks : job->first; /* retained sinks only */
        *b1 = (sinks + bt - 1) / bt;
    } else {
        *b0 = first_window_block(job, v->t0);
        *b1 = v->blocks;
    }
}

static void score_part(void *ctx, size_t part)
{
    const block_job *job = ctx;
    const kvpi_prefill_work *w = job->w;
    part_view v = view_of(job, part);
    for (int which = 0; which < 2; which++) {
        size_t b0, b1;
        part_blocks(job, &v, which, &b0, &b1);
        for (size_t block = b0; block < b1; block++) {
            score_block(job, &v, block, which);
        }
    }
    const double *block_keys = job->keys + v.lane * v.kv_width + v.g * v.d;
    for (size_t t = v.t0; t < v.t1; t++) {
        const double *q = w->query + (t * w->batch + v.lane) * w->model_width;
        for (int seg = 0; seg < 2; seg++) {
            row_piece pc = row_block_piece(job, t, seg);
            for (size_t head = v.g * v.group; pc.n > 0 && head < (v.g + 1) * v.group; head++) {
                v.k->dot_rows(q + head * v.d, block_keys + pc.r0 * v.row_stride, v.row_stride,
                              pc.n, v.d, job->scale, row_scores(job, t, v.lane, head) + pc.at);
            }
        }
    }
}

/* Block `block`'s values (which: sinks 0, window 1) into rows [t0, t1), as score_block. */
static void value_block(const block_job *job, const part_view *v, size_t block, int which)
{
    const kvpi_prefill_work *w = job->w;
    size_t row_bytes = v->d * job->cache->pool->element_bytes;
    const unsigned char *page_values =
        kvpi_cache_page_values(job->cache, v->table[block], v->g);
    for (size_t t = v->t0; t < v->t1; t++) {
        row_piece pc = row_piece_of(job, t, block, which);
        double *acc = w->head_outputs + (t * w->batch + v->lane) * w->model_width;
        for (size_t head = v->g * v->group; pc.n > 0 && head < (v->g + 1) * v->group; head++) {
            kvpi_axpy_stored_rows(v->k, v->dtype, acc + head * v->d,
                                  row_scores(job, t, v->lane, head) + pc.at,
                                  page_values + pc.r0 * row_bytes, pc.n, v->d, 0, v->d);
        }
    }
}

static void value_part(void *ctx, size_t part)
{
    const block_job *job = ctx;
    const kvpi_prefill_work *w = job->w;
    part_view v = view_of(job, part);
    for (size_t t = v.t0; t < v.t1; t++) {
        for (size_t head = v.g * v.group; head < (v.g + 1) * v.group; head++) {
            kvpi_softmax(row_scores(job, t, v.lane, head), row_keys(job, t));
            memset(w->head_outputs + (t * w->batch + v.lane) * w->model_width + head * v.d, 0,
                   v.d * sizeof(double));
        }
    }
    for (int which = 0; which < 2; which++) {
        size_t b0, b1;
        part_blocks(job, &v, which, &b0, &b1);
        for (size_t block = b0; block < b1; block++) {
            value_block(job, &v, block, which);
        }
    }
    const double *block_values = job->values + v.lane * v.kv_width + v.g * v.d;
    for (size_t t = v.t0; t < v.t1; t++) {
        double *acc = w->head_outputs + (t * w->batch + v.lane) * w->model_width;
        for (size_t head = v.g * v.group; head < (v.g + 1) * v.group; head++) {
            for (int seg = 0; seg < 2; seg++) {
                row_piece pc = row_block_piece(job, t, seg);
                if (pc.n == 0) {
                    continue;
                }
                v.k->axpy_rows(acc + head * v.d, row_scores(job, t, v.lane, head) + pc.at,
                               block_values + pc.r0 * v.row_stride, v.row_stride, pc.n, v.d);
            }
            for (size_t f = 0; job->v_scale != 1.0 && f < v.d; f++) {
                acc[head * v.d + f] *= job->v_scale;
            }
        }
    }
}

/* Cuts the job into parts (its runs), and says where they run. */
static const kvpi_parallel *plan(block_job *job, const kvpi_parallel *par, size_t *parts)
{
    const kvp_cache *cache = job->cache;
    size_t units = cache->batch_size * cache->heads;
    size_t runs = units >= WANT_PARTS ? 1 : (WANT_PARTS + units - 1) / units;
    job->runs = runs < job->tokens ? runs : job->tokens;
    *parts = units * job->runs;
    size_t bytes = job->tokens * cache->batch_size * job->first * cache->heads *
                   cache->head_width * cache->pool->element_bytes;
    /* The gather's threshold (gather.h): below it a hand-off costs more than it gives. */
    return bytes >= kvpi_gather_grain_get().min_parallel_bytes ? par : NULL;
}

/* Row t's projections: the checks of incremental.c's project, in its order. */
static kvp_status check_projection(const double *query, const double *key, const double *value,
                                   size_t d, size_t kv, kvp_error *e)
{
    kvp_status status = kvpi_check_finite(query, d, KVP_NONFINITE_PROJECTION, "query", e);
    if (status == KVP_OK) {
        status = kvpi_check_finite(key, kv, KVP_NONFINITE_PROJECTION, "key", e);
    }
    if (status == KVP_OK) {
        status = kvpi_check_finite(value, kv, KVP_NONFINITE_PROJECTION, "value", e);
    }
    return status;
}

/* Steps 1 and 2 into the keys and values at `key`, `value`; returns the rows that passed. */
static size_t project_rows(const kvp_layer *layer, const kvp_cache *cache,
                           kvpi_prefill_work *w, double *key, double *value, size_t tokens,
                           kvp_error *failure)
{
    size_t d = layer->model_width;
    size_t kv_width = layer->kv_heads * layer->head_width;
    double *const outputs[3] = {w->query, key, value};
    const size_t widths[3] = {d, kv_width, kv_width};
    for (size_t which = 0; which < 3; which++) {
        const double *weights = kvp_param_values(layer->params[which]);
        kvpi_project_rows(w->input, d, tokens * w->batch, weights, d, widths[which],
                          outputs[which], widths[which]);
    }
    size_t kv = w->batch * kv_width;
    for (size_t t = 0; t < tokens; t++) {
        double *q = w->query + t * w->batch * d;
        double *k = key + t * kv;
        double *v = value + t * kv;
        kvp_status status = check_projection(q, k, v, w->batch * d, kv, failure);
        if (status == KVP_OK) {
            kvpi_layer_rope_qk(layer, q, w->batch * layer->heads, k, w->batch * layer->kv_heads,
                               cache->len + t);
            status = kvpi_cache_check_storable(cache, k, kv, KVP_NONFINITE_KEY, failure);
        }
        if (status == KVP_OK) {
            status = kvpi_cache_check_storable(cache, v, kv, KVP_NONFINITE_VALUE, failure);
        }
        if (status != KVP_OK) {
            return t;
        }
        kvpi_cache_round_rows(cache, 0, k, kv);
        kvpi_cache_round_rows(cache, 1, v, kv);
    }
    return tokens;
}

size_t kvpi_prefill_layer(const kvp_layer *layer, const kvp_cache *cache, size_t slot,
                          kvpi_prefill_work *w, size_t tokens, const kvpi_parallel *par,
                          kvp_error *failure)
{
    double *key = w->key + slot * w->tokens * w->batch * w->kv_width;
    double *value = w->value + slot * w->tokens * w->batch * w->kv_width;
    size_t passed = project_rows(layer, cache, w, key, value, tokens, failure);
    if (passed == 0) {
        return 0;
    }
    size_t first = cache->len;
    block_job job = {
        .cache = cache,
        .w = w,
        .keys = key,
        .values = value,
        .tokens = passed,
        .first = first,
    };
    kvpi_cache_window(cache, &job.window, &job.sinks);
    /* fp8 pages: the gather's rule (gather.c), so blocked and stepped rows agree. */
    double k_scale;
    kvpi_cache_kv_scales(cache, &k_scale, &job.v_scale);
    job.scale = 1.0 / sqrt((double)layer->head_width) * k_scale;
    size_t parts = 0;
    const kvpi_parallel *on = plan(&job, par, &parts);
    kvpi_parallel_run(on, score_part, &job, parts);
    for (size_t t = 0; t < job.tokens; t++) {
        const double *scores = w->weights + t * w->batch * w->heads * w->keys;
        if (kvpi_check_finite(scores, w->batch * layer->heads * row_keys(&job, t),
                              KVP_NONFINITE_SCORE, "score", failure) != KVP_OK) {
            job.tokens = t;
            break;
        }
    }
    if (job.tokens == 0) {
        return 0;
    }
    on = plan(&job, par, &parts);
    kvpi_parallel_run(on, value_part, &job, parts);
    size_t d = layer->model_width;
    size_t n = w->batch * d;
    const double *w_output = kvp_param_values(layer->params[KVP_PARAM_OUTPUT]);
    kvpi_project_rows(w->head_outputs, d, job.tokens * w->batch, w_output, d, d, w->output, d);
    for (size_t t = 0; t < job.tokens; t++) {
        if (kvpi_check_finite(w->output + t * n, n, KVP_NONFINITE_OUTPUT, "output", failure) !=
            KVP_OK) {
            return t;
        }
        size_t kv = t * w->batch * cache->heads * cache->head_width;
        kvp_tensor k4 = kvp_tensor4(key + kv, cache->batch_size, cache->heads, 1,
                                    cache->head_width);
        kvp_tensor v4 = kvp_tensor4(value + kv, cache->batch_size, cache->heads, 1,
                                    cache->head_width);
        if (kvpi_cache_validate_append(cache, &k4, &v4, failure) != KVP_OK) {
            return t;
        }
    }
    return job.tokens;
}
