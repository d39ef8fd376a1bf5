/*
 * test_share_cache.c: pages shared between external caches
 * (src/pager/share.c, prefix.c): fork with copy-on-write at every boundary,
 * forks of forks and destroy orders, truncate, the prefix index with the
 * same and with different bindings, LRU eviction under pressure, truncating
 * into a published page, a publish under an already indexed key; the audit
 * of evictable pages (I1, I5), evictions that keep every key reachable,
 * adoption stopping at capacity, and POOL_EXHAUSTED during a copy and the
 * cache calls' errors changing nothing. Invariant: kvp_pool_check runs
 * after every operation (kvpt_assert_pool_ok). Sequences sharing pages are
 * test_share.c; what a hit may be trusted for (bindings, keys, salts,
 * groups) is test_share_keys.c; fixtures in share_support.h. Unit test
 * (ctest test_share_cache, memcheck.test_share_cache in release): uses
 * pager/pool_internal.h and pager/reservation.h.
 */
#include "share_support.h"

#include <stdlib.h>
#include <string.h>

#include "pager/pool_internal.h"
#include "pager/reservation.h"

/* ---- external caches: rows, keys (more in share_support.h) ------------------ */

/* The logical keys of `cache`, [B, H, len, d], into out. */
static size_t cache_keys(const kvp_cache *cache, double *out, size_t room)
{
    kvp_error err;
    kvpt_assert_ok(kvp_cache_keys(cache, out, room, &err), &err);
    return kvp_cache_len(cache);
}

/* A fork at len 0, mid-page, exactly on a page edge and past it; appends on each side. */
static void test_share_fork_copy_on_write(void **state)
{
    (void)state;
    enum { B = 2 };
    static const size_t lens[] = {0, 2, 4, 6};
    for (size_t k = 0; k < KVPT_COUNT_OF(lens); k++) {
        size_t len = lens[k];
        kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
        kvp_cache *parent = external_cache(pool, B, 1);
        if (len > 0) {
            append(parent, pool, B, len, 0.0);
        }
        size_t pages = B * KVPT_CEIL_DIV(len, BT);
        kvp_pool_stats before = kvpt_stats(pool);
        kvp_cache *child = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats after = kvpt_stats(pool);
        /* Nothing taken: the child names the parent's pages. */
        assert_int_equal(after.held_pages, before.held_pages);
        assert_int_equal(after.acquires, before.acquires);
        assert_int_equal(after.attached_caches, before.attached_caches + 1);
        assert_int_equal(kvp_cache_len(child), len);
        for (size_t lane = 0; lane < B; lane++) {
            for (size_t block = 0; block < KVPT_CEIL_DIV(len, BT); block++) {
                assert_int_equal(page_of(child, lane, block), page_of(parent, lane, block));
            }
        }
        /* The next append's pages: a copy per lane mid-page, a new block on an edge. */
        int mid = len % BT != 0;
        assert_int_equal(kvp_cache_pages_for(child, len + 1), B);
        assert_int_equal(kvp_cache_pages_for(parent, len + 1), B);
        double parent_keys[B * CAPACITY * HEAD_WIDTH];
        cache_keys(parent, parent_keys, KVPT_COUNT_OF(parent_keys));

        append(child, pool, B, 1, 0.5);
        kvp_pool_stats c1 = kvpt_stats(pool);
        assert_int_equal(c1.cow_copies, mid ? B : 0);
        assert_int_equal(c1.held_pages, pages + B);
        /* The parent's rows are untouched; the child's are the parent's plus its row. */
        double now[B * CAPACITY * HEAD_WIDTH];
        cache_keys(parent, now, KVPT_COUNT_OF(now));
        assert_memory_equal(now, parent_keys, B * len * HEAD_WIDTH * sizeof(double));
        double child_keys[B * CAPACITY * HEAD_WIDTH];
        cache_keys(child, child_keys, KVPT_COUNT_OF(child_keys));
        for (size_t b = 0; b < B; b++) {
            assert_memory_equal(child_keys + b * (len + 1) * HEAD_WIDTH,
                                parent_keys + b * len * HEAD_WIDTH, len * HEAD_WIDTH * sizeof(double));
            double expect = 1000.0 * (double)b + 10.0 * (double)len + 0.5;
            assert_true(child_keys[(b * (len + 1) + len) * HEAD_WIDTH] == expect);
        }
        if (mid) {
            assert_int_not_equal(page_of(child, 0, len / BT), page_of(parent, 0, len / BT));
        }
        /* The parent appends too: its own copy (or block); the child is untouched. */
        append(parent, pool, B, 1, 0.25);
        cache_keys(child, now, KVPT_COUNT_OF(now));
        assert_memory_equal(now, child_keys, B * (len + 1) * HEAD_WIDTH * sizeof(double));
        assert_true(kvpt_stats(pool).cow_copies == (mid ? 2 * B : 0));
        /* Full blocks stay shared. */
        for (size_t block = 0; block < len / BT; block++) {
            assert_int_equal(page_of(child, 1, block), page_of(parent, 1, block));
        }
        kvpt_destroy_cache(child, pool);
        kvpt_destroy_cache(parent, pool);
        assert_int_equal(held(pool), 0);
        destroy_pool(pool);
    }
}

