/*
 * cache_internal.h: the layer cache as attention and steps see it.
 *
 * Owns: struct kvp_cache, the private append path (validate, reserve,
 * commit) and the page-walking accessors the attention gather uses.
 *
 * Invariants:
 *   - 0 <= len <= capacity <= binding.rope_max_positions;
 *   - for every lane, tables[lane][0..ceil(len/block_tokens)) name held
 *     pages and the rest are KVPI_NO_PAGE (I4);
 *   - heads == binding.kv_heads == the pool's heads: a cache stores KV heads
 *     only; the query heads (binding.heads) never reach a page;
 *   - position p of lane b, KV head h lives in page tables[b][p / block_tokens]
 *     at slot p % block_tokens: keys at page + (h*block_tokens + slot)*d_h,
 *     values at page + ((H + h)*block_tokens + slot)*d_h, in elements of the
 *     pool's dtype (kvpager/pool.h), rounded from f64 once, at commit;
 *   - epoch advances on every commit and reset, so a ticket can tell that
 *     the cache changed since it was prepared;
 *   - len and tables change only under the pool lock (pool_internal.h);
 *   - an external cache (binding.rope_feature_width == 0) takes rows from
 *     its owner (kvp_cache_append_rows, reserve/commit/discard) and never
 *     from attention; a layer-bound cache the other way round.
 *
 * Callers: src/pager, src/attention and src/serve. Not part of the public API: the raw
 * append stays private, as in the seed.
 */
#ifndef KVPAGER_PAGER_CACHE_INTERNAL_H
#define KVPAGER_PAGER_CACHE_INTERNAL_H

#include "kvpager/cache.h"
#include "kvpager/types.h"
#include "pager/pool_internal.h"
#include "pager/reservation.h"

struct kvp_cache {
    kvpi_holder holder;
    kvp_pool *pool;
    kvp_binding binding;
    size_t batch_size;
    size_t capacity;
    size_t len;
    size_t heads;            /* stored heads: binding.kv_heads (the pool's heads) */
    size_t head_width;
    size_t block_tokens;
    size_t blocks_per_lane;
    uint32_t *tables;        /* [batch_size][blocks_per_lane] */
    uint32_t *spare_entries; /* [batch_size], storage of spare_reservation */
    kvpi_reservation spare_reservation; /* used by the private append only */
    uint64_t serial;         /* unique in the process, never reused */
    uint64_t epoch;
    /*
     * External caches only (kvp_binding_is_external): the pending row
     * reservation of kvp_cache_reserve_rows. row_entries has batch_size *
     * blocks_per_lane slots (in the tables allocation). While reserved_rows
     * > 0, row_reservation holds exactly kvp_cache_pages_for(len +
     * reserved_rows) tentative pages, block by block, lane by lane, of which
     * promise_drawn came from `promise`. All four change under the pool lock.
     */
    uint32_t *row_entries;
    kvpi_reservation row_reservation;
    size_t reserved_rows;
    size_t promise_drawn;
    size_t promise;          /* this cache's share of pool->promised */
};

/* Blocks a lane maps at the current length. */
static inline size_t kvpi_cache_mapped_blocks(const kvp_cache *cache)
{
    return cache->len / cache->block_tokens + (cache->len % cache->block_tokens != 0);
}

static inline const uint32_t *kvpi_cache_lane_table(const kvp_cache *cache, size_t lane)
{
    return cache->tables + lane * cache->blocks_per_lane;
}

/* The pool's storage type: every page of this cache holds elements of it. */
static inline kvp_dtype kvpi_cache_dtype(const kvp_cache *cache)
{
    return cache->pool->dtype;
}

/*
 * The block_tokens key rows of `head` in `page`, contiguous, [block_tokens][d_h]
 * elements of kvpi_cache_dtype(cache).
 */
static inline const void *kvpi_cache_page_keys(const kvp_cache *cache, uint32_t page,
                                               size_t head)
{
    return (const unsigned char *)kvpi_pool_page(cache->pool, page) +
           head * cache->block_tokens * cache->head_width * cache->pool->element_bytes;
}

/* The block_tokens value rows of `head` in `page`, as kvpi_cache_page_keys. */
static inline const void *kvpi_cache_page_values(const kvp_cache *cache, uint32_t page,
                                                 size_t head)
{
    return (const unsigned char *)kvpi_pool_page(cache->pool, page) +
           (cache->heads + head) * cache->block_tokens * cache->head_width *
               cache->pool->element_bytes;
}

/*
 * The seed's validate_append, in the seed's order: key shape [B,H,1,d_h],
 * value shape, FULL, first key not finite as stored, first such value. "Not
 * finite as stored": non-finite in f64 (err.what NULL), or finite but
 * overflowing the pool's dtype (err.what "f32" or "bf16"; dtype.h).
 */
kvp_status kvpi_cache_validate_append(const kvp_cache *cache, const kvp_tensor *key,
                                      const kvp_tensor *value, kvp_error *err);

/*
 * Pages the next append needs: batch_size when it opens a new block, else 0.
 * Precondition: the cache is not full (every caller checked FULL first).
 */
size_t kvpi_cache_pages_needed(const kvp_cache *cache);

/*
 * Makes one validated row per lane visible: stores key and value ([B,H,1,d_h]
 * flat) into their page slots, rounded to the pool's dtype (dtype.h), maps
 * pages taken from `reservation` when the row opens a block, then len += 1
 * and epoch += 1.
 * Preconditions: kvpi_cache_validate_append succeeded for these rows, and
 * the reservation holds at least kvpi_cache_pages_needed pages.
 */
void kvpi_cache_commit(kvp_cache *cache, const double *key, const double *value,
                       kvpi_reservation *reservation);

/*
 * KVP_OK when no element of rows[0..n) overflows the cache's storage type;
 * otherwise `status` (NONFINITE_KEY or NONFINITE_VALUE) with what = the
 * type's name, the flat index and the f64 value of the first that does.
 * Non-finite elements are not its business. Always KVP_OK for f64.
 */
kvp_status kvpi_cache_check_storable(const kvp_cache *cache, const double *rows, size_t n,
                                     kvp_status status, kvp_error *err);

/*
 * Rolls `count` caches of one pool, all of the same length, back to `len`:
 * pages of blocks past ceil(len / block_tokens) go back to the pool in the
 * exact reverse of the order steps took them (block by block, last layer
 * first, last lane first), so a replay receives the same physical pages.
 * Each cache's epoch advances. Sequences use it to reset and to undo a failed
 * prefill.
 */
void kvpi_cache_truncate_many(kvp_cache *const *caches, size_t count, size_t len);
/* The same, with the pool lock already held; len must not exceed the caches' length. */
void kvpi_cache_truncate_many_locked(kvp_cache *const *caches, size_t count, size_t len);

/*
 * The private raw append: validate, reserve the lanes' pages (all or none),
 * commit. Any error leaves the cache and the pool as they were.
 */
kvp_status kvpi_cache_append(kvp_cache *cache, const kvp_tensor *key, const kvp_tensor *value,
                             kvp_error *err);

#endif /* KVPAGER_PAGER_CACHE_INTERNAL_H */
