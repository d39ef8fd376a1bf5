/*
 * share_window.c: the prefix hit rule for groups of caches with sliding
 * windows and sinks (DESIGN.md "Sharing", "Prefix hits with windows";
 * issue 21, part 3).
 *
 * Owns: which blocks a cache of a group needs at a prefix length, and the
 * longest prefix the prefix index can give a whole group (a hybrid model's
 * layers): every full cache (window 0) needs every block, left to right; a
 * sliding cache needs its sink blocks and the blocks covering the last W
 * positions of the prefix, [L - W, L) (the blocks a cache of length L keeps,
 * cache_window.c), found right to left within the length the full caches
 * allow; the group's hit is the longest length every cache accepts.
 *
 * Invariants:
 *   - kvpi_group_needs(c, first, h, j) is 1 exactly for the blocks a cache
 *     of length (first + h) * bt holds after its front truncation: the sink
 *     blocks and the blocks from kvpi_cache_live_from on (every block for a
 *     full cache, and for one whose releases are held); an adoption maps
 *     exactly those, so an adopted cache is indistinguishable from one that
 *     computed its rows (the audit's I4 with null entries holds);
 *   - kvpi_group_hits_locked looks pages up only (changes nothing, counters
 *     included) and returns the largest h <= n for which every needed block
 *     of every cache has every lane's key in the index.
 *
 * Callers: share.c (adopt and probe, under the pool lock).
 */
#include "pager/cache_internal.h"

/*
 * A cache that releases: a window, and no hold (a held cache keeps every
 * block until it resumes, so it adopts as a full one would).
 */
static int sliding(const kvp_cache *cache)
{
    return cache->window != 0 && !cache->release_hold;
}

/* 1 when cache `c` (of a group at block `first`) needs block first + j at length first + h. */
int kvpi_group_needs(const kvp_cache *cache, size_t first, size_t hits, size_t j)
{
    if (!sliding(cache)) {
        return 1;
    }
    size_t block = first + j;
    if (block < kvpi_cache_sink_blocks(cache)) {
        return 1;
    }
    return block >= kvpi_cache_live_from(cache, (first + hits) * cache->block_tokens);
}

/* 1 when every lane's key of block j of cache c is in the index; *idle += its unheld pages. */
static int block_hit(const kvp_pool *pool, const kvp_block_key *keys, size_t count, size_t batch,
                     size_t c, size_t j, size_t *idle)
{
    size_t unheld = 0;
    for (size_t lane = 0; lane < batch; lane++) {
        uint32_t page = kvpi_prefix_lookup_locked(pool, &keys[(j * count + c) * batch + lane]);
        if (page == KVPI_NO_PAGE) {
            return 0;
        }
        unheld += pool->refcount[page] == 0;
    }
    if (idle != NULL) {
        *idle += unheld;
    }
    return 1;
}

/* The leading blocks (at most n) every full cache of the group hits. */
static size_t full_hits(const kvp_pool *pool, const kvp_cache *const *caches, size_t count,
                        const kvp_block_key *keys, size_t n)
{
    size_t batch = caches[0]->batch_size;
    for (size_t j = 0; j < n; j++) {
        for (size_t c = 0; c < count; c++) {
            if (!sliding(caches[c]) && !block_hit(pool, keys, count, batch, c, j, NULL)) {
                return j;
            }
        }
    }
    return n;
}

/*
 * The longest h <= n for which sliding cache c hits its needed blocks: the
 * sinks left to right (a missing sink block ends every longer prefix), then
 * the window right to left: a miss at block m means no prefix whose window
 * holds m, so the next candidate ends just before m. Each block is looked
 * at most once per call.
 */
static size_t sliding_hits(const kvp_pool *pool, const kvp_cache *const *caches, size_t count,
                           const kvp_block_key *keys, size_t c, size_t n)
{
    const kvp_cache *cache = caches[c];
    size_t batch = cache->batch_size;
    size_t first = cache->len / cache->block_tokens;
    size_t sb = kvpi_cache_sink_blocks(cache);
    for (size_t j = 0; j < n && first + j < sb; j++) {
        if (!block_hit(pool, keys, count, batch, c, j, NULL)) {
            n = j;
            break;
        }
    }
    size_t h = n;
    while (h > 0) {
        size_t lo = kvpi_cache_live_from(cache, (first + h) * cache->block_tokens);
        lo = lo > sb ? lo : sb;
        size_t start = lo > first ? lo - first : 0; /* relative; sinks were checked above */
        start = start < h ? start : h;                /* sinks only: nothing more to find */
        size_t j = h;
        while (j > start && block_hit(pool, keys, count, batch, c, j - 1, NULL)) {
            j--;
        }
        if (j == start) {
            return h;
        }
        h = j - 1; /* block j - 1 missed: the prefix ends before it */
    }
    return 0;
}

size_t kvpi_group_hits_locked(const kvp_cache *const *caches, size_t count,
                              const kvp_block_key *keys, size_t n, size_t *evictable)
{
    const kvp_pool *pool = caches[0]->pool;
    size_t hits = full_hits(pool, caches, count, keys, n);
    /* Each sliding cache may shorten the prefix, which moves the others' windows: to a fixpoint. */
    for (int changed = 1; changed && hits > 0;) {
        changed = 0;
        for (size_t c = 0; c < count && hits > 0; c++) {
            if (!sliding(caches[c])) {
                continue;
            }
            size_t h = sliding_hits(pool, caches, count, keys, c, hits);
            if (h < hits) {
                hits = h;
                changed = 1;
            }
        }
    }
    if (evictable == NULL) {
        return hits; /* adopt: no second pass */
    }
    size_t idle = 0;
    size_t first = caches[0]->len / caches[0]->block_tokens;
    for (size_t j = 0; j < hits; j++) {
        for (size_t c = 0; c < count; c++) {
            if (kvpi_group_needs(caches[c], first, hits, j)) {
                (void)block_hit(pool, keys, count, caches[0]->batch_size, c, j, &idle);
            }
        }
    }
    *evictable = idle;
    return hits;
}
