/*
 * nothing_changed_support.h: what the test_nothing_changed*.c programs share
 * (the table of every public function's failing calls is in
 * test_nothing_changed.c). The world: a pool with a sequence (2 layers,
 * batch 2, 3 tokens prefilled, 2 pages promised), a standalone cache bound
 * to layer 0 with 4 tokens, a ticket holding a prepared row and its
 * reserved page, and parameters, all registered with a kvpt_snapshot; in
 * the "cached" runs (CACHED_TEST, cached_world) the pool has no free page
 * and its LRU list holds cached pages. EXPECT_FAIL checks one failing call:
 * its typed status (returned and in *err), the snapshot and the prefix
 * cache (prefix_state) unchanged but for the exhaustions given; EXPECT_NOOP
 * a destroy of NULL; sweep() fails the Nth hooked allocation for every N
 * until the call succeeds. Everything is static inline (cached_world, the
 * cached-run flag, is static: one per program). Included only by
 * tests/test_nothing_changed*.c (unit tests with pager/alloc.h and
 * pager/pool_internal.h).
 */
#ifndef KVPT_NOTHING_CHANGED_SUPPORT_H
#define KVPT_NOTHING_CHANGED_SUPPORT_H

#include "support.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/alloc.h"
#include "pager/pool_internal.h"

enum { L = 2, D = 4, HEADS = 2, HD = 2, BT = 2, POSITIONS = 16, PAGES = 16 };
enum { B = 2, C = 8, PREFILLED = 3, CACHE_B = 1, CACHE_C = 6, CACHE_LEN = 4 };

#define BASE 10000.0
#define SWEEP_LIMIT 200
#define SENTINEL ((void *)0x5A5A)

typedef struct world {
    kvp_pool *pool;
    kvp_model *model;
    const kvp_layer *layer; /* layer 0 of the model */
    kvp_sequence *seq;
    kvp_cache *cache;       /* CACHE_B x CACHE_C, bound to layer 0, CACHE_LEN rows */
    kvp_ticket *ticket;     /* committed the cache's rows; empty-able */
    kvp_ticket *held;       /* holds a prepared row for the cache and its reserved page */
    kvp_param *param;
    kvp_param *narrow;      /* D x HD: an MQA layer's W_k and W_v */
    kvpt_snapshot snap;
    size_t failures;        /* failing calls checked */
    kvp_binding ext;        /* an external binding of the pool's geometry */
    size_t lru_pages;       /* the cached world's evictable pages, published under lru_keys */
    kvp_block_key lru_keys[PAGES];
} world;

/*
 * Set for the "cached" runs of the world's tests (issue 16): world_make then
 * leaves no free page, and the LRU list holds cached pages, so every call
 * that takes a page borrows one from it.
 */
static int cached_world;

static inline void row_input(double *out, size_t batch, size_t tokens, uint64_t seed)
{
    kvpt_fill_random(out, batch * tokens * D, seed);
}

/*
 * The cached world: every free page gets a published block (an external
 * cache's, each lane its own key) and goes to the LRU list when that cache
 * is destroyed; block 0 of the world's cache is published too (a cached
 * page that is held).
 */
static inline void world_cache_prefixes(world *w)
{
    kvp_error err;
    size_t pages = kvpt_stats(w->pool).free_pages;
    kvp_cache *publisher = kvpt_cache(w->pool, &w->ext, pages, BT);
    size_t n = pages * HEADS * BT * HD;
    double *rows = kvpt_doubles(n);
    kvpt_fill_random(rows, n, 80);
    kvpt_assert_ok(kvp_cache_append_rows(publisher, rows, rows, BT, &err), &err);
    for (size_t lane = 0; lane < pages; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, publisher, &lane, sizeof lane, NULL,
                                           &w->lru_keys[lane], &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &w->lru_keys[lane], &err),
                       &err);
    }
    kvp_block_key held;
    kvpt_assert_ok(kvp_block_key_chain(NULL, w->cache, "held", 4, NULL, &held, &err), &err);
    kvpt_assert_ok(kvp_cache_publish_block(w->cache, 0, 0, &held, &err), &err);
    kvpt_destroy_cache(publisher, w->pool);
    free(rows);
    kvp_pool_stats s = kvpt_stats(w->pool);
    assert_int_equal(s.free_pages, 0);
    assert_int_equal(s.evictable_pages, pages);
    assert_int_equal(s.cached_pages, pages + 1);
    w->lru_pages = pages;
}