/* P -> C1 -> C2, then every destroy order returns exactly the unshared pages. */
static void test_share_fork_chains_and_destroy_orders(void **state)
{
    (void)state;
    enum { B = 2 };
    static const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                     {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    for (size_t o = 0; o < 6; o++) {
        kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
        kvp_cache *c[3];
        c[0] = external_cache(pool, B, 1);
        append(c[0], pool, B, 6, 0.0);
        kvp_error err;
        kvpt_assert_ok(kvp_cache_fork(c[0], &c[1], &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_ok(kvp_cache_fork(c[1], &c[2], &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(held(pool), 2 * B);
        /* C2 writes: copies its partial pages; P and C1 still share theirs. */
        append(c[2], pool, B, 3, 0.5);
        assert_int_equal(held(pool), 2 * B + B + B); /* + copies + one new block */
        size_t expect_after[3];
        /* What each cache alone holds beyond the others: after C2 wrote, the
         * full block is shared by all three, the partial page by P and C1. */
        size_t live[3] = {1, 1, 1};
        for (size_t step = 0; step < 3; step++) {
            int victim = orders[o][step];
            kvpt_destroy_cache(c[victim], pool);
            live[victim] = 0;
            size_t pages = 0;
            if (live[0] || live[1] || live[2]) {
                pages += B; /* block 0 */
            }
            if (live[0] || live[1]) {
                pages += B; /* the partial page of P and C1 */
            }
            if (live[2]) {
                pages += 2 * B; /* C2's copy and its new block */
            }
            expect_after[step] = pages;
            assert_int_equal(held(pool), expect_after[step]);
        }
        kvp_pool_stats s = kvpt_stats(pool);
        assert_int_equal(s.free_pages, s.total_pages);
        assert_int_equal(s.acquires, s.releases);
        destroy_pool(pool);
    }
}

/* Truncate to the same length, past the end, mid-page, to 0; a shared page is copied later. */
static void test_share_truncate(void **state)
{
    (void)state;
    enum { B = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *cache = external_cache(pool, B, 1);
    append(cache, pool, B, 10, 0.0);
    kvp_error err;
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    kvpt_assert_ok(kvp_cache_truncate(cache, 10, &err), &err);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    assert_int_equal(kvp_cache_truncate(cache, 11, &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "new_len");
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    assert_int_equal(kvp_cache_truncate(NULL, 1, &err), KVP_NULL_ARGUMENT);
    kvpt_state_free(&before);

    /* Mid-page: block 2 goes back, blocks 0 and 1 stay (1 now partial). */
    kvpt_assert_ok(kvp_cache_truncate(cache, 5, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_len(cache), 5);
    assert_int_equal(held(pool), 2 * B);
    /* Unshared: the next append writes in place, no copy. */
    assert_int_equal(kvp_cache_pages_for(cache, 6), 0);
    append(cache, pool, B, 1, 0.75);
    assert_int_equal(kvpt_stats(pool).cow_copies, 0);

    /* Shared, then truncated into the shared page: the copy waits for the append. */
    kvp_cache *child = NULL;
    kvpt_assert_ok(kvp_cache_fork(cache, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_truncate(child, 4, &err), &err); /* on the edge: no partial page */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_pages_for(child, 5), B);
    kvpt_assert_ok(kvp_cache_truncate(cache, 3, &err), &err); /* into the shared block 0 */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(held(pool), B);
    assert_int_equal(kvpt_stats(pool).cow_copies, 0);
    assert_int_equal(kvp_cache_pages_for(cache, 4), B);
    double child_keys[B * CAPACITY * HEAD_WIDTH];
    cache_keys(child, child_keys, KVPT_COUNT_OF(child_keys));
    append(cache, pool, B, 1, 0.125);
    assert_int_equal(kvpt_stats(pool).cow_copies, B);
    double now[B * CAPACITY * HEAD_WIDTH];
    cache_keys(child, now, KVPT_COUNT_OF(now));
    assert_memory_equal(now, child_keys, B * 4 * HEAD_WIDTH * sizeof(double));

    /* To 0: every page of this cache back; the child keeps its own. */
    kvpt_assert_ok(kvp_cache_truncate(cache, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(held(pool), B);
    kvpt_destroy_cache(child, pool);
    kvpt_destroy_cache(cache, pool);
    assert_int_equal(held(pool), 0);
    destroy_pool(pool);
}

/* Hits with the same binding, none with another revision; errors change nothing. */
static void test_share_prefix_hits_and_bindings(void **state)
{
    (void)state;
    enum { B = 2, BLOCKS = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *a = external_cache(pool, B, 1);
    append(a, pool, B, 10, 0.0);
    kvp_block_key keys[(BLOCKS + 1) * B];
    chain_keys(a, B, BLOCKS + 1, 0.0, keys);
    kvp_error err;
    /* Block 2 is partial: not publishable. */
    assert_int_equal(kvp_cache_publish_block(a, 0, 2, &keys[2 * B], &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "block");
    assert_int_equal(kvp_cache_publish_block(a, B, 0, &keys[0], &err), KVP_OUT_OF_RANGE);
    publish_all(a, pool, B, BLOCKS, keys);
    assert_int_equal(kvpt_stats(pool).cached_pages, BLOCKS * B);
    /* Again under the same key: nothing changes; under another: refused. */
    publish_all(a, pool, B, BLOCKS, keys);
    assert_int_equal(kvp_cache_publish_block(a, 0, 0, &keys[B], &err), KVP_PAGE_PUBLISHED);
    assert_int_equal(err.index, page_of(a, 0, 0));
    assert_int_equal(kvpt_stats(pool).cached_pages, BLOCKS * B);

    /* Same binding: both blocks hit, same pages, len 8. */
    kvp_cache *b = external_cache(pool, B, 1);
    size_t adopted = 99;
    kvpt_assert_ok(kvp_cache_adopt_prefix(b, keys, BLOCKS + 1, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, BLOCKS);
    assert_int_equal(kvp_cache_len(b), BLOCKS * BT);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.prefix_hits, BLOCKS * B);
    assert_int_equal(s.prefix_misses, 1); /* block 2 was never published */
    for (size_t j = 0; j < BLOCKS; j++) {
        assert_int_equal(page_of(b, 1, j), page_of(a, 1, j));
    }
    double ka[B * CAPACITY * HEAD_WIDTH];
    double kb[B * CAPACITY * HEAD_WIDTH];
    kvp_cache *c8 = NULL;
    kvpt_assert_ok(kvp_cache_fork(a, &c8, &err), &err);
    kvpt_assert_ok(kvp_cache_truncate(c8, 8, &err), &err);
    cache_keys(c8, ka, KVPT_COUNT_OF(ka));
    cache_keys(b, kb, KVPT_COUNT_OF(kb));
    assert_memory_equal(ka, kb, B * 8 * HEAD_WIDTH * sizeof(double));
    kvpt_destroy_cache(c8, pool);
    /* Not at a block boundary: refused, nothing changed. */
    append(b, pool, B, 1, 0.0);
    kvpt_state before;
    kvpt_state_capture(b, pool, &before);
    assert_int_equal(kvp_cache_adopt_prefix(b, keys, 1, &adopted, &err),
                     KVP_NOT_AT_BLOCK_BOUNDARY);
    assert_int_equal(err.current_len, 9);
    kvpt_assert_state_unchanged(&before, b, pool, 0);
    kvpt_state_free(&before);

    /* A revision bump: another binding digest, so no key can match. */
    kvp_cache *c = external_cache(pool, B, 2);
    kvp_block_key other[(BLOCKS + 1) * B];
    chain_keys(c, B, BLOCKS + 1, 0.0, other);
    assert_true(other[0].lo != keys[0].lo || other[0].hi != keys[0].hi);
    kvpt_assert_ok(kvp_cache_adopt_prefix(c, other, BLOCKS, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 0);
    assert_int_equal(kvp_cache_len(c), 0);
    assert_int_equal(kvpt_stats(pool).prefix_misses, 2);
    /* Other inputs under the same binding: a miss too. */
    kvp_cache *d = external_cache(pool, B, 1);
    chain_keys(d, B, BLOCKS, 0.5, other);
    kvpt_assert_ok(kvp_cache_adopt_prefix(d, other, BLOCKS, &adopted, &err), &err);
    assert_int_equal(adopted, 0);
    kvpt_destroy_cache(d, pool);
    kvpt_destroy_cache(c, pool);
    kvpt_destroy_cache(b, pool);
    kvpt_destroy_cache(a, pool);
    /* The published pages outlive their caches: evictable, not free. */
    s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, 0);
    assert_int_equal(s.evictable_pages, BLOCKS * B);
    assert_int_equal(s.cached_pages, BLOCKS * B);
    assert_int_equal(s.free_pages + s.evictable_pages, s.total_pages);
    destroy_pool(pool);
}

/* Evictable pages count as available; a take evicts the least recently used. */
static void test_share_eviction_under_pressure(void **state)
{
    (void)state;
    enum { B = 1, PAGES = 4 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_cache *a = external_cache(pool, B, 1);
    append(a, pool, B, 3 * BT, 0.0);
    kvp_block_key keys[3];
    chain_keys(a, B, 3, 0.0, keys);
    publish_all(a, pool, B, 3, keys);
    uint32_t pages[3] = {page_of(a, 0, 0), page_of(a, 0, 1), page_of(a, 0, 2)};
    kvpt_destroy_cache(a, pool); /* block 2 goes first: it is the least recently used */
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.evictable_pages, 3);
    assert_int_equal(s.free_pages, 1);
    kvp_admission admission;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_admit(pool, PAGES, 0, &admission, &err), &err);
    assert_int_equal(admission, KVP_ADMIT_NOW);

    /* Two pages: the free one first, then the LRU page (block 2's). */
    kvp_cache *b = external_cache(pool, B, 9);
    append(b, pool, B, 2 * BT, 0.0);
    s = kvpt_stats(pool);
    assert_int_equal(s.evictions, 1);
    assert_int_equal(s.cached_pages, 2);
    assert_int_equal(s.evictable_pages, 2);
    assert_int_equal(page_of(b, 0, 1), pages[2]);

    /* Blocks 0 and 1 still hit; a cache adopting them holds them again. */
    kvp_cache *c = external_cache(pool, B, 1);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(c, keys, 3, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 2);
    assert_int_equal(page_of(c, 0, 0), pages[0]);
    assert_int_equal(page_of(c, 0, 1), pages[1]);
    s = kvpt_stats(pool);
    assert_int_equal(s.evictable_pages, 0);
    assert_int_equal(s.held_pages, PAGES);
    /* Full: the next page cannot be had, and nothing changes. */
    kvpt_state before;
    kvpt_state_capture(c, pool, &before);
    double k[BT * HEAD_WIDTH] = {0};
    assert_int_equal(kvp_cache_append_rows(c, k, k, 1, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_state_unchanged(&before, c, pool, 1);
    kvpt_state_free(&before);
    kvpt_destroy_cache(c, pool);
    kvpt_destroy_cache(b, pool);
    destroy_pool(pool);
}

/*
 * A published page is never written again, even by the only cache that
 * holds it: truncated into it, its owner copies before appending, so a later
 * adopter reads the rows that were published.
 */
static void test_share_truncate_into_published_page_copies(void **state)
{
    (void)state;
    enum { B = 1, BLOCKS = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 16);
    kvp_cache *a = external_cache(pool, B, 1);
    append(a, pool, B, BLOCKS * BT, 0.0);
    double published[B * CAPACITY * HEAD_WIDTH];
    cache_keys(a, published, KVPT_COUNT_OF(published));
    kvp_block_key keys[BLOCKS * B];
    chain_keys(a, B, BLOCKS, 0.0, keys);
    publish_all(a, pool, B, BLOCKS, keys);
    uint32_t page = page_of(a, 0, 1);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_truncate(a, BT + 2, &err), &err); /* into block 1, held once */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_pages_for(a, BT + 3), 1); /* the copy */
    append(a, pool, B, 2, 0.5);
    assert_int_equal(kvpt_stats(pool).cow_copies, 1);
    assert_true(page_of(a, 0, 1) != page);

    kvp_cache *b = external_cache(pool, B, 1);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(b, keys, BLOCKS, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, BLOCKS);
    assert_int_equal(page_of(b, 0, 1), page);
    double now[B * CAPACITY * HEAD_WIDTH];
    cache_keys(b, now, KVPT_COUNT_OF(now));
    assert_memory_equal(now, published, B * BLOCKS * BT * HEAD_WIDTH * sizeof(double));
    kvpt_destroy_cache(b, pool);
    kvpt_destroy_cache(a, pool);
    destroy_pool(pool);
}

/* A key already indexed under another page: publishing it again registers nothing. */
static void test_share_publish_under_indexed_key_keeps_one_entry(void **state)
{
    (void)state;
    enum { B = 2, BLOCKS = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *a = external_cache(pool, B, 1);
    kvp_cache *b = external_cache(pool, B, 1);
    append(a, pool, B, BLOCKS * BT, 0.0);
    append(b, pool, B, BLOCKS * BT, 0.0); /* the same rows, in other pages */
    kvp_block_key keys[BLOCKS * B];
    chain_keys(a, B, BLOCKS, 0.0, keys);
    publish_all(a, pool, B, BLOCKS, keys);
    publish_all(b, pool, B, BLOCKS, keys);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.cached_pages, BLOCKS * B);
    /* b's pages stay unregistered: destroying b frees them, a's wait evictable. */
    kvpt_destroy_cache(b, pool);
    s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, BLOCKS * B);
    assert_int_equal(s.evictable_pages, 0);
    kvp_cache *c = external_cache(pool, B, 1);
    size_t adopted = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_adopt_prefix(c, keys, BLOCKS, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, BLOCKS);
    for (size_t j = 0; j < BLOCKS; j++) {
        assert_int_equal(page_of(c, 1, j), page_of(a, 1, j));
    }
    kvpt_destroy_cache(c, pool);
    kvpt_destroy_cache(a, pool);
    assert_int_equal(kvpt_stats(pool).evictable_pages, BLOCKS * B);
    destroy_pool(pool);
}

/* ---- the audit of evictable pages (I1, I5) --------------------------------- */

/* An evictable page held again behind the LRU's back, or lost from it: both reported. */
static void test_share_audit_reports_evictable_corruption(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 4);
    kvp_cache *a = external_cache(pool, 1, 1);
    append(a, pool, 1, BT, 0.0);
    kvp_block_key key;
    chain_keys(a, 1, 1, 0.0, &key);
    publish_all(a, pool, 1, 1, &key);
    uint32_t page = page_of(a, 0, 0);
    kvpt_destroy_cache(a, pool);
    assert_int_equal(kvpt_stats(pool).evictable_pages, 1);

    /* On the LRU list with a reference count: I5. */
    pool->refcount[page] = 1;
    expect_finding(pool, KVP_INVARIANT_PREFIX,
                   "an evictable page is registered with reference count 0");
    pool->refcount[page] = 0;
    kvpt_assert_pool_ok(pool);

    /* Off the LRU list at reference count 0: a page short of the total (I1). */
    pool->lru_head = KVPI_NO_PAGE;
    pool->lru_tail = KVPI_NO_PAGE;
    expect_finding(pool, KVP_INVARIANT_CONSERVATION, "free + evictable + held pages");
    pool->lru_head = page;
    pool->lru_tail = page;
    kvpt_assert_pool_ok(pool);

    /* Registered without the binding digest it was published under: I5. */
    kvp_block_key binding = pool->page_binding[page];
    memset(&pool->page_binding[page], 0, sizeof binding);
    expect_finding(pool, KVP_INVARIANT_PREFIX,
                   "a page records a binding digest exactly while registered");
    pool->page_binding[page] = binding;
    kvpt_assert_pool_ok(pool);
    destroy_pool(pool);
}

/*
 * Evictions one by one from a full index (16 keys in 32 slots, so probe runs
 * collide), published in one order and evicted first in that order, then in
 * the reverse one: after each eviction, every key still indexed is found
 * under its page (the audit's I5 lookup), however the runs were shifted.
 */
static void test_share_evictions_keep_every_key_reachable(void **state)
{
    (void)state;
    enum { N = 16 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, N);
    kvp_block_key keys[N];
    kvp_error err;
    for (int round = 0; round < 2; round++) {
        kvp_cache *caches[N];
        for (size_t i = 0; i < N; i++) {
            caches[i] = external_cache(pool, 1, 1);
            append(caches[i], pool, 1, BT, (double)i);
            chain_keys(caches[i], 1, 1, (double)i, &keys[i]);
            publish_all(caches[i], pool, 1, 1, &keys[i]);
        }
        for (size_t i = 0; i < N; i++) { /* the LRU order */
            kvpt_destroy_cache(caches[round == 0 ? i : N - 1 - i], pool);
        }
        assert_int_equal(kvpt_stats(pool).cached_pages, N);
        uint32_t storage[N];
        kvpi_reservation res;
        kvpi_reservation_init(&res, pool, storage, N);
        for (size_t n = 1; n <= N; n++) {
            /* n pages: the n - 1 freed before, then one borrowed, evicted once mapped. */
            kvpt_assert_ok(kvpi_reservation_fill(&res, n, &err), &err);
            uint32_t taken[N];
            kvpi_pool_lock(pool);
            for (size_t i = 0; i < n; i++) {
                taken[i] = kvpi_reservation_consume_locked(&res);
            }
            for (size_t i = n; i-- > 0;) {
                kvpi_pool_put_locked(pool, taken[i]);
            }
            kvpi_pool_unlock(pool);
            kvpt_assert_pool_ok(pool);
            assert_int_equal(kvpt_stats(pool).cached_pages, N - n);
            size_t found = 0;
            kvpi_pool_lock(pool);
            for (size_t i = 0; i < N; i++) {
                found += kvpi_prefix_lookup_locked(pool, &keys[i]) != KVPI_NO_PAGE;
            }
            kvpi_pool_unlock(pool);
            assert_int_equal(found, N - n);
        }
        kvpi_reservation_release(&res);
        kvpt_assert_pool_ok(pool);
    }
    destroy_pool(pool);
}

/* Adoption stops at the cache's capacity: the blocks past it stay the index's. */
static void test_share_adopt_stops_at_capacity(void **state)
{
    (void)state;
    enum { B = 2, BLOCKS = 3, ROOM = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *a = external_cache(pool, B, 1);
    append(a, pool, B, BLOCKS * BT, 0.0);
    kvp_block_key keys[BLOCKS * B];
    chain_keys(a, B, BLOCKS, 0.0, keys);
    publish_all(a, pool, B, BLOCKS, keys);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, KV_HEADS, HEAD_WIDTH, 64, 7, 1, &err),
                   &err);
    kvp_cache *small = kvpt_cache(pool, &binding, B, ROOM * BT + 1);
    size_t adopted = 99;
    kvpt_assert_ok(kvp_cache_adopt_prefix(small, keys, BLOCKS, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, ROOM);
    assert_int_equal(kvp_cache_len(small), ROOM * BT);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.prefix_hits, ROOM * B);
    assert_int_equal(s.prefix_misses, 0);
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t j = 0; j < ROOM; j++) {
            assert_int_equal(page_of(small, lane, j), page_of(a, lane, j));
        }
    }
    kvpt_destroy_cache(small, pool);
    kvpt_destroy_cache(a, pool);
    destroy_pool(pool);
}

/* A fork whose copy cannot be had: POOL_EXHAUSTED, and both sides as before. */
static void test_share_exhausted_during_copy_changes_nothing(void **state)
{
    (void)state;
    enum { B = 2, PAGES = 4 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, PAGES);
    kvp_cache *parent = external_cache(pool, B, 1);
    append(parent, pool, B, BT + 2, 0.0); /* 4 pages: the pool is full */
    kvp_cache *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    double k[B * HEAD_WIDTH] = {1, 2, 3, 4};
    kvpt_state pb;
    kvpt_state cb;
    kvpt_state_capture(parent, pool, &pb);
    kvpt_state_capture(child, pool, &cb);
    assert_int_equal(kvp_cache_append_rows(child, k, k, 1, &err), KVP_POOL_EXHAUSTED);
    assert_int_equal(err.needed, B);
    kvpt_assert_state_unchanged(&cb, child, pool, 1);
    kvpt_assert_state_unchanged(&pb, parent, pool, 1);
    assert_int_equal(kvp_cache_reserve_rows(parent, 1, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_state_unchanged(&pb, parent, pool, 2);
    kvpt_state_free(&pb);
    kvpt_state_free(&cb);
    /* The other side gone, a truncate within the page finds it unshared: written in place. */
    kvpt_destroy_cache(parent, pool);
    assert_int_equal(kvp_cache_pages_for(child, BT + 3), B);
    kvpt_assert_ok(kvp_cache_truncate(child, BT + 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_pages_for(child, BT + 3), 0);
    append(child, pool, B, 2, 0.0);
    assert_int_equal(kvpt_stats(pool).cow_copies, 0);
    assert_int_equal(held(pool), 2 * B);
    kvpt_destroy_cache(child, pool);
    destroy_pool(pool);
}

/* Every failing call of the cache-level sharing API: typed status, nothing changed. */
static void test_share_cache_errors_change_nothing(void **state)
{
    (void)state;
    enum { B = 2 };
    kvp_pool *pool = kvpt_pool(BT, KV_HEADS, HEAD_WIDTH, 32);
    kvp_cache *cache = external_cache(pool, B, 1);
    append(cache, pool, B, 6, 0.0);
    kvp_block_key keys[2 * B];
    chain_keys(cache, B, 2, 0.0, keys);
    publish_all(cache, pool, B, 1, keys);
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    kvp_error err;
    kvp_cache *child = (kvp_cache *)0x1;
    kvp_block_key out = {7, 7};
    size_t adopted = 77;
    assert_int_equal(kvp_cache_fork(NULL, &child, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "parent");
    assert_int_equal(kvp_cache_fork(cache, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "child");
    assert_int_equal(kvp_cache_binding_key(NULL, &out, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_binding_key(cache, NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_block_key_chain(NULL, NULL, keys, 1, NULL, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_block_key_chain(NULL, cache, NULL, 1, NULL, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "input");
    assert_int_equal(kvp_block_key_chain(NULL, cache, NULL, 0, NULL, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_cache_publish_block(NULL, 0, 0, keys, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_publish_block(cache, 0, 0, NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_publish_block(cache, 0, 1, &keys[B], &err), KVP_OUT_OF_RANGE);
    assert_int_equal(err.limit, 1);
    assert_int_equal(kvp_cache_publish_block(cache, 1, 0, &keys[0], &err), KVP_PAGE_PUBLISHED);
    assert_int_equal(kvp_cache_adopt_prefix(NULL, keys, 1, &adopted, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_adopt_prefix(cache, NULL, 1, &adopted, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_adopt_prefix(cache, keys, 1, NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_adopt_prefix(cache, keys, 1, &adopted, &err),
                     KVP_NOT_AT_BLOCK_BOUNDARY);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    /* With rows reserved: fork, truncate and adopt are refused. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 2, &err), &err);
    kvpt_state_free(&before);
    kvpt_state_capture(cache, pool, &before);
    assert_int_equal(kvp_cache_fork(cache, &child, &err), KVP_ROWS_RESERVED);
    assert_int_equal(err.tokens, 2);
    assert_int_equal(kvp_cache_truncate(cache, 1, &err), KVP_ROWS_RESERVED);
    assert_int_equal(kvp_cache_adopt_prefix(cache, keys, 1, &adopted, &err), KVP_ROWS_RESERVED);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    kvpt_state_free(&before);
    assert_ptr_equal(child, (kvp_cache *)0x1);
    assert_true(out.lo == 7 && out.hi == 7);
    assert_int_equal(adopted, 77);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err);
    /* The fork's allocations fail: nothing changed, at every one. */
    kvpt_state_capture(cache, pool, &before);
    for (uint64_t nth = 1;; nth++) {
        kvp_cache *made = (kvp_cache *)0x1;
        kvpt_fault_step f;
        kvpt_fault_step_arm(&f, nth);
        kvpt_fault_step_finish(&f, kvp_cache_fork(cache, &made, &f.err));
        if (!f.fired) {
            kvpt_assert_ok(f.status, &f.err);
            kvpt_destroy_cache(made, pool);
            break;
        }
        kvpt_assert_fault_failed(&f, nth);
        assert_ptr_equal(made, (kvp_cache *)0x1);
        kvpt_assert_state_unchanged(&before, cache, pool, 0);
    }
    kvpt_state_free(&before);
    kvpt_destroy_cache(cache, pool);
    destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_fork_copy_on_write),
        cmocka_unit_test(test_share_fork_chains_and_destroy_orders),
        cmocka_unit_test(test_share_truncate),
        cmocka_unit_test(test_share_prefix_hits_and_bindings),
        cmocka_unit_test(test_share_eviction_under_pressure),
        cmocka_unit_test(test_share_truncate_into_published_page_copies),
        cmocka_unit_test(test_share_publish_under_indexed_key_keeps_one_entry),
        cmocka_unit_test(test_share_audit_reports_evictable_corruption),
        cmocka_unit_test(test_share_evictions_keep_every_key_reachable),
        cmocka_unit_test(test_share_adopt_stops_at_capacity),
        cmocka_unit_test(test_share_exhausted_during_copy_changes_nothing),
        cmocka_unit_test_teardown(test_share_cache_errors_change_nothing, kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
