/*
 * test_share_txn.c: sharing and transactions (issue 16).
 *
 * - Cached pages a take borrows from the LRU list: hidden from lookups and
 *   adoption while borrowed, back with their keys, index slots and LRU
 *   places when the transaction gives them back (also when transactions
 *   interleave), evicted (and counted) only when a page table maps them; a
 *   key published meanwhile by another page wins.
 * - Tickets across fork and adopt: a ticket prepared before a fork of a
 *   mid-page parent, or before an adopt lengthens the cache, is stale at
 *   commit (TICKET_STALE, nothing changed); a fork at a block boundary, or
 *   an adopt that adopts nothing, leaves it valid.
 * - Copy-on-write in every lane: a fork of a batch-3 cache (and of a batch-2
 *   sequence) mid-block copies each lane's shared partial page, and the
 *   originals keep their bytes.
 * - PAGE_NOT_HELD on an evictable page says so (not "free").
 * - The one writer of a shared partial page (kvpi_cache_fork_writer_locked,
 *   the scheduler's samples): the parent appends in place, its children
 *   copy, n caches make n - 1 copies; the audit holds throughout and
 *   reports a second writer, or a holder longer than the writer.
 *
 * Unit test: uses pager/pool_internal.h and pager/reservation.h (a raw
 * reservation holds borrowed pages between calls; the index is read under
 * the pool lock). Single-threaded: no repeat runs needed.
 */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"
#include "pager/pool_internal.h"
#include "pager/reservation.h"

enum { BT = 4, HEADS = 2, HD = 2, D = HEADS * HD, POSITIONS = 32 };

#define BASE 10000.0

static kvp_binding external_binding(void)
{
    kvp_binding b;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&b, HEADS, HD, POSITIONS, 5, 1, &err), &err);
    return b;
}

/* `rows` random rows appended to every lane of an external cache. */
static void append(kvp_cache *cache, size_t batch, size_t rows, uint64_t seed)
{
    size_t n = batch * HEADS * rows * HD;
    double *data = kvpt_doubles(n);
    kvpt_fill_random(data, n, seed);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_append_rows(cache, data, data, rows, &err), &err);
    free(data);
}

/* The key of (lane, salt) for `cache`'s binding. */
static kvp_block_key key_of(const kvp_cache *cache, size_t lane, uint64_t salt)
{
    uint64_t input[2] = {lane, salt};
    kvp_block_key key;
    kvp_error err;
    kvpt_assert_ok(kvp_block_key_chain(NULL, cache, input, sizeof input, NULL, &key, &err), &err);
    return key;
}

/*
 * `n` cached, evictable pages: an external cache of n lanes fills one block
 * each, publishes it under key_of(lane, salt) and is destroyed (its pages go
 * to the LRU list). keys[0..n) receive the keys.
 */
static void cache_pages(kvp_pool *pool, size_t n, uint64_t salt, kvp_block_key *keys)
{
    kvp_binding b = external_binding();
    kvp_cache *publisher = kvpt_cache(pool, &b, n, BT);
    append(publisher, n, BT, salt);
    kvp_error err;
    for (size_t lane = 0; lane < n; lane++) {
        keys[lane] = key_of(publisher, lane, salt);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_destroy_cache(publisher, pool);
}

static uint32_t lookup(kvp_pool *pool, const kvp_block_key *key)
{
    kvpi_pool_lock(pool);
    uint32_t page = kvpi_prefix_lookup_locked(pool, key);
    kvpi_pool_unlock(pool);
    return page;
}

static uint32_t state_of(kvp_pool *pool, uint32_t page)
{
    kvpi_pool_lock(pool);
    uint32_t state = pool->registered[page];
    kvpi_pool_unlock(pool);
    return state;
}

/* Destroys a pool whose pages are all free or evictable. */
static void destroy_cached_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, 0);
    assert_int_equal(s.free_pages + s.evictable_pages, s.total_pages);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

/* ---- borrowed pages ------------------------------------------------------------ */

/*
 * A take with no free page borrows the oldest cached pages: still indexed
 * (cached_pages), off the LRU list, invisible to lookups and to adoption,
 * no eviction counted. Given back, every key finds its page again and the
 * LRU order is the original one.
 */