static inline void world_make(world *w)
{
    memset(w, 0, sizeof *w);
    kvp_error err;
    w->pool = kvpt_pool(BT, HEADS, HD, PAGES);
    w->model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 11);
    w->layer = kvp_model_layer(w->model, 0);
    w->seq = kvpt_sequence(w->model, w->pool, B, C);
    double prompt[B * PREFILLED * D];
    row_input(prompt, B, PREFILLED, 12);
    kvp_tensor view = kvp_tensor3(prompt, B, PREFILLED, D);
    kvpt_assert_ok(kvp_sequence_prefill(w->seq, &view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_ok(kvp_sequence_promise(w->seq, 2, &err), &err);

    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(w->layer, &binding, &err), &err);
    w->cache = kvpt_cache(w->pool, &binding, CACHE_B, CACHE_C);
    w->ticket = kvpt_ticket(w->cache);
    w->held = kvpt_ticket(w->cache);
    for (size_t t = 0; t <= CACHE_LEN; t++) {
        double x[CACHE_B * D];
        row_input(x, CACHE_B, 1, 20 + t);
        kvp_tensor in = kvp_tensor3(x, CACHE_B, 1, D);
        if (t < CACHE_LEN) {
            kvpt_assert_ok(kvp_attention_forward(w->layer, &in, w->cache, w->ticket, &err), &err);
        } else {
            kvpt_assert_ok(kvp_attention_prepare(w->layer, &in, w->cache, w->held, &err), &err);
        }
    }
    double values[D * D];
    kvpt_fill_random(values, D * D, 30);
    kvpt_assert_ok(kvp_param_create(D, values, &w->param, &err), &err);
    kvpt_assert_ok(kvp_param_create_matrix(D, HD, values, &w->narrow, &err), &err);
    kvpt_assert_ok(kvp_binding_init_external(&w->ext, HEADS, HD, POSITIONS, 1, 2, &err), &err);
    if (cached_world) {
        world_cache_prefixes(w);
    }

    kvpt_snapshot_init(&w->snap, w->pool);
    kvpt_snapshot_add_cache(&w->snap, w->cache);
    kvpt_snapshot_add_sequence(&w->snap, w->seq);
    kvpt_snapshot_add_param(&w->snap, w->param);
    kvpt_snapshot_add_param(&w->snap, w->narrow);
    kvpt_snapshot_add_ticket(&w->snap, w->ticket);
    kvpt_snapshot_add_ticket(&w->snap, w->held);
    kvpt_snapshot_take(&w->snap);
    /* The world is not idle: pages held, promised and reserved. */
    assert_int_equal(w->snap.stats.promised_pages, 2);
    assert_int_equal(w->snap.stats.attached_reservations, 1);
    assert_true(w->snap.stats.high_water_pages >= w->snap.stats.held_pages);
}

/* Destroys a pool whose pages are all free or evictable (cached, no table names them). */
static inline void destroy_cached_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.free_pages + stats.evictable_pages, stats.total_pages);
    assert_int_equal(stats.attached_caches, 0);
    assert_int_equal(stats.attached_reservations, 0);
    assert_int_equal(stats.promised_pages, 0);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

static inline void world_free(world *w)
{
    kvp_error err;
    kvpt_assert_ok(kvp_param_release(w->param, &err), &err);
    kvpt_assert_ok(kvp_param_release(w->narrow, &err), &err);
    kvpt_destroy_ticket(w->held, w->pool);
    kvpt_destroy_ticket(w->ticket, w->pool);
    kvpt_destroy_cache(w->cache, w->pool);
    kvpt_destroy_sequence(w->seq, w->pool);
    kvpt_destroy_model(w->model);
    destroy_cached_pool(w->pool);
    assert_true(w->failures > 0);
}

