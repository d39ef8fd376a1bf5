/*
 * gather.c: attention's reads of retained rows through a cache's page table,
 * and their exact partition into parts for threads.
 *
 * Owns: the loops that touch pages. A page keeps the keys of all stored (KV)
 * heads, [H_kv][block_tokens][d_h], in one contiguous run (and the values in
 * the next), so a block is read as one stream per KV head, with one table
 * lookup per block, never one per element. Query head h reads KV head
 * h / (H / H_kv); the H / H_kv query heads of a group are consecutive, so a
 * KV head's rows are read once from memory and served to its whole group
 * from cache. For every query head, positions are still visited in order
 * 0 .. len-1 and then the candidate, the order the full-prefix reference
 * uses, and every dot product and axpy goes through the dispatched kernels,
 * whose results do not depend on how many rows of a block are handed over at
 * once (kernels.h), so the sums agree bit for bit with the reference and
 * across block sizes. A block's rows for one head go to the multi-row
 * kernels in one call, so several rows are in flight. Pages hold the pool's
 * dtype: the f32 and bf16 kernels widen the stored rows exactly and then
 * compute as the f64 ones (kernels.h), so the order and the bits are those
 * of the f64 kernels on the widened rows. The candidate row is f64 already
 * rounded to the dtype (incremental.c).
 *
 * The partition (one decode step, every lane): each phase is cut into parts
 * that share no output element, and each output element is computed inside
 * one part by exactly the serial loop's operations, in its order. So the
 * bits are the same for any executor, any thread count and any order of the
 * parts; the partition is a function of the shape only, and it is exact, not
 * a "flash-decoding" split (whose per-chunk max and sum would round the
 * softmax differently; docs/DESIGN.md, Threads).
 *   scores   part = (lane, chunk of whole blocks): a score is one dot
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

#include <string.h>

#include "attention/kernels.h"

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

static size_t blocks_of(const kvp_cache *cache)
{
    return cache->len / cache->block_tokens + (cache->len % cache->block_tokens != 0);
}

/*
 * Scores of the `heads` query heads of `lane` at the retained positions of
 * blocks [b0, b1), and of the candidate unless candidates is NULL. scores is
 * the lane's [H][keys_per_head] (len + 1 when the job has a candidate, len
 * without).
 */
static void scores_blocks(const kvp_cache *cache, size_t heads, size_t keys_per_head,
                          const double *queries, const double *candidates, size_t lane,
                          size_t b0, size_t b1, double scale, double *scores)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    size_t group = heads / cache->heads;
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    const kvpi_kernels *k = kvpi_kernels_active();
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    size_t head_bytes = bt * d * cache->pool->element_bytes;
    for (size_t block = b0; block < b1; block++) {
        size_t start = block * bt;
        size_t rows = cache->len - start < bt ? cache->len - start : bt;
        const unsigned char *page_keys = kvpi_cache_page_keys(cache, table[block], 0);
        for (size_t head = 0; head < heads; head++) {
            kvpi_dot_stored_rows(k, dtype, queries + head * d,
                                 page_keys + (head / group) * head_bytes, rows, d, scale,
                                 scores + head * keys_per_head + start);
        }
    }
    if (candidates != NULL) {
        for (size_t head = 0; head < heads; head++) {
            scores[head * keys_per_head + cache->len] =
                k->dot(queries + head * d, candidates + (head / group) * d, d) * scale;
        }
    }
}

/*
 * Features [f0, f0 + w) of the head outputs of the query heads (`heads` in
 * all) of KV heads [k0, k1) in `lane`: zero, every retained position in
 * order, then the candidate unless candidates is NULL. Blocks outer, heads inner, so a block's value rows of the range
 * are read as one stream. weights is the lane's [H][len + 1], candidates
 * its [H_kv][d_h], outputs its [H][d_h].
 */
static void values_range(const kvp_cache *cache, size_t heads, const double *weights,
                         const double *candidates, size_t lane, size_t k0, size_t k1, size_t f0,
                         size_t w, double *outputs)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    size_t group = heads / cache->heads;
    size_t keys_per_head = cache->len + (candidates != NULL);
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    const kvpi_kernels *k = kvpi_kernels_active();
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    for (size_t head = k0 * group; head < k1 * group; head++) {
        memset(outputs + head * d + f0, 0, w * sizeof *outputs);
    }
    size_t blocks = blocks_of(cache);
    for (size_t block = 0; block < blocks; block++) {
        size_t start = block * bt;
        size_t rows = cache->len - start < bt ? cache->len - start : bt;
        for (size_t kv_head = k0; kv_head < k1; kv_head++) {
            const void *page_values = kvpi_cache_page_values(cache, table[block], kv_head);
            for (size_t head = kv_head * group; head < (kv_head + 1) * group; head++) {
                kvpi_axpy_stored_rows(k, dtype, outputs + head * d + f0,
                                      weights + head * keys_per_head + start, page_values, rows,
                                      d, f0, w);
            }
        }
    }
    for (size_t head = k0 * group; candidates != NULL && head < k1 * group; head++) {
        k->axpy(outputs + head * d + f0, weights[head * keys_per_head + cache->len],
                candidates + head / group * d + f0, w);
    }
}

