/*
 * cache_cow.c: a cache's copy-on-write, the part of sharing the append path
 * needs (cache_internal.h, "Sharing"; DESIGN.md I5).
 *
 * Owns: copying a page's leading rows, recomputing a cache's cow mark, the
 * deferred copy-on-write of a transaction (defer, settle, undo) and the
 * audit's check of a shared partial page's one writer.
 * Invariants: as share.c states them: a cache writes its partial last page
 * in place only when cow == 0, and cow == 1 whenever that page is
 * registered, or shared unless the cache is the page's one writer.
 * Everything here except copy_rows and defer runs under the pool lock.
 * Callers: cache.c (append, audit), external.c, share.c (fork, truncate) and
 * src/serve (a sequence's prefill defers, settles or undoes its copies).
 * Calls nothing in cache.c or share.c, so neither imports the other.
 */
#include "pager/cache_internal.h"

#include <stddef.h>
#include <string.h>

/* ---- copy-on-write ------------------------------------------------------ */

void kvpi_cache_copy_rows(const kvp_cache *cache, uint32_t to, uint32_t from, size_t rows)
{
    if (!kvpi_pool_has_data(cache->pool)) {
        return; /* a reserved pool's pages hold no rows to copy */
    }
    size_t row_bytes = cache->head_width * cache->pool->element_bytes;
    size_t slab_bytes = cache->block_tokens * row_bytes; /* one head's keys or values */
    unsigned char *dst = kvpi_pool_page(cache->pool, to);
    const unsigned char *src = kvpi_pool_page(cache->pool, from);
    for (size_t s = 0; s < 2 * cache->heads; s++) {
        memcpy(dst + s * slab_bytes, src + s * slab_bytes, rows * row_bytes);
    }
}

void kvpi_cache_cow_refresh_locked(kvp_cache *cache)
{
    cache->cow = 0;
    if (cache->len % cache->block_tokens == 0) {
        return;
    }
    size_t block = cache->len / cache->block_tokens;
    const kvp_pool *pool = cache->pool;
    for (size_t lane = 0; lane < cache->batch_size; lane++) {
        uint32_t page = kvpi_cache_lane_table(cache, lane)[block];
        if (pool->refcount[page] > 1 || pool->registered[page]) {
            cache->cow = 1;
        }
    }
}

void kvpi_cache_cow_defer_many(kvp_cache *const *caches, size_t count)
{
    for (size_t c = 0; c < count; c++) {
        caches[c]->cow_defer = 1;
    }
}

size_t kvpi_cache_cow_settle_many_locked(kvp_cache *const *caches, size_t count)
{
    size_t released = 0;
    for (size_t c = 0; c < count; c++) {
        kvp_cache *cache = caches[c];
        for (size_t lane = 0; lane < cache->batch_size; lane++) {
            if (cache->cow_saved[lane] != KVPI_NO_PAGE) {
                kvpi_pool_put_locked(cache->pool, cache->cow_saved[lane]);
                cache->cow_saved[lane] = KVPI_NO_PAGE;
            }
        }
        cache->cow_defer = 0;
        /* What the transaction's rows left behind. */
        released += kvpi_cache_release_front_locked(cache);
    }
    return released;
}

void kvpi_cache_cow_undo_many_locked(kvp_cache *const *caches, size_t count)
{
    for (size_t c = count; c-- > 0;) {
        kvp_cache *cache = caches[c];
        size_t block = cache->len / cache->block_tokens;
        for (size_t lane = cache->batch_size; lane-- > 0;) {
            if (cache->cow_saved[lane] == KVPI_NO_PAGE) {
                continue;
            }
            uint32_t *slot = &cache->tables[lane * cache->blocks_per_lane + block];
            kvpi_pool_put_locked(cache->pool, *slot);
            *slot = cache->cow_saved[lane];
            cache->cow_saved[lane] = KVPI_NO_PAGE;
            cache->pool->cow_copies--;
            cache->cow = 1;
        }
        cache->cow_defer = 0;
    }
}

/*
 * I5 for `writer`, unmarked, whose partial page `page` (block `block`) is
 * shared: every other cache naming it there is marked and no longer, so it
 * reads only positions below the writer's length and copies before writing.
 */
void kvpi_cache_audit_writer(const kvp_cache *writer, size_t block, uint32_t page,
                             kvpi_audit *audit)
{
    const kvpi_holder *end = &writer->pool->holders;
    for (const kvpi_holder *h = end->next; h != end; h = h->next) {
        const kvp_cache *other =
            h->ops->kind == KVPI_HOLDER_CACHE
                ? (const kvp_cache *)(const void *)((const char *)h - offsetof(kvp_cache, holder))
                : writer;
        for (size_t lane = 0; other != writer && block < other->blocks_per_lane &&
                              lane < other->batch_size;
             lane++) {
            if (kvpi_cache_lane_table(other, lane)[block] == page &&
                (!other->cow || other->len > writer->len)) {
                kvpi_audit_report(audit, KVP_INVARIANT_PREFIX,
                                  "a shared partial page has one writer, its longest holder",
                                  page, lane, 1, 0);
            }
        }
    }
}