/* The status was returned, written to *err, and is not OK. */
static inline void check_status_at(kvp_status got, const kvp_error *e, kvp_status expected,
                                   const char *call, const char *file, int line)
{
    if (got != expected || e->status != expected) {
        print_error("%s:%d: %s returned %s (err %s), expected %s\n", file, line, call,
                    kvp_status_name(got), kvp_status_name(e->status), kvp_status_name(expected));
        fail();
    }
}

/* ---- the prefix cache ------------------------------------------------------------ */

/*
 * What a failed or cancelled call must leave of the prefix cache as it was
 * (issue 16): a digest of the index (slot, page, key and state of every
 * entry: a key lost, moved, hidden or added shows), the LRU list from head
 * to tail, and the cached, evictable and evictions counters. Read under the
 * pool lock from the internals (pager/pool_internal.h).
 */
typedef struct prefix_state {
    uint64_t index_digest;
    size_t entries;
    uint64_t lru_digest;
    size_t lru_length;
    size_t cached;
    size_t evictable;
    uint64_t evictions;
} prefix_state;

static inline uint64_t mix64(uint64_t hash, uint64_t value)
{
    for (int i = 0; i < 8; i++) {
        hash = (hash ^ ((value >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    }
    return hash;
}

static inline prefix_state prefix_state_of(kvp_pool *pool)
{
    prefix_state s;
    memset(&s, 0, sizeof s);
    s.index_digest = 0xcbf29ce484222325ull;
    s.lru_digest = 0xcbf29ce484222325ull;
    kvpi_pool_lock(pool);
    for (size_t i = 0; i < pool->index_slots; i++) {
        uint32_t page = pool->index[i];
        if (page == KVPI_NO_PAGE) {
            continue;
        }
        s.entries++;
        s.index_digest = mix64(s.index_digest, i);
        s.index_digest = mix64(s.index_digest, page);
        s.index_digest = mix64(s.index_digest, pool->page_key[page].lo);
        s.index_digest = mix64(s.index_digest, pool->page_key[page].hi);
        s.index_digest = mix64(s.index_digest, pool->registered[page]);
    }
    for (uint32_t p = pool->lru_head; p != KVPI_NO_PAGE && s.lru_length <= pool->total_pages;
         p = pool->lru_next[p]) {
        s.lru_length++;
        s.lru_digest = mix64(s.lru_digest, p);
    }
    s.cached = pool->cached;
    s.evictable = pool->evictable;
    s.evictions = pool->evictions;
    kvpi_pool_unlock(pool);
    return s;
}

#define assert_prefix_unchanged(before, pool) \
    assert_prefix_unchanged_at((before), (pool), __FILE__, __LINE__)
static inline void assert_prefix_unchanged_at(const prefix_state *before, kvp_pool *pool,
                                              const char *file, int line)
{
    prefix_state now = prefix_state_of(pool);
    const char *what = NULL;
    if (now.entries != before->entries || now.index_digest != before->index_digest) {
        what = "prefix index (slot, page, key, state of each entry)";
    } else if (now.lru_length != before->lru_length || now.lru_digest != before->lru_digest) {
        what = "LRU order";
    } else if (now.cached != before->cached || now.evictable != before->evictable) {
        what = "cached or evictable pages";
    } else if (now.evictions != before->evictions) {
        what = "evictions";
    }
    if (what != NULL) {
        print_error("%s:%d: %s changed (entries %zu -> %zu, LRU %zu -> %zu, cached %zu -> %zu, "
                    "evictable %zu -> %zu, evictions %llu -> %llu)\n",
                    file, line, what, before->entries, now.entries, before->lru_length,
                    now.lru_length, before->cached, now.cached, before->evictable, now.evictable,
                    (unsigned long long)before->evictions, (unsigned long long)now.evictions);
        fail();
    }
}

/*
 * One failing call, `call`, which must pass `&e` as its kvp_error. Asserts
 * the status and that the world's snapshot and prefix cache are unchanged
 * except for `exhaustions` more exhaustions.
 */
/*
 * Destroying NULL is a no-op (as free(NULL)): KVP_OK, nothing changed, and
 * the kvp_error left as it was.
 */
#define EXPECT_NOOP(w, call)                                                            \
    do {                                                                                \
        kvpt_snapshot before_ = (w)->snap;                                              \
        kvpt_snapshot_take(&before_);                                                   \
        prefix_state prefix_ = prefix_state_of((w)->pool);                              \
        kvp_error e;                                                                    \
        memset(&e, 0x5A, sizeof e);                                                     \
        const kvp_error untouched_ = e;                                                 \
        assert_int_equal((call), KVP_OK);                                               \
        assert_memory_equal(&e, &untouched_, sizeof e);                                 \
        kvpt_assert_unchanged(&before_, 0);                                             \
        assert_prefix_unchanged(&prefix_, (w)->pool);                                   \
    } while (0)

#define EXPECT_FAIL(w, expected, exhaustions, call)                                     \
    do {                                                                                \
        kvpt_snapshot before_ = (w)->snap;                                              \
        kvpt_snapshot_take(&before_);                                                   \
        prefix_state prefix_ = prefix_state_of((w)->pool);                              \
        kvp_error e;                                                                    \
        memset(&e, 0x5A, sizeof e);                                                     \
        kvp_status got_ = (call);                                                       \
        check_status_at(got_, &e, (expected), #call, __FILE__, __LINE__);               \
        kvpt_assert_unchanged(&before_, (exhaustions));                                 \
        assert_prefix_unchanged(&prefix_, (w)->pool);                                   \
        (w)->failures++;                                                                \
    } while (0)

/* ---- allocation sweeps --------------------------------------------------------- */

/* A call that may allocate: makes an object into *out, or fails; destroy undoes it. */
typedef struct sweep_call {
    kvp_status (*make)(world *w, void **out, kvp_error *err);
    void (*destroy)(world *w, void *object);
} sweep_call;

/*
 * Fails the Nth hooked allocation for N = 1, 2, ... until the call succeeds.
 * Each failure: AllocationFailed, *out untouched, the world unchanged.
 * Returns the number of failing N (at least `min_failures`).
 */
static inline uint64_t sweep(world *w, const sweep_call *call, uint64_t min_failures)
{
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvpt_snapshot before = w->snap;
        kvpt_snapshot_take(&before);
        prefix_state prefix = prefix_state_of(w->pool);
        void *out = SENTINEL;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, call->make(w, &out, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_ptr_not_equal(out, SENTINEL);
            call->destroy(w, out);
            kvpt_assert_unchanged(&before, 0);
            break;
        }
        failures++;
        w->failures++;
        kvpt_assert_fault_failed(&s, nth);
        assert_ptr_equal(out, SENTINEL);
        kvpt_assert_unchanged(&before, 0);
        assert_prefix_unchanged(&prefix, w->pool);
    }
    assert_true(failures >= min_failures);
    return failures;
}

static inline void bump(void *ctx, double *values, size_t width)
{
    (void)ctx;
    values[0] += (double)width;
}

/*
 * Fills the pool's free and evictable pages with a cache of its own (the
 * evictable ones evicted); returns it.
 */
static inline kvp_cache *fill_pool(world *w, kvp_ticket **ticket)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(w->layer, &binding, &err), &err);
    kvp_pool_stats stats = kvpt_stats(w->pool);
    size_t free_pages = stats.free_pages + stats.evictable_pages;
    kvp_cache *filler = kvpt_cache(w->pool, &binding, free_pages, BT);
    *ticket = kvpt_ticket(filler);
    double *x = kvpt_doubles(free_pages * D);
    kvp_tensor in = kvp_tensor3(x, free_pages, 1, D);
    kvpt_assert_ok(kvp_attention_forward(w->layer, &in, filler, *ticket, &err), &err);
    free(x);
    assert_int_equal(kvpt_stats(w->pool).free_pages, 0);
    assert_int_equal(kvpt_stats(w->pool).evictable_pages, 0);
    return filler;
}

static inline int cached_setup(void **state)
{
    (void)state;
    cached_world = 1;
    return 0;
}

static inline int cached_teardown(void **state)
{
    cached_world = 0;
    return kvpt_disarm(state);
}

/* A world test again in the cached world (free list empty, LRU list holding cached pages). */
#define CACHED_TEST(f) {"cached: " #f, f, cached_setup, cached_teardown, NULL}

#endif /* KVPT_NOTHING_CHANGED_SUPPORT_H */