void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores)
{
    scores_blocks(cache, cache->binding.heads, cache->len + 1, queries, candidates, lane, 0,
                  blocks_of(cache), scale, scores);
}

void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs)
{
    values_range(cache, cache->binding.heads, weights, candidates, lane, 0, cache->heads, 0,
                 cache->head_width, outputs);
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

/* Scores chunks per lane: at least one (the candidate's, when len is 0). */
static size_t lane_chunks(const kvp_cache *cache)
{
    size_t blocks = blocks_of(cache);
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
    return job->heads != 0 ? job->heads : job->cache->binding.heads;
}

/* Scores per (lane, query head) row: the retained positions, and the candidate if any. */
static size_t job_keys(const kvpi_gather_job *job)
{
    return job->cache->len + (job->keys != NULL);
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
    return cache->batch_size * lane_chunks(cache);
}

size_t kvpi_gather_softmax_parts(const kvp_cache *cache)
{
    return softmax_parts(cache->batch_size * cache->binding.heads, cache->len + 1);
}

size_t kvpi_gather_value_parts(const kvp_cache *cache)
{
    value_layout v = value_layout_of(cache);
    return cache->batch_size * v.ranges * v.slices;
}

/* par, unless the cache holds too few bytes of keys for a hand-off to pay. */
static const kvpi_parallel *worth(const kvp_cache *cache, const kvpi_parallel *par)
{
    size_t bytes = cache->batch_size * cache->len * cache->heads * cache->head_width *
                   cache->pool->element_bytes;
    return bytes >= grain.min_parallel_bytes ? par : NULL;
}

static void score_part(void *ctx, size_t part)
{
    const kvpi_gather_job *job = ctx;
    const kvp_cache *cache = job->cache;
    size_t chunks = lane_chunks(cache);
    size_t lane = part / chunks;
    size_t chunk = part % chunks;
    size_t per = chunk_blocks(cache);
    size_t blocks = blocks_of(cache);
    size_t b0 = chunk * per;
    size_t b1 = b0 + per < blocks ? b0 + per : blocks;
    size_t heads = job_heads(job);
    size_t kv_width = cache->heads * cache->head_width;
    const double *candidates =
        job->keys != NULL && chunk + 1 == chunks ? job->keys + lane * kv_width : NULL;
    size_t keys = job_keys(job);
    scores_blocks(cache, heads, keys, job->queries + lane * heads * cache->head_width, candidates,
                  lane, b0, b1, job->scale, job->weights + lane * heads * keys);
}

static void softmax_part(void *ctx, size_t part)
{
    const kvpi_gather_job *job = ctx;
    size_t rows = job->cache->batch_size * job_heads(job);
    size_t keys = job_keys(job);
    size_t per = grain.softmax_elements / keys > 0 ? grain.softmax_elements / keys : 1;
    size_t end = (part + 1) * per < rows ? (part + 1) * per : rows;
    for (size_t row = part * per; row < end; row++) {
        kvpi_softmax(job->weights + row * keys, keys);
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
    values_range(cache, heads, job->weights + lane * heads * job_keys(job),
                 job->values != NULL ? job->values + lane * kv_width : NULL, lane,
                 range * cache->heads / v.ranges, (range + 1) * cache->heads / v.ranges,
                 part % v.slices * width, width, job->outputs + lane * heads * cache->head_width);
}

/* The values of a whole lane in one stream: the phase on one thread. */
static void value_lane(void *ctx, size_t lane)
{
    const kvpi_gather_job *job = ctx;
    const kvp_cache *cache = job->cache;
    size_t heads = job_heads(job);
    values_range(cache, heads, job->weights + lane * heads * job_keys(job),
                 job->values != NULL ? job->values + lane * cache->heads * cache->head_width
                                     : NULL,
                 lane, 0, cache->heads, 0, cache->head_width,
                 job->outputs + lane * heads * cache->head_width);
}

void kvpi_gather_scores_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    kvpi_parallel_run(worth(job->cache, par), score_part, (void *)job,
                      kvpi_gather_score_parts(job->cache));
}

void kvpi_gather_softmax_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    kvpi_parallel_run(worth(job->cache, par), softmax_part, (void *)job,
                      softmax_parts(job->cache->batch_size * job_heads(job), job_keys(job)));
}

void kvpi_gather_values_on(const kvpi_gather_job *job, const kvpi_parallel *par)
{
    par = worth(job->cache, par);
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