static void test_share_txn_borrowed_pages_hidden_then_restored(void **state)
{
    (void)state;
    enum { N = 6 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, N);
    kvp_block_key keys[N];
    cache_pages(pool, N, 1, keys);
    uint32_t order[N];
    assert_int_equal(kvpt_lru_order(pool, order), N);
    uint32_t page_of_key[N];
    for (size_t i = 0; i < N; i++) {
        page_of_key[i] = lookup(pool, &keys[i]);
        assert_int_not_equal(page_of_key[i], KVPI_NO_PAGE);
    }
    kvp_pool_stats before = kvpt_stats(pool);
    uint32_t storage[N];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, N);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(storage[0], order[0]);
    assert_int_equal(storage[1], order[1]);
    kvp_pool_stats mid = kvpt_stats(pool);
    assert_int_equal(mid.cached_pages, N);
    assert_int_equal(mid.evictable_pages, N - 2);
    assert_int_equal(mid.evictions, 0);
    assert_int_equal(state_of(pool, order[0]), KVPI_PAGE_BORROWED);
    assert_int_equal(state_of(pool, order[1]), KVPI_PAGE_BORROWED);
    size_t hidden = 0;
    for (size_t i = 0; i < N; i++) {
        uint32_t page = lookup(pool, &keys[i]);
        hidden += page == KVPI_NO_PAGE;
        assert_true(page == KVPI_NO_PAGE || page == page_of_key[i]);
    }
    assert_int_equal(hidden, 2);
    /* Nobody adopts a borrowed page: an adopter misses its key. */
    kvp_binding b = external_binding();
    kvp_cache *adopter = kvpt_cache(pool, &b, 1, BT);
    for (size_t i = 0; i < N; i++) {
        if (page_of_key[i] != order[0]) {
            continue;
        }
        size_t adopted = 99;
        kvpt_assert_ok(kvp_cache_adopt_prefix(adopter, &keys[i], 1, &adopted, &err), &err);
        assert_int_equal(adopted, 0);
    }
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    uint32_t after[N];
    assert_int_equal(kvpt_lru_order(pool, after), N);
    assert_memory_equal(after, order, sizeof order);
    for (size_t i = 0; i < N; i++) {
        assert_int_equal(lookup(pool, &keys[i]), page_of_key[i]);
    }
    kvp_pool_stats now = kvpt_stats(pool);
    before.prefix_misses++; /* the adopter's lookup */
    before.attached_caches++;
    before.acquires += 2; /* a plain (not tentative) reservation counts its pages */
    before.releases += 2;
    assert_memory_equal(&now, &before, sizeof now);
    kvpt_destroy_cache(adopter, pool);
    destroy_cached_pool(pool);
}

/*
 * Two transactions borrow in turn and give back in either order, with a
 * page adopted and let go meanwhile (it becomes the most recent): each
 * borrowed page goes back to the place its stamp gives it.
 */
static void test_share_txn_interleaved_cancels_restore_the_lru_order(void **state)
{
    (void)state;
    enum { N = 6 };
    for (int order_of_release = 0; order_of_release < 2; order_of_release++) {
        kvp_pool *pool = kvpt_pool(BT, HEADS, HD, N);
        kvp_block_key keys[N];
        cache_pages(pool, N, 2, keys);
        uint32_t order[N];
        assert_int_equal(kvpt_lru_order(pool, order), N);
        uint32_t sa[2];
        uint32_t sb[2];
        kvpi_reservation a;
        kvpi_reservation b;
        kvpi_reservation_init(&a, pool, sa, 2);
        kvpi_reservation_init(&b, pool, sb, 2);
        kvp_error err;
        kvpt_assert_ok(kvpi_reservation_fill(&a, 2, &err), &err);
        kvpt_assert_ok(kvpi_reservation_fill(&b, 2, &err), &err);
        assert_int_equal(sb[0], order[2]);
        /* order[4] is adopted and let go: it moves to the most recent end. */
        size_t k = 0;
        while (lookup(pool, &keys[k]) != order[4]) {
            k++;
        }
        kvp_binding eb = external_binding();
        kvp_cache *adopter = kvpt_cache(pool, &eb, 1, BT);
        size_t adopted = 0;
        kvpt_assert_ok(kvp_cache_adopt_prefix(adopter, &keys[k], 1, &adopted, &err), &err);
        assert_int_equal(adopted, 1);
        kvpt_destroy_cache(adopter, pool);
        if (order_of_release == 0) {
            kvpi_reservation_release(&a);
            kvpi_reservation_release(&b);
        } else {
            kvpi_reservation_release(&b);
            kvpi_reservation_release(&a);
        }
        kvpt_assert_pool_ok(pool);
        uint32_t after[N];
        assert_int_equal(kvpt_lru_order(pool, after), N);
        const uint32_t expected[N] = {order[0], order[1], order[2], order[3], order[5], order[4]};
        assert_memory_equal(after, expected, sizeof expected);
        assert_int_equal(kvpt_stats(pool).evictions, 0);
        destroy_cached_pool(pool);
    }
}

