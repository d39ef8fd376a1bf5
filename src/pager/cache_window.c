/*
 * cache_window.c: front truncation of a windowed cache (DESIGN.md "Sliding
 * windows and sinks", "Front truncation").
 *
 * Owns: the binding window reader (the process-wide function attention
 * registers so the pager learns a layer-bound cache's W and S without
 * reading the owner's record), the release of blocks no window needs any
 * more, the hold that lets an owner publish blocks before they are
 * released, the truncate check against released blocks and the page bound
 * a windowed cache can hold (kvp_cache_pages_held_max).
 *
 * Invariants:
 *   - a released block is KVPI_NO_PAGE in every lane, lies past the sink
 *     blocks and entirely below len - W; the partial last block is never
 *     released (W >= 1), so copy-on-write never meets a null entry;
 *   - after every call, a lane holds at most ceil(S / bt) + ceil(W / bt) + 1
 *     pages (the sinks, and the blocks covering [len - W, len)).
 *
 * Callers: src/pager (commit, settle, adopt, fork, truncate), attention
 * (the reader's registration).
 * Global state: `window_reader`, set once, atomic.
 */
#include <stdatomic.h>

#include "pager/cache_internal.h"
#include "pager/error.h"

static _Atomic(kvpi_binding_window_fn) window_reader;

void kvpi_pager_set_window_reader(kvpi_binding_window_fn fn)
{
    atomic_store(&window_reader, fn);
}

/* W and S for a new cache of `binding`: the owner's reading, 0 and 0 without one. */
void kvpi_cache_window_init(kvp_cache *cache, const kvp_binding *binding)
{
    cache->window = 0;
    cache->sinks = 0;
    cache->released_end = 0;
    cache->release_hold = 0;
    kvpi_binding_window_fn fn = atomic_load(&window_reader);
    if (fn != NULL && binding->kind != KVP_BINDING_EXTERNAL) {
        size_t w = 0, s = 0;
        fn(binding, &w, &s);
        cache->window = w;
        cache->sinks = w != 0 ? s : 0;
    }
}

size_t kvpi_cache_release_front_locked(kvp_cache *cache)
{
    if (cache->window == 0 || cache->cow_defer || cache->release_hold) {
        return 0;
    }
    size_t sb = kvpi_cache_sink_blocks(cache);
    size_t end = kvpi_cache_live_from(cache, cache->len);
    size_t from = cache->released_end > sb ? cache->released_end : sb;
    for (size_t block = from; block < end; block++) {
        for (size_t lane = 0; lane < cache->batch_size; lane++) {
            uint32_t *slot = &cache->tables[lane * cache->blocks_per_lane + block];
            if (*slot == KVPI_NO_PAGE) {
                continue; /* an adoption left it unmapped: the window never needed it */
            }
            kvpi_pool_put_locked(cache->pool, *slot);
            *slot = KVPI_NO_PAGE;
        }
    }
    if (end <= from) {
        return 0;
    }
    cache->released_end = end;
    cache->pool->window_releases += (end - from) * cache->batch_size;
    return (end - from) * cache->batch_size;
}

/* 1 when a cache of the group has a window (fixed at creation: read without the lock). */
static int any_window(kvp_cache *const *caches, size_t count)
{
    for (size_t c = 0; c < count; c++) {
        if (caches[c]->window != 0) {
            return 1;
        }
    }
    return 0;
}

void kvpi_cache_hold_release_many(kvp_cache *const *caches, size_t count)
{
    if (!any_window(caches, count)) {
        return; /* nothing to hold: no lock taken (allocator-only leases) */
    }
    kvpi_pool_lock(caches[0]->pool);
    for (size_t c = 0; c < count; c++) {
        caches[c]->release_hold = 1;
    }
    kvpi_pool_unlock(caches[0]->pool);
}

size_t kvpi_cache_resume_release_many(kvp_cache *const *caches, size_t count)
{
    size_t released = 0;
    if (!any_window(caches, count)) {
        return 0; /* never held */
    }
    kvpi_pool_lock(caches[0]->pool);
    for (size_t c = 0; c < count; c++) {
        caches[c]->release_hold = 0;
        released += kvpi_cache_release_front_locked(caches[c]);
    }
    kvpi_pool_unlock(caches[0]->pool);
    return released;
}

kvp_status kvpi_cache_truncate_check(const kvp_cache *cache, size_t len, kvp_error *err)
{
    size_t bt = cache->block_tokens;
    size_t sb = kvpi_cache_sink_blocks(cache);
    if (cache->released_end <= sb || len == 0) {
        return KVP_OK;
    }
    /* Released positions [sb * bt, released_end * bt); the window at len needs [len - W, len). */
    size_t need_lo = len > cache->window ? len - cache->window : 0;
    if (sb * bt < len && cache->released_end * bt > need_lo) {
        size_t first = need_lo > sb * bt ? need_lo : sb * bt;
        kvp_error e = kvpi_error_begin(KVP_BLOCK_RELEASED);
        e.position = first;
        e.index = first / bt;
        e.tokens = len;
        e.what = "new_len";
        return kvpi_error_emit(err, &e);
    }
    return KVP_OK;
}

/* Distinct blocks covering [0, min(S, n)) and [a, n). */
static size_t blocks_held(size_t sinks, size_t a, size_t n, size_t bt)
{
    size_t s = sinks < n ? sinks : n;
    size_t sb = (s + bt - 1) / bt;
    size_t hi = (n + bt - 1) / bt;
    size_t lo = a / bt;
    if (lo < sb) {
        lo = sb;
    }
    return sb + (hi > lo ? hi - lo : 0);
}

size_t kvpi_window_pages_held_max(size_t window, size_t sinks, size_t bt, size_t len)
{
    size_t all = len / bt + (len % bt != 0);
    if (window == 0) {
        return all;
    }
    /*
     * During the commit to length n a lane holds the blocks of [n - 1 - W, n)
     * and the sinks (the new block taken before the old one goes). The count
     * is periodic in n with period bt once n > S + W + bt, so the largest
     * over n <= len is among n <= min(len, S + W + 2 bt).
     */
    size_t top = sinks + window + 2 * bt;
    if (top > len) {
        top = len;
    }
    size_t most = 0;
    for (size_t n = 1; n <= top; n++) {
        size_t a = n > window + 1 ? n - 1 - window : 0;
        size_t held = blocks_held(sinks, a, n, bt);
        most = held > most ? held : most;
    }
    return most < all ? most : all;
}

size_t kvp_cache_pages_held_max(const kvp_cache *cache, size_t len)
{
    if (cache == NULL) {
        return 0;
    }
    return cache->batch_size *
           kvpi_window_pages_held_max(cache->window, cache->sinks, cache->block_tokens, len);
}
