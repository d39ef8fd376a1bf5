/*
 * gather.c: attention's reads of retained rows through a cache's page table.
 *
 * Owns: the two loops that touch pages. Each walks one lane's page table
 * block by block and, inside a block, every query head in turn: a page keeps
 * the keys of all stored (KV) heads, [H_kv][block_tokens][d_h], in one
 * contiguous run (and the values in the next), so each page is read as one
 * stream, with one table lookup per block, never one per element. Query head
 * h reads KV head h / (H / H_kv); the H / H_kv query heads of a group are
 * consecutive, so a KV head's rows are read once from memory and served to
 * its whole group from cache. For every query head, positions are
 * still visited in order 0 .. len-1 and then the candidate, the order the
 * full-prefix reference uses, and every dot product and axpy goes through
 * the dispatched kernels, whose results do not depend on how many rows of a
 * block are handed over at once (kernels.h), so the sums agree bit for bit
 * with the reference and across block sizes. A block's rows for one head go
 * to the multi-row kernels in one call, so several rows are in flight.
 * Pages hold the pool's dtype: the f32 and bf16 kernels widen the stored
 * rows exactly and then compute as the f64 ones (kernels.h), so the order
 * and the bits are those of the f64 kernels on the widened rows. The
 * candidate row is f64 already rounded to the dtype (incremental.c).
 * Callers: incremental.c, and bench/ (to time the real loops).
 */
#include "attention/gather.h"

#include <string.h>

#include "attention/kernels.h"

/* dot_rows over `rows` stored rows of the cache's dtype at `keys`. */
static void dot_stored_rows(const kvpi_kernels *k, kvp_dtype dtype, const double *q,
                            const void *keys, size_t rows, size_t d, double scale, double *out)
{
    switch (dtype) {
    case KVP_F32:
        k->dot_rows_f32(q, keys, d, rows, d, scale, out);
        return;
    case KVP_BF16:
        k->dot_rows_bf16(q, keys, d, rows, d, scale, out);
        return;
    default:
        k->dot_rows(q, keys, d, rows, d, scale, out);
        return;
    }
}

/* axpy_rows over `rows` stored rows of the cache's dtype at `values`. */
static void axpy_stored_rows(const kvpi_kernels *k, kvp_dtype dtype, double *acc,
                             const double *weights, const void *values, size_t rows, size_t d)
{
    switch (dtype) {
    case KVP_F32:
        k->axpy_rows_f32(acc, weights, values, d, rows, d);
        return;
    case KVP_BF16:
        k->axpy_rows_bf16(acc, weights, values, d, rows, d);
        return;
    default:
        k->axpy_rows(acc, weights, values, d, rows, d);
        return;
    }
}

void kvpi_gather_scores(const kvp_cache *cache, const double *queries, const double *candidates,
                        size_t lane, double scale, double *scores)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    size_t heads = cache->binding.heads;
    size_t group = heads / cache->heads;
    size_t keys_per_head = cache->len + 1;
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    const kvpi_kernels *k = kvpi_kernels_active();
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    size_t head_bytes = bt * d * cache->pool->element_bytes;
    for (size_t start = 0; start < cache->len; start += bt) {
        size_t rows = cache->len - start < bt ? cache->len - start : bt;
        const unsigned char *page_keys = kvpi_cache_page_keys(cache, table[start / bt], 0);
        for (size_t head = 0; head < heads; head++) {
            dot_stored_rows(k, dtype, queries + head * d, page_keys + (head / group) * head_bytes,
                            rows, d, scale, scores + head * keys_per_head + start);
        }
    }
    for (size_t head = 0; head < heads; head++) {
        scores[head * keys_per_head + cache->len] =
            k->dot(queries + head * d, candidates + (head / group) * d, d) * scale;
    }
}

void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidates,
                        size_t lane, double *outputs)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    size_t heads = cache->binding.heads;
    size_t group = heads / cache->heads;
    size_t keys_per_head = cache->len + 1;
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    const kvpi_kernels *k = kvpi_kernels_active();
    kvp_dtype dtype = kvpi_cache_dtype(cache);
    size_t head_bytes = bt * d * cache->pool->element_bytes;
    memset(outputs, 0, heads * d * sizeof *outputs);
    for (size_t start = 0; start < cache->len; start += bt) {
        size_t rows = cache->len - start < bt ? cache->len - start : bt;
        const unsigned char *page_values = kvpi_cache_page_values(cache, table[start / bt], 0);
        for (size_t head = 0; head < heads; head++) {
            axpy_stored_rows(k, dtype, outputs + head * d, weights + head * keys_per_head + start,
                             page_values + (head / group) * head_bytes, rows, d);
        }
    }
    for (size_t head = 0; head < heads; head++) {
        k->axpy(outputs + head * d, weights[head * keys_per_head + cache->len],
                candidates + (head / group) * d, d);
    }
}