/*
 * A borrowed page that a page table maps is evicted then (a confirmed
 * take): append_rows into a pool whose cached pages are all evictable
 * evicts exactly the pages it maps, and their keys are gone.
 */
static void test_share_txn_mapped_borrowed_pages_are_evicted(void **state)
{
    (void)state;
    enum { N = 5 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, N);
    kvp_block_key keys[N];
    cache_pages(pool, N, 3, keys);
    uint32_t order[N];
    assert_int_equal(kvpt_lru_order(pool, order), N);
    kvp_binding b = external_binding();
    kvp_cache *cache = kvpt_cache(pool, &b, 2, 2 * BT);
    append(cache, 2, 1, 30); /* one block, two lanes: the two oldest pages */
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.evictions, 2);
    assert_int_equal(s.cached_pages, N - 2);
    assert_int_equal(s.evictable_pages, N - 2);
    uint32_t mapped[2];
    kvp_error err;
    kvpt_assert_ok(kvp_cache_page(cache, 0, 0, &mapped[0], &err), &err);
    kvpt_assert_ok(kvp_cache_page(cache, 1, 0, &mapped[1], &err), &err);
    assert_int_equal(mapped[0], order[0]);
    assert_int_equal(mapped[1], order[1]);
    assert_int_equal(state_of(pool, order[0]), 0);
    assert_int_equal(state_of(pool, order[1]), 0);
    size_t found = 0;
    for (size_t i = 0; i < N; i++) {
        uint32_t page = lookup(pool, &keys[i]);
        found += page != KVPI_NO_PAGE;
        assert_true(page != order[0] && page != order[1]);
    }
    assert_int_equal(found, N - 2);
    /* Reset: the evicted pages go free, not back to the LRU list. */
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    assert_int_equal(kvpt_stats(pool).free_pages, 2);
    kvpt_destroy_cache(cache, pool);
    destroy_cached_pool(pool);
}

/*
 * A key published by another page while its page was borrowed belongs to
 * that page: the borrowed one, given back, leaves the index and goes free
 * (the index never holds a key twice).
 */
static void test_share_txn_key_published_while_borrowed_wins(void **state)
{
    (void)state;
    enum { CACHED = 4, N = CACHED + 2 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, N);
    kvp_block_key keys[CACHED];
    cache_pages(pool, CACHED, 4, keys);
    uint32_t order[CACHED];
    assert_int_equal(kvpt_lru_order(pool, order), CACHED);
    kvp_binding b = external_binding();
    kvp_cache *other = kvpt_cache(pool, &b, 1, BT);
    append(other, 1, BT, 40); /* one of the two free pages */
    uint32_t storage[2];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 2);
    kvp_error err;
    kvpt_assert_ok(kvpi_reservation_fill(&res, 2, &err), &err); /* the free page, then order[0] */
    assert_int_equal(storage[1], order[0]);
    size_t k = 0;
    while (k < CACHED && lookup(pool, &keys[k]) != KVPI_NO_PAGE) {
        k++;
    }
    assert_true(k < CACHED); /* the borrowed page's key: hidden */
    kvpt_assert_ok(kvp_cache_publish_block(other, 0, 0, &keys[k], &err), &err);
    uint32_t winner = 0;
    kvpt_assert_ok(kvp_cache_page(other, 0, 0, &winner, &err), &err);
    assert_int_equal(lookup(pool, &keys[k]), winner);
    kvpt_assert_pool_ok(pool);
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(lookup(pool, &keys[k]), winner);
    assert_int_equal(state_of(pool, order[0]), 0);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.cached_pages, CACHED); /* order[0] out, winner in */
    assert_int_equal(s.evictable_pages, CACHED - 1);
    assert_int_equal(s.free_pages, 2);
    assert_int_equal(s.evictions, 0);
    kvpt_destroy_cache(other, pool);
    destroy_cached_pool(pool);
}

