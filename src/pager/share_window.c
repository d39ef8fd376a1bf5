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
 * allow; the group's hit is the longest length every cache accepts. One
 * implementation serves adoption and admission: the rule runs over a group
 * described by its layers' windows and keys (kvpi_hit_group: from caches, or
 * from the model's windows when no cache exists yet, kvpi_prefix_probe),
 * with "layer c holds block j" = every lane's key is in the index.
 *
 * Invariants:
 *   - kvpi_group_needs(c, first, h, j) is 1 exactly for the blocks a cache
 *     of length (first + h) * bt holds after its front truncation: the sink
 *     blocks and the blocks from kvpi_cache_live_from on (every block for a
 *     full cache, and for one whose releases are held); an adoption maps
 *     exactly those, so an adopted cache is indistinguishable from one that
 *     computed its rows (the audit's I4 with null entries holds);
 *   - kvpi_hit_group_run (and kvpi_group_hits_locked over caches) looks
 *     pages up only (changes nothing, counters included) and returns the
 *     largest h <= n for which every needed block of every layer has every
 *     lane's key in the index; its evictable count is of exactly the pages
 *     an adoption of those h blocks maps, so admission's probe (an empty
 *     group with the model's windows) finds what adoption of a fresh lease
 *     finds over the same index.
 *
 * Callers: share.c (adopt, kvp_cache_group_probe and kvpi_prefix_probe,
 * under the pool lock).
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

/* Layer c's window as the rule reads it (0: it needs every block) and its sink blocks. */
static size_t layer_window(const kvpi_hit_group *g, size_t c, size_t *sink_blocks)
{
    size_t window = 0;
    size_t sinks = 0;
    if (g->caches != NULL) {
        window = sliding(g->caches[c]) ? g->caches[c]->window : 0;
        sinks = g->caches[c]->sinks;
    } else if (g->windows != NULL) {
        window = g->windows[2 * c];
        sinks = g->windows[2 * c + 1];
    }
    *sink_blocks = window == 0 ? 0 : kvpi_window_sink_blocks(sinks, g->block_tokens);
    return window;
}

int kvpi_hit_group_needs(const kvpi_hit_group *g, size_t c, size_t hits, size_t j)
{
    size_t sb;
    size_t window = layer_window(g, c, &sb);
    size_t block = g->first + j;
    if (window == 0 || block < sb) {
        return 1;
    }
    return block >= kvpi_window_live_from(window, g->block_tokens,
                                          (g->first + hits) * g->block_tokens);
}

int kvpi_group_needs(const kvp_cache *cache, size_t first, size_t hits, size_t j)
{
    kvpi_hit_group g = {cache->pool, NULL, 1, cache->batch_size, cache->block_tokens, first,
                        &cache, NULL};
    return kvpi_hit_group_needs(&g, 0, hits, j);
}

/* The predicate: 1 when every lane's key of block j of layer c is in the index; *idle += its unheld pages. */
static int block_hit(const kvpi_hit_group *g, size_t c, size_t j, size_t *idle)
{
    size_t unheld = 0;
    for (size_t lane = 0; lane < g->batch; lane++) {
        uint32_t page =
            kvpi_prefix_lookup_locked(g->pool, &g->keys[(j * g->count + c) * g->batch + lane]);
        if (page == KVPI_NO_PAGE) {
            return 0;
        }
        unheld += g->pool->refcount[page] == 0;
    }
    if (idle != NULL) {
        *idle += unheld;
    }
    return 1;
}

/* The leading blocks (at most n) every full layer of the group hits. */
static size_t full_hits(const kvpi_hit_group *g, size_t n)
{
    for (size_t j = 0; j < n; j++) {
        for (size_t c = 0; c < g->count; c++) {
            size_t sb;
            if (layer_window(g, c, &sb) == 0 && !block_hit(g, c, j, NULL)) {
                return j;
            }
        }
    }
    return n;
}

/*
 * The longest h <= n for which sliding layer c hits its needed blocks: the
 * sinks left to right (a missing sink block ends every longer prefix), then
 * the window right to left: a miss at block m means no prefix whose window
 * holds m, so the next candidate ends just before m. Each block is looked
 * at most once per call.
 */
static size_t sliding_hits(const kvpi_hit_group *g, size_t c, size_t window, size_t sb, size_t n)
{
    size_t first = g->first;
    size_t bt = g->block_tokens;
    for (size_t j = 0; j < n && first + j < sb; j++) {
        if (!block_hit(g, c, j, NULL)) {
            n = j;
            break;
        }
    }
    size_t h = n;
    while (h > 0) {
        size_t lo = kvpi_window_live_from(window, bt, (first + h) * bt);
        lo = lo > sb ? lo : sb;
        size_t start = lo > first ? lo - first : 0; /* relative; sinks were checked above */
        start = start < h ? start : h;                /* sinks only: nothing more to find */
        size_t j = h;
        while (j > start && block_hit(g, c, j - 1, NULL)) {
            j--;
        }
        if (j == start) {
            return h;
        }
        h = j - 1; /* block j - 1 missed: the prefix ends before it */
    }
    return 0;
}

size_t kvpi_hit_group_run(const kvpi_hit_group *g, size_t n, size_t *evictable)
{
    size_t hits = full_hits(g, n);
    /* Each sliding layer may shorten the prefix, which moves the others' windows: to a fixpoint. */
    for (int changed = 1; changed && hits > 0;) {
        changed = 0;
        for (size_t c = 0; c < g->count && hits > 0; c++) {
            size_t sb;
            size_t window = layer_window(g, c, &sb);
            size_t h = window == 0 ? hits : sliding_hits(g, c, window, sb, hits);
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
    for (size_t j = 0; j < hits; j++) {
        for (size_t c = 0; c < g->count; c++) {
            if (kvpi_hit_group_needs(g, c, hits, j)) {
                (void)block_hit(g, c, j, &idle);
            }
        }
    }
    *evictable = idle;
    return hits;
}

size_t kvpi_group_hits_locked(const kvp_cache *const *caches, size_t count,
                              const kvp_block_key *keys, size_t n, size_t *evictable)
{
    const kvp_cache *a = caches[0];
    kvpi_hit_group g = {a->pool, keys, count, a->batch_size, a->block_tokens,
                        a->len / a->block_tokens, caches, NULL};
    return kvpi_hit_group_run(&g, n, evictable);
}
