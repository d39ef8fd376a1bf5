/*
 * gather.c: attention's reads of retained rows through a cache's page table.
 *
 * Owns: the two loops that touch pages. Each walks one lane's page table
 * block by block; inside a page, one head's rows are contiguous
 * [block_tokens][d_h], so the inner loops run over contiguous memory with one
 * table lookup per block, never one per element. Positions are visited in
 * order 0 .. len-1 and then the candidate, the order the full-prefix
 * reference uses, so the sums agree bit for bit.
 * Callers: incremental.c, and bench/ (to time the real loops).
 */
#include "attention/gather.h"

#include <string.h>

#include "attention/kernels.h"

/* scores[0..len] of (lane, head): retained keys page by page, then the candidate. */
void kvpi_gather_scores(const kvp_cache *cache, const double *query, const double *candidate,
                        size_t lane, size_t head, double scale, double *scores)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    size_t position = 0;
    for (size_t block = 0; position < cache->len; block++) {
        const double *keys = kvpi_cache_page_keys(cache, table[block], head);
        size_t rows = cache->len - position < bt ? cache->len - position : bt;
        for (size_t row = 0; row < rows; row++) {
            scores[position + row] = kvpi_dot(query, keys + row * d, d) * scale;
        }
        position += rows;
    }
    scores[cache->len] = kvpi_dot(query, candidate, d) * scale;
}

/* out[0..d_h) of (lane, head): weights times retained values page by page, then the candidate. */
void kvpi_gather_values(const kvp_cache *cache, const double *weights, const double *candidate,
                        size_t lane, size_t head, double *out)
{
    size_t d = cache->head_width;
    size_t bt = cache->block_tokens;
    const uint32_t *table = kvpi_cache_lane_table(cache, lane);
    memset(out, 0, d * sizeof *out);
    size_t position = 0;
    for (size_t block = 0; position < cache->len; block++) {
        const double *values = kvpi_cache_page_values(cache, table[block], head);
        size_t rows = cache->len - position < bt ? cache->len - position : bt;
        for (size_t row = 0; row < rows; row++) {
            kvpi_axpy(out, weights[position + row], values + row * d, d);
        }
        position += rows;
    }
    kvpi_axpy(out, weights[cache->len], candidate, d);
}