/* ---- PAGE_NOT_HELD ----------------------------------------------------------------- */

/* An evictable page is registered at reference count 0: the message says so, not "free". */
static void test_share_txn_page_not_held_names_evictable_pages(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 2);
    kvp_block_key key;
    cache_pages(pool, 1, 5, &key);
    uint32_t order[2];
    assert_int_equal(kvpt_lru_order(pool, order), 1);
    uint32_t free_page = order[0] == 0 ? 1 : 0;
    const void *k = NULL;
    const void *v = NULL;
    kvp_error e;
    memset(&e, 0, sizeof e);
    assert_int_equal(kvp_pool_page_data(pool, order[0], &k, &v, NULL, &e), KVP_PAGE_NOT_HELD);
    assert_int_equal(e.index, order[0]);
    assert_non_null(e.what);
    assert_string_equal(e.what, "evictable");
    char want[128];
    snprintf(want, sizeof want,
             "page %u is evictable (cached, but no page table holds it): only held pages have "
             "data",
             (unsigned)order[0]);
    kvpt_assert_error_text(&e, want);
    memset(&e, 0, sizeof e);
    assert_int_equal(kvp_pool_page_data(pool, free_page, &k, &v, NULL, &e), KVP_PAGE_NOT_HELD);
    assert_non_null(e.what);
    assert_string_equal(e.what, "free");
    snprintf(want, sizeof want, "page %u is free: only held pages have data", (unsigned)free_page);
    kvpt_assert_error_text(&e, want);
    assert_ptr_equal(k, NULL);
    assert_ptr_equal(v, NULL);
    destroy_cached_pool(pool);
}

/* ---- tickets across fork and adopt ---------------------------------------------------- */

/* `tokens` tokens through attention, one forward each, from seed. */
static void forward(const kvp_layer *layer, kvp_cache *cache, kvp_ticket *ticket, size_t batch,
                    size_t tokens, uint64_t seed)
{
    double *x = kvpt_doubles(batch * D);
    kvp_error err;
    for (size_t t = 0; t < tokens; t++) {
        kvpt_fill_random(x, batch * D, seed + t);
        kvp_tensor in = kvp_tensor3(x, batch, 1, D);
        kvpt_assert_ok(kvp_attention_forward(layer, &in, cache, ticket, &err), &err);
    }
    free(x);
}

static uint64_t digest_of(const kvp_cache *cache)
{
    uint64_t digest = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_digest(cache, &digest, &err), &err);
    return digest;
}

/*
 * A fork at a mid-block length: the parent's next commit must copy its
 * partial pages, which a ticket prepared before did not reserve, so the
 * ticket is stale. The refusal changes nothing; prepared again, it copies
 * (one page per lane). A fork at a block boundary needs no copy: a ticket
 * prepared before it commits.
 */
