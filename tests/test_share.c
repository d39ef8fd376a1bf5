/*
 * test_share.c: pages shared between caches and sequences (src/pager/share.c,
 * prefix.c, src/serve/share.c): fork with copy-on-write at every boundary,
 * forks of forks and destroy orders, truncate, the prefix index with the same
 * and with different bindings, LRU eviction under pressure, POOL_EXHAUSTED
 * during a copy changing nothing, and bit-identical outputs of forked,
 * prefix-cached and truncated-and-replayed sequences against fresh ones.
 * kvp_pool_check runs after every operation (kvpt_assert_pool_ok). What a
 * hit may be trusted for (bindings, keys, salts, groups) is test_share_keys.c.
 */
#include "share_support.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "pager/pool_internal.h"
#include "pager/reservation.h"
#include "serve/sequence_internal.h"

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

/* ---- sequences ------------------------------------------------------------- */


static void step(kvp_sequence *seq, kvp_pool *pool, const double *in, double *out)
{
    double row[SB * D];
    memcpy(row, in, sizeof row);
    kvp_tensor t = kvp_tensor3(row, SB, 1, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_step(seq, &t, NULL, NULL, out, SB * D, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static void steps_all(kvp_sequence *seq, kvp_pool *pool, double in[STEPS][SB * D], outputs *o)
{
    for (size_t s = 0; s < STEPS; s++) {
        step(seq, pool, in[s], o->steps[s]);
    }
}

/* Prompt rows [from, to) of two outputs, bit for bit. */
static void assert_rows_equal(const outputs *a, const outputs *b, size_t from, size_t to)
{
    for (size_t lane = 0; lane < SB; lane++) {
        assert_memory_equal(a->prompt + (lane * PROMPT + from) * D,
                            b->prompt + (lane * PROMPT + from) * D,
                            (to - from) * D * sizeof(double));
    }
}

/* Prefills the prompt past `adopted`, checks those rows against `want`, destroys `seq`. */
static void prefill_rest_matches(kvp_sequence *seq, kvp_pool *pool, const double *prompt,
                                 size_t adopted, const outputs *want)
{
    static outputs got;
    prefill(seq, pool, prompt, adopted, PROMPT, got.prompt);
    assert_rows_equal(&got, want, adopted, PROMPT);
    kvpt_destroy_sequence(seq, pool);
}

static void assert_steps_equal(const outputs *a, const outputs *b)
{
    assert_memory_equal(a->steps, b->steps, sizeof a->steps);
}

/* The fresh run: prefill the whole prompt, then the steps. */
static void fresh(const kvp_model *model, kvp_pool *pool, const double *prompt,
                  double in[STEPS][SB * D], outputs *o)
{
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    prefill(seq, pool, prompt, 0, PROMPT, o->prompt);
    steps_all(seq, pool, in, o);
    kvpt_destroy_sequence(seq, pool);
}

/* Fork mid-block (6) and on a block edge (8): both sides continue bit for bit as fresh. */
static void test_share_sequence_fork_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 5);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    static const size_t cuts[] = {6, 8};
    for (size_t k = 0; k < KVPT_COUNT_OF(cuts); k++) {
        size_t cut = cuts[k];
        static outputs p;
        static outputs c;
        kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
        prefill(parent, pool, prompt, 0, cut, p.prompt);
        size_t held_before = held(pool);
        kvp_sequence *child = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(held(pool), held_before);
        assert_int_equal(kvp_sequence_len(child), cut);
        /* The child's promise counts only pages it will take: its copies or new block. */
        size_t lanes = LAYERS * SB;
        assert_int_equal(kvp_sequence_pages_for(child, cut + 1), lanes);
        assert_int_equal(kvp_sequence_pages_for(child, cut), 0);
        kvpt_assert_ok(kvp_sequence_promise(child, kvp_sequence_pages_for(child, PROMPT), &err),
                       &err);
        prefill(child, pool, prompt, cut, PROMPT, c.prompt);
        assert_int_equal(kvp_sequence_promised_pages(child), 0);
        steps_all(child, pool, in, &c);
        assert_rows_equal(&c, &want, cut, PROMPT);
        assert_steps_equal(&c, &want);
        prefill(parent, pool, prompt, cut, PROMPT, p.prompt);
        steps_all(parent, pool, in, &p);
        assert_rows_equal(&p, &want, 0, PROMPT);
        assert_steps_equal(&p, &want);
        assert_int_equal(kvpt_stats(pool).cow_copies, cut % BT != 0 ? 2 * lanes * (k + 1) : 2 * lanes);
        kvpt_assert_same_rows(parent, child);
        kvpt_destroy_sequence(parent, pool);
        kvpt_destroy_sequence(child, pool);
        assert_int_equal(held(pool), 0);
    }
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* Layer 1's parameter `which` gets value[index] += delta: a new revision. */
static void bump_revision(kvp_model *model, size_t which, size_t index, double delta)
{
    kvp_param *w = kvp_model_param_mut(model, 1, which);
    double values[D * D];
    memcpy(values, kvp_param_values(w), sizeof values);
    values[index] += delta;
    kvp_error err;
    kvpt_assert_ok(kvp_param_update(w, values, &err), &err);
}

/*
 * A fork of a stale sequence keeps the parent's captured revisions: parent
 * and child are refused the same way, and neither steps on K/V of the old
 * weights under the new ones.
 */
static void test_share_fork_of_stale_sequence_is_stale(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 9);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs o;
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    bump_revision(model, KVP_PARAM_VALUE, 3, -0.5);
    kvp_error err;
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    size_t held_before = held(pool);
    kvp_tensor t = kvp_tensor3(in[0], SB, 1, D);
    double out[SB * D];
    kvp_sequence *both[] = {parent, child};
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(kvp_sequence_step(both[i], &t, NULL, NULL, out, SB * D, &err),
                         KVP_CACHE_LAYER_REVISION_MISMATCH);
        assert_int_equal(err.layer, 1);
        assert_int_equal(err.parameter, KVP_PARAM_VALUE);
        assert_int_equal(kvp_sequence_len(both[i]), 6);
    }
    assert_int_equal(held(pool), held_before);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    assert_int_equal(held(pool), 0);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* A prompt prefix adopted from the index: the rest computed, bit for bit as fresh. */
static void test_share_sequence_prefix_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 6);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);

    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(a, pool, prompt, 0, PROMPT, o.prompt);
    size_t published = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(published, PROMPT / BT);
    assert_int_equal(kvpt_stats(pool).cached_pages, LAYERS * SB * (PROMPT / BT));
    kvpt_destroy_sequence(a, pool);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, 8); /* (10 - 1) / 4 blocks: the last token is left */
    assert_int_equal(kvp_sequence_len(b), 8);
    assert_int_equal(kvpt_stats(pool).prefix_hits, LAYERS * SB * 2);
    static outputs got;
    prefill(b, pool, prompt, adopted, PROMPT, got.prompt);
    steps_all(b, pool, in, &got);
    assert_rows_equal(&got, &want, adopted, PROMPT);
    assert_steps_equal(&got, &want);
    /* Not empty any more: refused, nothing changed. */
    assert_int_equal(kvp_sequence_adopt_prefix(b, &whole, &adopted, &err), KVP_INVALID_ARGUMENT);
    kvpt_destroy_sequence(b, pool);

    /* A revision bump: the same prompt finds nothing, and the recomputed rows differ. */
    bump_revision(model, KVP_PARAM_KEY, 0, 0.25);
    kvp_sequence *c = kvpt_sequence(model, pool, SB, SCAP);
    uint64_t misses = kvpt_stats(pool).prefix_misses;
    kvpt_assert_ok(kvp_sequence_adopt_prefix(c, &whole, &adopted, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(adopted, 0);
    assert_int_equal(kvp_sequence_len(c), 0);
    assert_int_equal(kvpt_stats(pool).prefix_misses, misses + 1);
    kvpt_destroy_sequence(c, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * A block is adopted only when every layer's page of it hits: with the last
 * layer's page of block 1 (its last lane) taken by a reservation (borrowed:
 * hidden from lookups) and layer 0's still indexed, the prefix stops after
 * block 0, and the rest recomputes alike.
 */
static void test_share_sequence_adopt_stops_at_one_layers_miss(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 6);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, LAYERS * SB * 3);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);
    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs want;
    prefill(a, pool, prompt, 0, PROMPT, want.prompt);
    size_t published = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    assert_int_equal(published, 2);
    uint32_t evicted = page_of(a->caches[LAYERS - 1], SB - 1, 1);
    uint32_t kept = page_of(a->caches[0], SB - 1, 1);
    /* Layer 0 outlives a in a fork of its cache: the other layers' pages go evictable first. */
    kvp_cache *layer0 = NULL;
    kvpt_assert_ok(kvp_cache_fork(a->caches[0], &layer0, &err), &err);
    kvpt_destroy_sequence(a, pool);
    kvpt_destroy_cache(layer0, pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.evictable_pages, LAYERS * SB * 2);

    /* Every free page and one more: the least recently used, the last layer's. */
    uint32_t storage[LAYERS * SB * 3];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, s.free_pages + 1);
    kvpt_assert_ok(kvpi_reservation_fill(&res, s.free_pages + 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    /* Borrowed, not evicted: hidden from lookups until the reservation maps or returns it. */
    assert_int_equal(kvpt_stats(pool).evictions, 0);
    assert_int_equal(pool->registered[evicted], KVPI_PAGE_BORROWED);
    assert_int_equal(pool->registered[kept], KVPI_PAGE_INDEXED);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    uint64_t misses = kvpt_stats(pool).prefix_misses;
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, BT);
    assert_int_equal(kvp_sequence_len(b), BT);
    s = kvpt_stats(pool);
    assert_int_equal(s.prefix_misses, misses + 1);
    assert_int_equal(s.prefix_hits, LAYERS * SB);
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    prefill_rest_matches(b, pool, prompt, adopted, &want);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * Layers over the same parameters have equal binding digests: each layer's
 * index still gives it its own keys, so every layer publishes its own pages
 * and an adopter reads each layer's own K/V (bit for bit the same outputs).
 */
static void test_share_layers_sharing_parameters_keep_their_own_keys(void **state)
{
    (void)state;
    kvp_layer *layer = kvpt_random_layer(D, HEADS, SCAP, BASE, 21);
    kvp_model *model = kvpt_model_of_one_layer(layer, LAYERS);
    kvp_error err;
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 64);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_tensor whole = kvp_tensor3(prompt, SB, PROMPT, D);
    kvp_sequence *a = kvpt_sequence(model, pool, SB, SCAP);
    static outputs want;
    prefill(a, pool, prompt, 0, PROMPT, want.prompt);
    size_t published = 0;
    kvpt_assert_ok(kvp_sequence_publish_prefix(a, &whole, &published, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(published, 2);
    assert_int_equal(kvpt_stats(pool).cached_pages, LAYERS * SB * 2);
    kvpt_destroy_sequence(a, pool);

    kvp_sequence *b = kvpt_sequence(model, pool, SB, SCAP);
    size_t adopted = adopt_whole(b, pool, &whole);
    assert_int_equal(adopted, 2 * BT);
    for (size_t j = 0; j < 2; j++) {
        assert_true(page_of(b->caches[0], 0, j) != page_of(b->caches[1], 0, j));
    }
    prefill_rest_matches(b, pool, prompt, adopted, &want);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* Truncate and replay the same inputs by steps: bit for bit the first outputs. */
static void test_share_sequence_truncate_replay_bit_identical(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 7);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    kvp_sequence *seq = kvpt_sequence(model, pool, SB, SCAP);
    static outputs got;
    prefill(seq, pool, prompt, 0, PROMPT, got.prompt);
    steps_all(seq, pool, in, &got);
    kvp_error err;
    assert_int_equal(kvp_sequence_truncate(seq, PROMPT + STEPS + 1, &err), KVP_OUT_OF_RANGE);
    kvpt_assert_ok(kvp_sequence_truncate(seq, PROMPT + STEPS, &err), &err); /* same: no-op */
    kvpt_assert_ok(kvp_sequence_truncate(seq, 7, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 7);
    assert_int_equal(held(pool), LAYERS * SB * 2);
    /* Replay tokens 7..9 one step at a time, then the steps. */
    for (size_t t = 7; t < PROMPT; t++) {
        double row[SB * D];
        double out[SB * D];
        slice(prompt, t, t + 1, row);
        step(seq, pool, row, out);
        for (size_t b = 0; b < SB; b++) {
            assert_memory_equal(out + b * D, want.prompt + (b * PROMPT + t) * D,
                                D * sizeof(double));
        }
    }
    steps_all(seq, pool, in, &got);
    assert_steps_equal(&got, &want);
    kvpt_destroy_sequence(seq, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* A step after a fork whose copies cannot be had, and a failed fork: nothing changes. */
static void test_share_sequence_failures_change_nothing(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 8);
    size_t pages = LAYERS * SB * 2; /* exactly the pages of 6 tokens */
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, pages);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    kvp_sequence *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);
    uint64_t pool_digest = 0;
    kvpt_assert_ok(kvp_pool_digest(pool, &pool_digest, &err), &err);
    double row[SB * D];
    double out[SB * D];
    memcpy(row, in[0], sizeof row);
    kvp_tensor t = kvp_tensor3(row, SB, 1, D);
    assert_int_equal(kvp_sequence_step(child, &t, NULL, NULL, out, SB * D, &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    after.exhaustions--;
    assert_memory_equal(&before, &after, sizeof before);
    uint64_t digest_after = 0;
    kvpt_assert_ok(kvp_pool_digest(pool, &digest_after, &err), &err);
    assert_true(digest_after == pool_digest);
    assert_int_equal(kvp_sequence_len(child), 6);
    /* A prefill of the rest fails too, before any token: nothing changed. */
    double part[SB * 4 * D];
    slice(prompt, 6, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, 4, D);
    assert_int_equal(kvp_sequence_prefill(child, &rest, NULL, NULL, NULL, 0, &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cow_copies, 0);
    assert_int_equal(kvpt_stats(pool).held_pages, before.held_pages);
    kvpt_assert_same_rows(parent, child);
    /* A fork whose allocations fail: nothing changed, at every allocation. */
    for (uint64_t nth = 1;; nth++) {
        kvp_sequence *made = (kvp_sequence *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_sequence_fork(parent, &made, &s.err));
        kvpt_assert_pool_ok(pool);
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            kvpt_destroy_sequence(made, pool);
            break;
        }
        kvpt_assert_fault_failed(&s, nth);
        assert_ptr_equal(made, (kvp_sequence *)0x1);
        after = kvpt_stats(pool);
        assert_int_equal(after.attached_caches, before.attached_caches);
        assert_int_equal(after.held_pages, before.held_pages);
        assert_int_equal(after.acquires, before.acquires);
    }
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* The residual stream, except that layer 0's output of the third call is infinite. */
static void poison_third(void *ctx, size_t layer, const double *input, const double *output,
                         size_t n, double *next)
{
    size_t *calls = ctx;
    for (size_t i = 0; i < n; i++) {
        next[i] = input[i] + output[i];
    }
    if (layer == 0 && ++*calls == 3) {
        next[0] = 1.0 / 0.0;
    }
}

/* A prefill that fails after its first token copied the shared pages rolls the copies back. */
static void test_share_prefill_rollback_restores_shared_page(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 9);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 256);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    kvp_sequence *parent = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(parent, pool, prompt, 0, 6, o.prompt);
    kvp_sequence *child = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_assert_ok(kvp_sequence_promise(child, 5, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);
    uint32_t page_before = 0;
    kvpt_assert_ok(kvp_cache_page(kvp_sequence_cache(child, 1), 1, 1, &page_before, &err), &err);
    double part[SB * 4 * D];
    slice(prompt, 6, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, 4, D);
    size_t calls = 0;
    assert_int_equal(kvp_sequence_prefill(child, &rest, poison_third, &calls, NULL, 0, &err),
                     KVP_NONFINITE_PROJECTION);
    assert_int_equal(err.token, 2);
    assert_int_equal(calls, 3);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    uint32_t page_after = 0;
    kvpt_assert_ok(kvp_cache_page(kvp_sequence_cache(child, 1), 1, 1, &page_after, &err), &err);
    assert_int_equal(page_after, page_before);
    assert_int_equal(kvp_sequence_len(child), 6);
    assert_int_equal(kvp_sequence_promised_pages(child), 5);
    /* Still shared: the next prefill copies again, and matches the parent bit for bit. */
    assert_int_equal(kvp_sequence_pages_for(child, 7), LAYERS * SB);
    static outputs c;
    static outputs p;
    prefill(child, pool, prompt, 6, PROMPT, c.prompt);
    prefill(parent, pool, prompt, 6, PROMPT, p.prompt);
    assert_rows_equal(&c, &p, 6, PROMPT);
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- threads: sharing while other sequences of the pool step ---------------- */

#define ROUNDS 3

typedef struct share_thread {
    const kvp_model *model;
    kvp_pool *pool;
    kvp_sequence *parent;          /* this thread's own fork of the shared base */
    const double *prompt;
    double (*in)[SB * D];
    const outputs *want;
    pthread_barrier_t *barrier;
    int adopter;                   /* adopt the published block instead of forking */
    int failures;
} share_thread;

static int rows_match(const double *got, const outputs *want, size_t from, size_t to)
{
    for (size_t b = 0; b < SB; b++) {
        if (memcmp(got + b * (to - from) * D, want->prompt + (b * PROMPT + from) * D,
                   (to - from) * D * sizeof(double)) != 0) {
            return 0;
        }
    }
    return 1;
}

/* Prefill tokens [from, PROMPT), then the steps; 1 when every output matches `want`. */
static int finish_and_compare(share_thread *t, kvp_sequence *seq, size_t from)
{
    double part[SB * PROMPT * D];
    double out[SB * PROMPT * D];
    slice(t->prompt, from, PROMPT, part);
    kvp_tensor rest = kvp_tensor3(part, SB, PROMPT - from, D);
    if (kvp_sequence_prefill(seq, &rest, NULL, NULL, out, KVPT_COUNT_OF(out), NULL) != KVP_OK ||
        !rows_match(out, t->want, from, PROMPT)) {
        return 0;
    }
    for (size_t s = 0; s < STEPS; s++) {
        double row[SB * D];
        double got[SB * D];
        memcpy(row, t->in[s], sizeof row);
        kvp_tensor x = kvp_tensor3(row, SB, 1, D);
        if (kvp_sequence_step(seq, &x, NULL, NULL, got, SB * D, NULL) != KVP_OK ||
            memcmp(got, t->want->steps[s], sizeof got) != 0) {
            return 0;
        }
    }
    return 1;
}

static void *share_worker(void *arg)
{
    share_thread *t = arg;
    kvp_tensor whole = kvp_tensor3((double *)(uintptr_t)t->prompt, SB, PROMPT, D);
    for (size_t r = 0; r < ROUNDS; r++) {
        pthread_barrier_wait(t->barrier);
        kvp_sequence *seq = NULL;
        size_t from = 0;
        if (t->adopter) {
            size_t adopted = 0;
            if (kvp_sequence_create(t->model, t->pool, SB, SCAP, &seq, NULL) != KVP_OK ||
                kvp_sequence_adopt_prefix(seq, &whole, &adopted, NULL) != KVP_OK ||
                adopted != BT) {
                t->failures++;
                if (seq != NULL) {
                    (void)kvp_sequence_destroy(seq, NULL);
                }
                continue;
            }
            from = adopted;
        } else {
            if (kvp_sequence_fork(t->parent, &seq, NULL) != KVP_OK) {
                t->failures++;
                continue;
            }
            from = kvp_sequence_len(seq);
        }
        t->failures += !finish_and_compare(t, seq, from);
        /* Truncate into the prompt and replay: the same outputs again. */
        if (kvp_sequence_truncate(seq, from + 1, NULL) != KVP_OK) {
            t->failures++;
        } else {
            t->failures += !finish_and_compare(t, seq, from + 1);
        }
        (void)kvp_sequence_destroy(seq, NULL);
    }
    return NULL;
}

/* Two threads fork, adopt, step and truncate sequences that share pages; audit after. */
static void test_share_threads_fork_adopt_truncate(void **state)
{
    (void)state;
    kvp_model *model = kvpt_random_model(LAYERS, D, HEADS, SCAP, BASE, 10);
    kvp_pool *pool = kvpt_pool(BT, HEADS, D / HEADS, 512);
    static double prompt[SB * PROMPT * D];
    static double in[STEPS][SB * D];
    inputs(prompt, in);
    static outputs want;
    fresh(model, pool, prompt, in, &want);
    /* The base holds 6 tokens (block 0 published, block 1 partial); two forks of it. */
    kvp_sequence *base = kvpt_sequence(model, pool, SB, SCAP);
    static outputs o;
    prefill(base, pool, prompt, 0, 6, o.prompt);
    double head[SB * 6 * D];
    slice(prompt, 0, 6, head);
    kvp_tensor six = kvp_tensor3(head, SB, 6, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_publish_prefix(base, &six, NULL, &err), &err);
    kvp_sequence *mine[2];
    for (size_t i = 0; i < 2; i++) {
        kvpt_assert_ok(kvp_sequence_fork(base, &mine[i], &err), &err);
    }
    pthread_barrier_t barrier;
    assert_int_equal(pthread_barrier_init(&barrier, NULL, 3), 0);
    share_thread t[3];
    pthread_t threads[3];
    for (size_t i = 0; i < 3; i++) {
        t[i] = (share_thread){model, pool, i < 2 ? mine[i] : NULL, prompt, in, &want,
                              &barrier, i == 2, 0};
        assert_int_equal(pthread_create(&threads[i], NULL, share_worker, &t[i]), 0);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(pthread_join(threads[i], NULL), 0);
        assert_int_equal(t[i].failures, 0);
    }
    pthread_barrier_destroy(&barrier);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.prefix_hits, ROUNDS * LAYERS * SB);
    assert_int_equal(held(pool), LAYERS * SB * 2); /* base and its two forks share them all */
    kvpt_destroy_sequence(mine[0], pool);
    kvpt_destroy_sequence(mine[1], pool);
    kvpt_destroy_sequence(base, pool);
    destroy_pool(pool);
    kvpt_destroy_model(model);
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
        cmocka_unit_test(test_share_sequence_fork_bit_identical),
        cmocka_unit_test(test_share_fork_of_stale_sequence_is_stale),
        cmocka_unit_test(test_share_sequence_prefix_bit_identical),
        cmocka_unit_test(test_share_sequence_adopt_stops_at_one_layers_miss),
        cmocka_unit_test(test_share_layers_sharing_parameters_keep_their_own_keys),
        cmocka_unit_test(test_share_sequence_truncate_replay_bit_identical),
        cmocka_unit_test_teardown(test_share_sequence_failures_change_nothing, kvpt_disarm),
        cmocka_unit_test(test_share_prefill_rollback_restores_shared_page),
        cmocka_unit_test(test_share_threads_fork_adopt_truncate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