static void test_share_txn_ticket_before_fork_is_stale(void **state)
{
    (void)state;
    enum { B = 2 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 16);
    kvp_layer *layer = kvpt_random_layer(D, HEADS, POSITIONS, BASE, 50);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *parent = kvpt_cache(pool, &binding, B, POSITIONS);
    kvp_ticket *ticket = kvpt_ticket(parent);
    forward(layer, parent, ticket, B, BT + 1, 51); /* mid-block: len 5 */
    double x[B * D];
    kvpt_fill_random(x, B * D, 52);
    kvp_tensor in = kvp_tensor3(x, B, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, parent, ticket, &err), &err);
    kvp_cache *child = NULL;
    kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
    kvp_pool_stats before = kvpt_stats(pool);
    uint64_t digest = digest_of(parent);
    kvp_error e;
    memset(&e, 0, sizeof e);
    assert_int_equal(kvp_ticket_commit(ticket, parent, &e), KVP_TICKET_STALE);
    assert_int_equal(e.prepared_len, BT + 1);
    assert_int_equal(e.current_len, BT + 1);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&after, &before, sizeof after);
    assert_int_equal(digest_of(parent), digest);
    assert_int_equal(kvp_cache_len(parent), BT + 1);
    kvpt_assert_pool_ok(pool);
    /* Prepared again: the commit copies each lane's partial page. */
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, parent, ticket, &err), &err);
    kvpt_assert_ok(kvp_ticket_commit(ticket, parent, &err), &err);
    assert_int_equal(kvpt_stats(pool).cow_copies, before.cow_copies + B);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(child, pool);

    /* At a block boundary (len 8): the ticket stays good across the fork. */
    forward(layer, parent, ticket, B, 2 * BT - (BT + 2), 53);
    assert_int_equal(kvp_cache_len(parent), 2 * BT);
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, parent, ticket, &err), &err);
    kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
    kvpt_assert_ok(kvp_ticket_commit(ticket, parent, &err), &err);
    assert_int_equal(kvp_cache_len(parent), 2 * BT + 1);
    assert_int_equal(kvp_cache_len(child), 2 * BT);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(child, pool);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(parent, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

/*
 * An adopt that lengthens the cache makes a ticket prepared before it
 * stale (its row was computed at the old length); the refusal changes
 * nothing. An adopt that adopts nothing (a miss) leaves the ticket good.
 */
static void test_share_txn_ticket_before_adopt_is_stale(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 16);
    kvp_layer *layer = kvpt_random_layer(D, HEADS, POSITIONS, BASE, 60);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *source = kvpt_cache(pool, &binding, 1, POSITIONS);
    kvp_ticket *source_ticket = kvpt_ticket(source);
    forward(layer, source, source_ticket, 1, BT, 61);
    kvp_block_key key = key_of(source, 0, 62);
    kvpt_assert_ok(kvp_cache_publish_block(source, 0, 0, &key, &err), &err);

    kvp_cache *cache = kvpt_cache(pool, &binding, 1, POSITIONS);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double x[D];
    kvpt_fill_random(x, D, 63);
    kvp_tensor in = kvp_tensor3(x, 1, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, cache, ticket, &err), &err);
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(cache, &key, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 1);
    kvp_pool_stats before = kvpt_stats(pool);
    uint64_t digest = digest_of(cache);
    kvp_error e;
    memset(&e, 0, sizeof e);
    assert_int_equal(kvp_ticket_commit(ticket, cache, &e), KVP_TICKET_STALE);
    assert_int_equal(e.prepared_len, 0);
    assert_int_equal(e.current_len, BT);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&after, &before, sizeof after);
    assert_int_equal(digest_of(cache), digest);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);

    /* A miss adopts nothing and changes no length: the ticket commits. */
    kvpt_assert_ok(kvp_attention_prepare(layer, &in, cache, ticket, &err), &err);
    kvp_block_key unknown = key_of(source, 0, 64);
    kvpt_assert_ok(kvp_cache_adopt_prefix(cache, &unknown, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 0);
    kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
    assert_int_equal(kvp_cache_len(cache), BT + 1);
    kvpt_assert_pool_ok(pool);

    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_ticket(source_ticket, pool);
    kvpt_destroy_cache(source, pool);
    kvpt_destroy_layer(layer);
    destroy_cached_pool(pool);
}

/* ---- copy-on-write in every lane ------------------------------------------------------- */

/* FNV-1a over the first `rows` slots (keys, then values) of every head of a held page. */
static uint64_t page_digest(kvp_pool *pool, uint32_t page, size_t rows)
{
    const void *k = NULL;
    const void *v = NULL;
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_page_data(pool, page, &k, &v, &layout, &err), &err);
    uint64_t hash = 0xcbf29ce484222325ull;
    const unsigned char *halves[2] = {k, v};
    for (size_t half = 0; half < 2; half++) {
        for (size_t h = 0; h < layout.heads; h++) {
            const unsigned char *bytes = halves[half] + h * layout.head_stride_bytes;
            for (size_t i = 0; i < rows * layout.row_stride_bytes; i++) {
                hash = (hash ^ bytes[i]) * 0x100000001b3ull;
            }
        }
    }
    return hash;
}

static uint32_t page_at(const kvp_cache *cache, size_t lane, size_t block)
{
    uint32_t page = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_page(cache, lane, block, &page, &err), &err);
    return page;
}

/*
 * A batch-3 cache forked mid-block: the child's append copies the partial
 * page of every lane (3 copies), not lane 0's alone; the full block stays
 * shared; the parent's pages keep their ids and bytes and its rows; the
 * child's rows before the fork equal the parent's. Then the parent appends
 * and copies its 3 lanes too.
 */
static void test_share_txn_copy_on_write_copies_every_lane(void **state)
{
    (void)state;
    enum { B = 3, LEN = BT + 2 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 32);
    kvp_layer *layer = kvpt_random_layer(D, HEADS, POSITIONS, BASE, 70);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *parent = kvpt_cache(pool, &binding, B, POSITIONS);
    kvp_ticket *ticket = kvpt_ticket(parent);
    forward(layer, parent, ticket, B, LEN, 71);
    uint32_t shared[B];
    uint32_t partial[B];
    uint64_t bytes[B];
    for (size_t lane = 0; lane < B; lane++) {
        shared[lane] = page_at(parent, lane, 0);
        partial[lane] = page_at(parent, lane, 1);
        bytes[lane] = page_digest(pool, partial[lane], LEN - BT);
    }
    uint64_t parent_digest = digest_of(parent);
    enum { ROWS = B * HEADS * LEN * HD };
    static double parent_keys[ROWS];
    static double child_keys[ROWS];
    kvpt_assert_ok(kvp_cache_keys(parent, parent_keys, ROWS, &err), &err);
    kvp_cache *child = NULL;
    kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
    uint64_t copies = kvpt_stats(pool).cow_copies;
    kvp_ticket *child_ticket = kvpt_ticket(child);
    forward(layer, child, child_ticket, B, 1, 72);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cow_copies, copies + B);
    for (size_t lane = 0; lane < B; lane++) {
        assert_int_equal(page_at(child, lane, 0), shared[lane]);
        assert_int_not_equal(page_at(child, lane, 1), partial[lane]);
        assert_int_equal(page_at(parent, lane, 1), partial[lane]);
        assert_int_equal(page_digest(pool, partial[lane], LEN - BT), bytes[lane]);
    }
    assert_int_equal(digest_of(parent), parent_digest);
    static double child_all[B * HEADS * (LEN + 1) * HD];
    kvpt_assert_ok(kvp_cache_keys(child, child_all, KVPT_COUNT_OF(child_all), &err), &err);
    for (size_t row = 0; row < B * HEADS; row++) {
        memcpy(child_keys + row * LEN * HD, child_all + row * (LEN + 1) * HD,
               LEN * HD * sizeof(double));
    }
    assert_memory_equal(child_keys, parent_keys, sizeof parent_keys);

    /* The parent is still marked: its append copies its 3 lanes too. */
    forward(layer, parent, ticket, B, 1, 73);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cow_copies, copies + 2 * B);
    for (size_t lane = 0; lane < B; lane++) {
        assert_int_not_equal(page_at(parent, lane, 1), partial[lane]);
        assert_int_not_equal(page_at(parent, lane, 1), page_at(child, lane, 1));
        assert_int_equal(page_at(parent, lane, 0), shared[lane]);
    }
    kvpt_destroy_ticket(child_ticket, pool);
    kvpt_destroy_cache(child, pool);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(parent, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

/* The same for a sequence of 2 layers and 2 lanes: a step of the fork copies every (layer, lane). */
static void test_share_txn_sequence_fork_copies_every_layer_and_lane(void **state)
{
    (void)state;
    enum { L = 2, B = 2, LEN = BT + 1 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 32);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 80);
    kvp_sequence *parent = kvpt_sequence(model, pool, B, POSITIONS);
    double prompt[B * LEN * D];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 81);
    kvp_tensor view = kvp_tensor3(prompt, B, LEN, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(parent, &view, NULL, NULL, NULL, 0, &err), &err);
    uint32_t partial[L][B];
    uint64_t bytes[L][B];
    for (size_t l = 0; l < L; l++) {
        for (size_t lane = 0; lane < B; lane++) {
            partial[l][lane] = page_at(kvp_sequence_cache(parent, l), lane, 1);
            bytes[l][lane] = page_digest(pool, partial[l][lane], LEN - BT);
        }
    }
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    assert_int_equal(kvp_sequence_pages_for(child, LEN + 1), L * B);
    uint64_t copies = kvpt_stats(pool).cow_copies;
    double x[B * D];
    kvpt_fill_random(x, B * D, 82);
    kvp_tensor one = kvp_tensor3(x, B, 1, D);
    double out[B * D];
    kvpt_assert_ok(kvp_sequence_step(child, &one, NULL, NULL, out, B * D, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).cow_copies, copies + L * B);
    for (size_t l = 0; l < L; l++) {
        for (size_t lane = 0; lane < B; lane++) {
            assert_int_not_equal(page_at(kvp_sequence_cache(child, l), lane, 1),
                                 partial[l][lane]);
            assert_int_equal(page_at(kvp_sequence_cache(parent, l), lane, 1), partial[l][lane]);
            assert_int_equal(page_digest(pool, partial[l][lane], LEN - BT), bytes[l][lane]);
        }
    }
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);
}

/*
 * A copy-on-write mark outlives the other side's release (DESIGN.md,
 * Sharing), so a prefill that fails before committing a row (in its first
 * block) must leave it: the next token still needs its copies. The roll-back
 * used to truncate to the same length, which recomputes the marks, and the
 * mark was gone (pages_for one less copy per lane; found by fuzz_api).
 */
static void test_share_txn_failed_prefill_keeps_cow_mark(void **state)
{
    (void)state;
    enum { L = 2, B = 2, LEN = BT + 1, T = 3 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 32);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 90);
    kvp_sequence *parent = kvpt_sequence(model, pool, B, POSITIONS);
    double prompt[B * LEN * D];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 91);
    kvp_tensor view = kvp_tensor3(prompt, B, LEN, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(parent, &view, NULL, NULL, NULL, 0, &err), &err);
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    kvpt_destroy_sequence(parent, pool); /* the child's partial pages are its own now */
    assert_int_equal(kvp_sequence_pages_for(child, LEN + 1), L * B);
    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, child);
    kvpt_snapshot_take(&before);
    double x[B * T * D];
    kvpt_fill_random(x, KVPT_COUNT_OF(x), 92);
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + D, huge, sizeof huge); /* lane 0, token 1: its score overflows */
    kvp_tensor rest = kvp_tensor3(x, B, T, D);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(child, &rest, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 1);
    kvpt_assert_unchanged(&before, 0);
    assert_int_equal(kvp_sequence_pages_for(child, LEN + 1), L * B);
    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);
}

/* kvp_pool_check's findings, all of them I5 (PREFIX); returns how many. */
static size_t prefix_findings(kvp_pool *pool)
{
    kvpt_findings found;
    memset(&found, 0, sizeof found);
    kvp_error err;
    assert_int_equal(kvp_pool_check(pool, kvpt_collect_finding, &found, &err), KVP_AUDIT_FAILED);
    for (size_t i = 0; i < found.count && i < KVPT_FINDINGS_KEPT; i++) {
        assert_int_equal(found.items[i].invariant, KVP_INVARIANT_PREFIX);
    }
    return found.count;
}

/*
 * The one writer: a batch-2 external cache of 6 rows (a partial second
 * block) forked twice by kvpi_cache_fork_writer_locked. The parent's next
 * row takes no page and lands in its own partial page (shared, refcount 3);
 * each child's first row copies it (2 lanes each): 4 copies for 3 caches,
 * not 6, and every cache's rows below 6 stay equal. The audit is clean
 * after every call; a second unmarked holder, or a writer shorter than a
 * holder, is an I5 finding.
 */
static void test_share_txn_fork_writer_appends_in_place(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, 16);
    kvp_binding b = external_binding();
    kvp_cache *parent = kvpt_cache(pool, &b, 2, POSITIONS);
    kvp_cache *child[2] = {kvpt_cache(pool, &b, 2, POSITIONS), kvpt_cache(pool, &b, 2, POSITIONS)};
    append(parent, 2, 6, 41);
    uint32_t shared[2] = {page_at(parent, 0, 1), page_at(parent, 1, 1)};
    kvpi_pool_lock(pool);
    kvpi_cache_fork_writer_locked(parent, child[0]);
    kvpi_cache_fork_writer_locked(parent, child[1]);
    kvpi_pool_unlock(pool);
    kvpt_assert_pool_ok(pool);
    uint64_t copies = kvpt_stats(pool).cow_copies;
    assert_int_equal(kvp_cache_pages_for(parent, 7), 0);
    assert_int_equal(kvp_cache_pages_for(child[0], 7), 2);

    /* A second writer, or a writer shorter than a holder, breaks I5. */
    kvpi_pool_lock(pool);
    child[0]->cow = 0;
    kvpi_pool_unlock(pool);
    assert_true(prefix_findings(pool) >= 2);
    kvpi_pool_lock(pool);
    child[0]->cow = 1;
    parent->len = 5; /* still 2 blocks mapped: only I5 can tell */
    kvpi_pool_unlock(pool);
    assert_true(prefix_findings(pool) >= 2);
    kvpi_pool_lock(pool);
    parent->len = 6;
    kvpi_pool_unlock(pool);
    kvpt_assert_pool_ok(pool);

    append(parent, 2, 1, 42); /* in place: the same pages, no copy */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(page_at(parent, 0, 1), shared[0]);
    assert_int_equal(page_at(parent, 1, 1), shared[1]);
    assert_int_equal(kvpt_stats(pool).cow_copies, copies);
    for (size_t c = 0; c < 2; c++) {
        append(child[c], 2, 1, 43 + c); /* copies both lanes */
        kvpt_assert_pool_ok(pool);
        assert_int_equal(kvpt_stats(pool).cow_copies, copies + 2 * (c + 1));
        assert_true(page_at(child[c], 0, 1) != shared[0]);
        assert_true(page_at(child[c], 1, 1) != shared[1]);
    }
    /* Rows 0..5 are the parent's in every cache; row 6 each one's own. */
    double kp[2 * HEADS * 7 * HD];
    double kc[2 * HEADS * 7 * HD];
    kvp_error err;
    for (size_t c = 0; c < 2; c++) {
        kvpt_assert_ok(kvp_cache_keys(parent, kp, sizeof kp / sizeof kp[0], &err), &err);
        kvpt_assert_ok(kvp_cache_keys(child[c], kc, sizeof kc / sizeof kc[0], &err), &err);
        for (size_t lane = 0; lane < 2; lane++) {
            for (size_t h = 0; h < HEADS; h++) {
                size_t at = ((lane * HEADS + h) * 7) * HD;
                assert_memory_equal(kp + at, kc + at, 6 * HD * sizeof(double));
                assert_memory_not_equal(kp + at + 6 * HD, kc + at + 6 * HD, HD * sizeof(double));
            }
        }
    }
    kvpt_destroy_cache(child[1], pool);
    kvpt_destroy_cache(child[0], pool);
    kvpt_destroy_cache(parent, pool);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_txn_borrowed_pages_hidden_then_restored),
        cmocka_unit_test(test_share_txn_interleaved_cancels_restore_the_lru_order),
        cmocka_unit_test(test_share_txn_mapped_borrowed_pages_are_evicted),
        cmocka_unit_test(test_share_txn_key_published_while_borrowed_wins),
        cmocka_unit_test(test_share_txn_page_not_held_names_evictable_pages),
        cmocka_unit_test(test_share_txn_ticket_before_fork_is_stale),
        cmocka_unit_test(test_share_txn_ticket_before_adopt_is_stale),
        cmocka_unit_test(test_share_txn_copy_on_write_copies_every_lane),
        cmocka_unit_test(test_share_txn_sequence_fork_copies_every_layer_and_lane),
        cmocka_unit_test(test_share_txn_failed_prefill_keeps_cow_mark),
        cmocka_unit_test(test_share_txn_fork_writer_appends_in_place),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
