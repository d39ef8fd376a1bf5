/*
 * test_nothing_changed.c: every failing call of every public function changes
 * nothing (status.h's contract).
 *
 * Each test builds a small world — a pool with a sequence (2 layers, batch 2,
 * 3 tokens prefilled, 2 pages promised), a standalone cache bound to layer 0
 * with 4 tokens, a ticket holding a prepared row and its reserved page, and a
 * parameter — and registers all of it with a kvpt_snapshot (support.h): pool
 * stats (acquires, releases, high water, ...), the slab digest, the audit,
 * every cache's info and digest, the sequence's length, held and promised
 * pages, the parameter's id, revision and values, and the tickets' results.
 * EXPECT_FAIL snapshots, makes one failing call, checks its typed status (in
 * the return value and in *err) and then that the snapshot is unchanged;
 * only POOL_EXHAUSTED may add one to the exhaustions counter. Out-parameters
 * start as sentinels and must still hold them. Allocating functions are
 * swept: the Nth hooked allocation fails, for every N until the call
 * succeeds (pager/alloc.h), each failure checked the same way.
 *
 * The table: every function of the headers in include/kvpager/, and its failing calls here.
 *
 *   status.h    kvp_status_name, kvp_status_message, kvp_error_format,
 *               kvp_mismatch_format                      infallible (pure)
 *   types.h     kvp_tensor3, kvp_tensor4                 infallible (pure)
 *   kvpager.h   kvp_version, kvp_version_number        infallible (pure)
 *   pool.h      kvp_pool_config_init                     infallible (NULL ignored)
 *               kvp_dtype_name, kvp_dtype_bytes          infallible (pure)
 *               kvp_pool_create INVALID_ARGUMENT (dtype): test_dtype.c
 *               kvp_pool_create      NULL x2, ZERO_SIZE x4, SIZE_OVERFLOW x2,
 *                                    BUDGET_TOO_SMALL, ALLOCATION_FAILED (sweep)
 *               kvp_pool_destroy     NULL, POOL_BUSY
 *               kvp_pool_stats_get   NULL x2
 *               kvp_pool_check       NULL, AUDIT_FAILED (planted mismatch)
 *               kvp_pool_admit       NULL x2
 *               kvp_pool_pages_for   infallible (saturates; test_pool.c)
 *               kvp_pool_digest      NULL x2
 *   cache.h     kvp_cache_create     NULL x3, INVALID_ARGUMENT x5 (two on kv_heads,
 *                                    one on an fp8 scale),
 *                                    ZERO_BATCH_SIZE, ZERO_CAPACITY,
 *                                    CAPACITY_EXCEEDS_POSITIONS, ELEMENT_COUNT_OVERFLOW,
 *                                    GEOMETRY_MISMATCH x2 (one on kv_heads),
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_cache_destroy, kvp_cache_reset        NULL
 *               kvp_cache_info_get, kvp_cache_digest      NULL x2
 *               kvp_cache_keys, kvp_cache_values          NULL x2, BUFFER_TOO_SMALL
 *               kvp_cache_page       NULL x2, OUT_OF_RANGE x2
 *               kvp_cache_len, _capacity, _is_empty, _is_full   infallible
 *               kvp_binding_init_external  NULL, ZERO_SIZE x3, INVALID_ARGUMENT
 *               kvp_cache_append_rows NULL x3, CACHE_LAYER_BOUND, ROWS_RESERVED, FULL,
 *                                    NONFINITE_KEY, NONFINITE_VALUE, POOL_EXHAUSTED
 *               kvp_cache_reserve_rows NULL, CACHE_LAYER_BOUND, ROWS_RESERVED, FULL,
 *                                    POOL_EXHAUSTED
 *               kvp_cache_commit_rows NULL x3, CACHE_LAYER_BOUND, ROWS_NOT_RESERVED x2,
 *                                    NONFINITE_KEY, NONFINITE_VALUE (reservation kept)
 *               kvp_cache_discard_rows NULL;  kvp_cache_promise  NULL,
 *                                    CACHE_LAYER_BOUND, OUT_OF_RANGE
 *               kvp_cache_block_table NULL x3, OUT_OF_RANGE
 *               kvp_binding_is_external, kvp_cache_reserved_rows, _promised_pages,
 *               _pages_for                               infallible
 *   (pool.h)    kvp_pool_page_data   NULL x3, OUT_OF_RANGE, PAGE_NOT_HELD
 *               kvp_pool_page_layout_get NULL x2
 *               (none of them allocates: no sweep)
 *   param.h     kvp_param_create     NULL x2, INVALID_ARGUMENT x2, ALLOCATION_FAILED
 *               kvp_param_create_matrix  NULL x2, INVALID_ARGUMENT x3, ALLOCATION_FAILED
 *               kvp_param_retain, kvp_param_release       NULL
 *               kvp_param_update, kvp_param_update_with   NULL x2
 *               kvp_param_id, _revision, _width, _values  infallible
 *   rope.h      kvp_rope_validate    NULL, ROPE_INVALID_WIDTH x2, ROPE_ZERO_POSITIONS,
 *                                    ROPE_INVALID_BASE x6 (0, -1, NaN, inf, 5e-324,
 *                                    1e-300 with many positions)
 *               kvp_rope_rotate      the same, NULL features, ROPE_POSITION_OUT_OF_RANGE
 *   layer.h     kvp_layer_create     NULL x5, PARAMETER_WIDTH_MISMATCH,
 *                                    HEADS_DO_NOT_DIVIDE_WIDTH x2, ROPE_* x3,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_random  NULL, INVALID_ARGUMENT x2, HEADS, ROPE,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS x2,
 *                                    PARAMETER_WIDTH_MISMATCH x2 (rows, K/V columns),
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_random_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_destroy    NULL
 *               kvp_layer_info_get, kvp_layer_binding_get     NULL x2
 *               kvp_layer_set_kv_scales  NULL, INVALID_ARGUMENT x2 (k_scale, v_scale)
 *               kvp_layer_param, kvp_layer_param_mut   infallible (NULL out of range)
 *   attention.h kvp_ticket_create    NULL x2, INVALID_ARGUMENT (a record not
 *                                    attention's), ALLOCATION_FAILED (sweep)
 *               kvp_ticket_destroy, kvp_ticket_discard    NULL
 *               kvp_ticket_commit    NULL x2, TICKET_EMPTY, TICKET_FOREIGN_CACHE,
 *                                    TICKET_STALE
 *               kvp_ticket_result    NULL x2, TICKET_EMPTY
 *               kvp_attention_prepare, kvp_attention_forward   NULL x4, INPUT_RANK,
 *                                    SINGLE_TOKEN_REQUIRED, INPUT_BATCH_MISMATCH,
 *                                    INPUT_WIDTH_MISMATCH, CACHE_KV_HEAD_COUNT_MISMATCH,
 *                                    CACHE_LAYER_MISMATCH,
 *                                    CACHE_LAYER_REVISION_MISMATCH, CACHE_ROPE_MISMATCH,
 *                                    FULL, TICKET_BUSY, TICKET_GEOMETRY_MISMATCH,
 *                                    NONFINITE_PROJECTION, NONFINITE_SCORE,
 *                                    POOL_EXHAUSTED
 *               kvp_attention_reference  NULL x3, REFERENCE_INPUT_SHAPE,
 *                                    ROPE_POSITION_OUT_OF_RANGE, BUFFER_TOO_SMALL x2,
 *                                    NONFINITE_PROJECTION, NONFINITE_SCORE,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_attention_reference_stored  the same code; NULL, INVALID_ARGUMENT
 *                                    (dtype), NONFINITE_KEY/VALUE for a bf16 overflow:
 *                                    test_dtype.c (as are prepare's and the raw
 *                                    append's overflow refusals, each snapshot-checked)
 *   model.h     kvp_model_create     NULL x3, INVALID_ARGUMENT, MODEL_GEOMETRY_MISMATCH,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_create_random  NULL, INVALID_ARGUMENT x2, layer errors,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_create with KV heads differing: MODEL_GEOMETRY_MISMATCH
 *               kvp_model_create_random_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_destroy    NULL, MODEL_BUSY;  kvp_model_info_get  NULL x2
 *               kvp_model_layer, kvp_model_param_mut   infallible (NULL out of range)
 *   sequence.h  kvp_sequence_create  NULL x3, ZERO_BATCH_SIZE, ZERO_CAPACITY,
 *                                    CAPACITY_EXCEEDS_POSITIONS, GEOMETRY_MISMATCH,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_sequence_destroy, kvp_sequence_reset  NULL
 *               kvp_sequence_step    NULL x3, BUFFER_TOO_SMALL, INPUT_RANK,
 *                                    NONFINITE_PROJECTION, POOL_EXHAUSTED
 *               kvp_sequence_prefill NULL x2, INPUT_RANK, INPUT_BATCH_MISMATCH,
 *                                    INPUT_WIDTH_MISMATCH, INVALID_ARGUMENT, FULL,
 *                                    BUFFER_TOO_SMALL, NONFINITE_PROJECTION (NaN at
 *                                    token 2), CACHE_LAYER_REVISION_MISMATCH (stale
 *                                    binding), POOL_EXHAUSTED, NONFINITE_SCORE at
 *                                    token 2 (after two computed tokens; see below)
 *               kvp_sequence_promise NULL, OUT_OF_RANGE
 *               kvp_sequence_pages_for, _prefill_pages, _len, _capacity,
 *               _held_pages, _promised_pages, _cache      infallible
 *               kvp_decoder_create   NULL, INVALID_ARGUMENT, ALLOCATION_FAILED (sweep),
 *                                    THREAD_FAILED (test_sweep.c)
 *               kvp_decoder_destroy  NULL;  kvp_decoder_threads  infallible
 *               kvp_decoder_step     NULL x3, INVALID_ARGUMENT (shared sequence),
 *                                    DECODER_BUSY (test_decoder.c)
 *   tier.h      the tier's calls, attach, detach, stats, pack, verify and
 *               kvp_cache_group_tier_load: their refusals, allocation sweeps
 *               and tier failures are snapshot-checked in test_tier.c and
 *               test_tier_async.c (pool, cache, pool and host tier counters)
 *   windows     BLOCK_RELEASED of kvp_cache_truncate (state snapshot) and of
 *               kvp_cache_publish_block, POOL_EXHAUSTED of a windowed step at
 *               its page peak: test_window_pager.c; BLOCK_BINDING_MISMATCH
 *               of a group adopt with sliding caches: test_window_share.c
 *
 * Every check also compares the prefix cache (prefix_state: the index's
 * entries, the LRU order, cached, evictable, evictions), and every world
 * test runs twice: in the "cached" run (CACHED_TEST) the world's pool has no
 * free page and its LRU list holds cached pages, so any page a call takes
 * is borrowed from it and must come back with its key and LRU place.
 * test_nothing_changed_cancelled_takes_keep_cached_pages adds the takes that
 * are cancelled by a second call (reserve + discard, a two-layer step
 * refused at its second layer, a copy-on-write reservation, tickets).
 *
 * The documented exception (sequence.h, DESIGN.md "Sharing"): a prefill
 * that fails after writing rows (past its first block, or token by token)
 * leaves those bytes in pages it gave back (kvp_pool_digest hashes free
 * bytes too), and a page it borrowed from the LRU list and wrote loses its
 * cached block (evicted, counted). Those cases assert exactly that.
 *
 * Unit test: uses pager/alloc.h (fault injector) and pager/pool_internal.h
 * (to plant one audit mismatch).
 */
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

static void row_input(double *out, size_t batch, size_t tokens, uint64_t seed)
{
    kvpt_fill_random(out, batch * tokens * D, seed);
}

/*
 * The cached world: every free page gets a published block (an external
 * cache's, each lane its own key) and goes to the LRU list when that cache
 * is destroyed; block 0 of the world's cache is published too (a cached
 * page that is held).
 */
static void world_cache_prefixes(world *w)
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

static void world_make(world *w)
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
static void destroy_cached_pool(kvp_pool *pool)
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

static void world_free(world *w)
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
static void check_status_at(kvp_status got, const kvp_error *e, kvp_status expected,
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

static uint64_t mix64(uint64_t hash, uint64_t value)
{
    for (int i = 0; i < 8; i++) {
        hash = (hash ^ ((value >> (8 * i)) & 0xff)) * 0x100000001b3ull;
    }
    return hash;
}

static prefix_state prefix_state_of(kvp_pool *pool)
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
static void assert_prefix_unchanged_at(const prefix_state *before, kvp_pool *pool,
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
static uint64_t sweep(world *w, const sweep_call *call, uint64_t min_failures)
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

/* ---- pool.h -------------------------------------------------------------------- */

static void count_mismatch(void *ctx, const kvp_mismatch *m)
{
    (void)m;
    (*(size_t *)ctx)++;
}

static kvp_status make_pool(world *w, void **out, kvp_error *err)
{
    (void)w;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = HEADS;
    config.head_width = HD;
    config.budget_bytes = 4 * 2 * HEADS * BT * HD * sizeof(double);
    config.dtype = KVP_F64;
    return kvp_pool_create(&config, (kvp_pool **)out, err);
}

static void destroy_pool(world *w, void *object)
{
    (void)w;
    kvpt_destroy_pool((kvp_pool *)object);
}

static void test_nothing_changed_pool_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_pool *out = SENTINEL;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_create(NULL, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_create(&config, NULL, &e));
    for (size_t field = 0; field < 4; field++) {
        kvp_pool_config zero = config;
        size_t *sizes[4] = {&zero.block_tokens, &zero.heads, &zero.head_width, &zero.budget_bytes};
        *sizes[field] = 0;
        EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_pool_create(&zero, &out, &e));
    }
    kvp_pool_config huge = config;
    huge.heads = SIZE_MAX / 2;
    EXPECT_FAIL(&w, KVP_SIZE_OVERFLOW, 0, kvp_pool_create(&huge, &out, &e));
    kvp_pool_config many;
    kvp_pool_config_init(&many);
    many.block_tokens = 1;
    many.heads = 1;
    many.head_width = 1;
    many.budget_bytes = (size_t)16 << 32;
    many.dtype = KVP_F64; /* 2^32 pages of 16 bytes */
    EXPECT_FAIL(&w, KVP_SIZE_OVERFLOW, 0, kvp_pool_create(&many, &out, &e));
    kvp_pool_config small = config;
    small.budget_bytes = 1;
    EXPECT_FAIL(&w, KVP_BUDGET_TOO_SMALL, 0, kvp_pool_create(&small, &out, &e));
    assert_ptr_equal(out, SENTINEL);
    sweep_call call = {make_pool, destroy_pool};
    assert_int_equal(sweep(&w, &call, 3), 3);

    EXPECT_NOOP(&w, kvp_pool_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_POOL_BUSY, 0, kvp_pool_destroy(w.pool, &e));

    kvp_pool_stats stats;
    memset(&stats, 0x5A, sizeof stats);
    stats.struct_size = sizeof stats;
    kvp_pool_stats sentinel_stats = stats;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_stats_get(NULL, &stats, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_stats_get(w.pool, NULL, &e));
    assert_memory_equal(&stats, &sentinel_stats, sizeof stats);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_check(NULL, NULL, NULL, &e));

    kvp_admission admission = (kvp_admission)77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_admit(NULL, 1, 0, &admission, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_admit(w.pool, 1, 0, NULL, &e));
    assert_int_equal(admission, 77);

    uint64_t digest = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_digest(NULL, &digest, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_digest(w.pool, NULL, &e));
    assert_int_equal(digest, 77);

    /* A failing audit changes nothing either: plant a high-water mismatch, audit twice. */
    kvp_pool_stats before = kvpt_stats(w.pool);
    uint64_t slab_before = w.snap.pool_digest;
    w.pool->high_water_pages = 0;
    for (int i = 0; i < 2; i++) {
        size_t found = 0;
        kvp_error e;
        assert_int_equal(kvp_pool_check(w.pool, count_mismatch, &found, &e), KVP_AUDIT_FAILED);
        assert_int_equal(found, 1);
        assert_int_equal(e.mismatches, 1);
        assert_int_equal(e.first_mismatch.invariant, KVP_INVARIANT_STATS);
        kvp_pool_stats now = kvpt_stats(w.pool);
        now.high_water_pages = before.high_water_pages;
        assert_memory_equal(&now, &before, sizeof now);
        uint64_t slab_now = 0;
        kvpt_assert_ok(kvp_pool_digest(w.pool, &slab_now, &e), &e);
        assert_int_equal(slab_now, slab_before);
        w.failures++;
    }
    w.pool->high_water_pages = before.high_water_pages;
    world_free(&w);
}

/* ---- cache.h ------------------------------------------------------------------- */

static kvp_status make_cache(world *w, void **out, kvp_error *err)
{
    kvp_binding binding;
    kvp_status status = kvp_layer_binding_get(w->layer, &binding, err);
    if (status == KVP_OK) {
        status = kvp_cache_create(w->pool, &binding, 3, 5, (kvp_cache **)out, err);
    }
    return status;
}

static void destroy_cache(world *w, void *object)
{
    kvpt_destroy_cache((kvp_cache *)object, w->pool);
}

static void test_nothing_changed_cache_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_binding good;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &good, &err), &err);
    kvp_cache *out = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(NULL, &good, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(w.pool, NULL, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(w.pool, &good, 1, 1, NULL, &e));
    kvp_binding no_kind = good;
    no_kind.kind = 0; /* neither KVP_BINDING_LAYER nor KVP_BINDING_EXTERNAL */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &no_kind, 1, 1, &out, &e));
    kvp_binding reserved = good;
    reserved.reserved = 1;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &reserved, 1, 1, &out, &e));
    kvp_binding odd_kv = good;
    odd_kv.kv_heads = 0;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &odd_kv, 1, 1, &out, &e));
    kvp_binding no_width = good;
    no_width.head_width = 0;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &no_width, 1, 1, &out, &e));
    kvp_binding grouped = good;
    grouped.kv_heads = 1; /* valid, but the pool stores HEADS heads per page */
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_cache_create(w.pool, &grouped, 1, 1, &out, &e));
    kvp_binding bad_scale = good;
    bad_scale.v_scale = -1.0; /* fp8 scales: finite, normal and > 0 (or 0) */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_cache_create(w.pool, &bad_scale, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_ZERO_BATCH_SIZE, 0, kvp_cache_create(w.pool, &good, 0, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_ZERO_CAPACITY, 0, kvp_cache_create(w.pool, &good, 1, 0, &out, &e));
    EXPECT_FAIL(&w, KVP_CAPACITY_EXCEEDS_POSITIONS, 0,
                kvp_cache_create(w.pool, &good, 1, POSITIONS + 1, &out, &e));
    kvp_binding many_positions = good;
    many_positions.max_positions = SIZE_MAX;
    EXPECT_FAIL(&w, KVP_ELEMENT_COUNT_OVERFLOW, 0,
                kvp_cache_create(w.pool, &many_positions, SIZE_MAX / 2, 4, &out, &e));
    kvp_binding other = good;
    other.kv_heads = 1;
    other.head_width = D;
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_cache_create(w.pool, &other, 1, 1, &out, &e));
    assert_ptr_equal(out, SENTINEL);
    sweep_call call = {make_cache, destroy_cache};
    assert_int_equal(sweep(&w, &call, 2), 2);

    EXPECT_NOOP(&w, kvp_cache_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_reset(NULL, &e));
    kvp_cache_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_cache_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_info_get(w.cache, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);

    enum { ROWS = CACHE_B * HEADS * CACHE_LEN * HD };
    double rows[ROWS];
    kvpt_fill(rows, ROWS, 7.0);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_keys(NULL, rows, ROWS, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_keys(w.cache, NULL, ROWS, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0, kvp_cache_keys(w.cache, rows, ROWS - 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_values(NULL, rows, ROWS, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_values(w.cache, NULL, ROWS, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0, kvp_cache_values(w.cache, rows, ROWS - 1, &e));
    kvpt_assert_filled(rows, ROWS, 7.0);

    uint32_t page = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_page(NULL, 0, 0, &page, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_page(w.cache, 0, 0, NULL, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_page(w.cache, CACHE_B, 0, &page, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_page(w.cache, 0, CACHE_LEN / BT, &page, &e));
    assert_int_equal(page, 77);
    uint64_t digest = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_digest(NULL, &digest, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_digest(w.cache, NULL, &e));
    assert_int_equal(digest, 77);
    world_free(&w);
}

/* ---- param.h, rope.h, layer.h ------------------------------------------------------ */

static kvp_status make_param(world *w, void **out, kvp_error *err)
{
    (void)w;
    double values[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    return kvp_param_create(3, values, (kvp_param **)out, err);
}

static void destroy_param(world *w, void *object)
{
    (void)w;
    kvp_error err;
    kvpt_assert_ok(kvp_param_release((kvp_param *)object, &err), &err);
}

static kvp_status make_layer(world *w, void **out, kvp_error *err)
{
    return kvp_layer_create(w->param, w->param, w->param, w->param, HEADS, POSITIONS, BASE,
                            (kvp_layer **)out, err);
}

static kvp_status make_random_layer(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_layer_create_random(D, HEADS, POSITIONS, BASE, 5, (kvp_layer **)out, err);
}

static kvp_status make_param_matrix(world *w, void **out, kvp_error *err)
{
    (void)w;
    double values[6] = {1, 2, 3, 4, 5, 6};
    return kvp_param_create_matrix(3, 2, values, (kvp_param **)out, err);
}

/*
 * External caches, block tables and page data (cache.h, pool.h): every
 * failing call of the raw-row API, on an external cache holding 3 rows with
 * a promise, and on the world's layer-bound cache; a pending reservation
 * stays pending through a failed commit.
 */
static void test_nothing_changed_external_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_binding eb;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, 8, 1, 2, &err), &err);
    kvp_cache *ext = kvpt_cache(w.pool, &eb, 1, 8);
    double rows[4 * HEADS * 8 * HD];
    kvpt_fill_random(rows, sizeof rows / sizeof *rows, 3);
    kvpt_assert_ok(kvp_cache_append_rows(ext, rows, rows, 3, &err), &err);
    kvpt_assert_ok(kvp_cache_promise(ext, 1, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, ext);
    kvpt_snapshot_take(&w.snap);
    kvp_binding untouched;
    memset(&untouched, 0x5A, sizeof untouched);
    kvp_binding out = untouched;

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_binding_init_external(NULL, 1, 1, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 0, 1, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 1, 0, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 1, 1, 0, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_binding_init_external(&out, 2, SIZE_MAX, 1, 0, 0, &e));
    assert_memory_equal(&out, &untouched, sizeof out);

    /* append_rows, in its order. */
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(NULL, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_append_rows(w.cache, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(ext, NULL, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(ext, rows, NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_cache_append_rows(ext, rows, rows, 6, &e));
    double bad[HEADS * 2 * HD];
    memcpy(bad, rows, sizeof bad);
    bad[HEADS * 2 * HD - 1] = NAN; /* the last element of 2 rows: no page is taken before */
    EXPECT_FAIL(&w, KVP_NONFINITE_KEY, 0, kvp_cache_append_rows(ext, bad, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_VALUE, 0, kvp_cache_append_rows(ext, rows, bad, 2, &e));
    /* 5 rows open block 2 (positions 4, 5, ...): more lanes than pages free. */
    kvp_cache *wide = NULL;
    kvpt_assert_ok(kvp_cache_create(w.pool, &eb, 64, 8, &wide, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, wide);
    double *many = kvpt_doubles(64 * HEADS * 8 * HD);
    kvpt_fill_random(many, 64 * HEADS * 8 * HD, 4);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1, kvp_cache_append_rows(wide, many, many, 1, &e));

    /* reserve, commit, discard, promise, block table, page data. */
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_reserve_rows(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_reserve_rows(w.cache, 1, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_cache_reserve_rows(ext, 6, &e));
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1, kvp_cache_reserve_rows(wide, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(NULL, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_commit_rows(w.cache, rows, rows, 0, &e));
    EXPECT_FAIL(&w, KVP_ROWS_NOT_RESERVED, 0, kvp_cache_commit_rows(ext, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_discard_rows(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_promise(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_promise(w.cache, 1, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_promise(ext, 5, &e));
    const uint32_t *table = SENTINEL;
    size_t blocks = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(NULL, 0, &table, &blocks, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(ext, 0, NULL, &blocks, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(ext, 0, &table, NULL, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_block_table(ext, 1, &table, &blocks, &e));
    assert_ptr_equal(table, SENTINEL);
    assert_int_equal(blocks, 77);
    const void *k = SENTINEL;
    const void *v = SENTINEL;
    kvp_page_layout layout;
    memset(&layout, 0x5A, sizeof layout);
    layout.struct_size = sizeof layout;
    kvp_page_layout layout_before = layout;
    kvp_pool_stats stats = kvpt_stats(w.pool);
    uint32_t free_page = 0;
    while (kvp_pool_page_data(w.pool, free_page, &k, &v, NULL, &err) == KVP_OK) {
        free_page++;
    }
    k = SENTINEL;
    v = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(NULL, 0, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, NULL, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, &k, NULL, &layout, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0,
                kvp_pool_page_data(w.pool, (uint32_t)stats.total_pages, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_PAGE_NOT_HELD, 0,
                kvp_pool_page_data(w.pool, free_page, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_layout_get(NULL, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_layout_get(w.pool, NULL, &e));
    kvp_page_layout unsized = layout;
    unsized.struct_size = 0; /* never initialized */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, &k, &v, &unsized, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_pool_page_layout_get(w.pool, &unsized, &e));
    assert_int_equal(unsized.struct_size, 0);
    unsized.struct_size = layout.struct_size;
    assert_memory_equal(&unsized, &layout_before, sizeof unsized);
    assert_ptr_equal(k, SENTINEL);
    assert_ptr_equal(v, SENTINEL);
    assert_memory_equal(&layout, &layout_before, sizeof layout);

    /* With a reservation pending: refusals keep it, exactly. */
    kvpt_assert_ok(kvp_cache_reserve_rows(ext, 3, &err), &err); /* positions 3..5: opens blocks 2 (4, 5) */
    kvpt_snapshot_take(&w.snap);
    assert_int_equal(w.snap.stats.tentative_pages, 1);
    EXPECT_FAIL(&w, KVP_ROWS_RESERVED, 0, kvp_cache_append_rows(ext, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_ROWS_RESERVED, 0, kvp_cache_reserve_rows(ext, 1, &e));
    EXPECT_FAIL(&w, KVP_ROWS_NOT_RESERVED, 0, kvp_cache_commit_rows(ext, rows, rows, 4, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(ext, NULL, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(ext, rows, NULL, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_KEY, 0, kvp_cache_commit_rows(ext, bad, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_VALUE, 0, kvp_cache_commit_rows(ext, rows, bad, 2, &e));
    assert_int_equal(kvp_cache_reserved_rows(ext), 3);
    kvpt_assert_ok(kvp_cache_commit_rows(ext, rows, rows, 3, &err), &err);
    kvpt_assert_pool_ok(w.pool);

    free(many);
    kvpt_destroy_cache(wide, w.pool);
    kvpt_destroy_cache(ext, w.pool);
    world_free(&w);
}

/* A grouped layer over the world's square W_q, W_o and one D x d_h W_k, W_v (MQA). */
static kvp_status make_grouped_layer(world *w, void **out, kvp_error *err)
{
    return kvp_layer_create_grouped(w->param, w->narrow, w->narrow, w->param, HEADS, 1,
                                    POSITIONS, BASE, (kvp_layer **)out, err);
}

static kvp_status make_random_grouped_layer(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_layer_create_random_grouped(D, HEADS, 1, POSITIONS, BASE, 5, (kvp_layer **)out,
                                           err);
}

static void destroy_layer(world *w, void *object)
{
    (void)w;
    kvpt_destroy_layer((kvp_layer *)object);
}

static void bump(void *ctx, double *values, size_t width)
{
    (void)ctx;
    values[0] += (double)width;
}

static void test_nothing_changed_param_rope_layer_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    double values[D * D] = {0};
    kvp_param *param = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create(D, NULL, &param, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create(D, values, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create(0, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_param_create((size_t)1 << 33, values, &param, &e));
    assert_ptr_equal(param, SENTINEL);
    sweep_call param_call = {make_param, destroy_param};
    assert_int_equal(sweep(&w, &param_call, 1), 1);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_retain(NULL, &e));
    EXPECT_NOOP(&w, kvp_param_release(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update(NULL, values, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update(w.param, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update_with(NULL, bump, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update_with(w.param, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create_matrix(3, 2, NULL, &param, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create_matrix(3, 2, values, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create_matrix(0, 2, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create_matrix(3, 0, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_param_create_matrix((size_t)1 << 33, (size_t)1 << 33, values, &param, &e));
    assert_ptr_equal(param, SENTINEL);
    sweep_call matrix_call = {make_param_matrix, destroy_param};
    assert_int_equal(sweep(&w, &matrix_call, 1), 1);

    /* RoPE: validate and rotate refuse the same configurations; features stay. */
    const kvp_rope_config bad[] = {
        {3, 8, BASE},  {0, 8, BASE},     {4, 0, BASE},    {4, 8, 0.0},      {4, 8, -1.0},
        {4, 8, NAN},   {4, 8, INFINITY}, {64, 8, 5e-324}, {64, 1, 5e-324},  {64, SIZE_MAX, 1e-300},
    };
    const kvp_status why[] = {
        KVP_ROPE_INVALID_WIDTH, KVP_ROPE_INVALID_WIDTH, KVP_ROPE_ZERO_POSITIONS,
        KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,
        KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,
        KVP_ROPE_INVALID_BASE,
    };
    double features[4] = {1.0, 2.0, 3.0, 4.0};
    const double original[4] = {1.0, 2.0, 3.0, 4.0};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_rope_validate(NULL, &e));
    for (size_t i = 0; i < KVPT_COUNT_OF(bad); i++) {
        EXPECT_FAIL(&w, why[i], 0, kvp_rope_validate(&bad[i], &e));
        EXPECT_FAIL(&w, why[i], 0, kvp_rope_rotate(&bad[i], features, 0, &e));
    }
    kvp_rope_config rope = {4, 8, BASE};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_rope_rotate(&rope, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_ROPE_POSITION_OUT_OF_RANGE, 0, kvp_rope_rotate(&rope, features, 8, &e));
    assert_memory_equal(features, original, sizeof features);

    /* Layers: the parameters keep their identity and revision. */
    kvp_param *narrow = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create(2, values, &narrow, &err), &err);
    kvp_layer *layer = SENTINEL;
    kvp_param *p = w.param;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_create(p, p, p, p, HEADS, 8, BASE, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(NULL, p, p, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, NULL, p, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, p, NULL, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, p, p, NULL, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create(p, p, narrow, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 0, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 3, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 4, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_ZERO_POSITIONS, 0,
                kvp_layer_create(p, p, p, p, HEADS, 0, BASE, &layer, &e));
    /* 5e-324 is refused over 64 features (theta_31 overflows), not over 2. */
    double *zeros = kvpt_doubles(64 * 64);
    kvp_param *p64 = NULL;
    kvpt_assert_ok(kvp_param_create(64, zeros, &p64, &err), &err);
    free(zeros);
    kvpt_snapshot_add_param(&w.snap, p64);
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_layer_create(p64, p64, p64, p64, 1, 8, 5e-324, &layer, &e));
    kvpt_assert_ok(kvp_layer_create(p64, p64, p64, p64, 2, 8, 5e-324, &layer, &err), &err);
    kvpt_destroy_layer(layer);
    layer = SENTINEL;
    assert_ptr_equal(layer, SENTINEL);
    sweep_call layer_call = {make_layer, destroy_layer};
    assert_int_equal(sweep(&w, &layer_call, 1), 1);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create_random(D, HEADS, 8, BASE, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_layer_create_random(0, HEADS, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_layer_create_random((size_t)1 << 31, HEADS, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create_random(D, 3, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_layer_create_random(64, 1, 8, 5e-324, 1, &layer, &e));
    assert_ptr_equal(layer, SENTINEL);
    sweep_call random_call = {make_random_layer, destroy_layer};
    /* The weights scratch, four parameters, the layer. */
    assert_int_equal(sweep(&w, &random_call, 6), 6);

    /* Grouped layers: KV heads must divide heads, W_k and W_v have kv_heads * d_h columns. */
    kvp_param *n = w.narrow;
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_grouped(p, n, n, p, HEADS, 0, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_grouped(p, n, n, p, HEADS, HEADS + 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create_grouped(p, n, narrow, p, HEADS, 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create_grouped(p, p, p, p, HEADS, 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_random_grouped(D, HEADS, 3, 8, BASE, 1, &layer, &e));
    assert_ptr_equal(layer, SENTINEL);
    sweep_call grouped_call = {make_grouped_layer, destroy_layer};
    assert_int_equal(sweep(&w, &grouped_call, 1), 1);
    sweep_call random_grouped_call = {make_random_grouped_layer, destroy_layer};
    assert_int_equal(sweep(&w, &random_grouped_call, 6), 6);

    EXPECT_NOOP(&w, kvp_layer_destroy(NULL, &e));
    kvp_layer_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_layer_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_info_get(w.layer, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);
    kvp_binding binding;
    memset(&binding, 0x5A, sizeof binding);
    kvp_binding sentinel_binding = binding;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_binding_get(NULL, &binding, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_binding_get(w.layer, NULL, &e));
    assert_memory_equal(&binding, &sentinel_binding, sizeof binding);
    /* A refused kvp_layer_set_kv_scales leaves the layer's binding as it was. */
    kvp_layer *scaled = kvpt_random_layer(D, HEADS, POSITIONS, 10000.0, 5);
    kvp_binding unscaled;
    kvpt_assert_ok(kvp_layer_binding_get(scaled, &unscaled, &err), &err);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_set_kv_scales(NULL, 1.0, 1.0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_layer_set_kv_scales(scaled, NAN, 1.0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_layer_set_kv_scales(scaled, 2.0, 0.0, &e));
    kvpt_assert_ok(kvp_layer_binding_get(scaled, &binding, &err), &err);
    assert_memory_equal(&binding, &unscaled, sizeof binding);
    kvpt_destroy_layer(scaled);
    kvpt_assert_ok(kvp_param_release(narrow, &err), &err);
    kvpt_assert_ok(kvp_param_release(p64, &err), &err);
    world_free(&w);
}

/* ---- attention.h ---------------------------------------------------------------------- */

static kvp_status make_ticket(world *w, void **out, kvp_error *err)
{
    return kvp_ticket_create(w->cache, (kvp_ticket **)out, err);
}

static void destroy_ticket(world *w, void *object)
{
    kvpt_destroy_ticket((kvp_ticket *)object, w->pool);
}

/* The reference's out-parameter is a buffer: the sweep passes it through a box. */
typedef struct reference_box {
    double out[2 * 3 * D];
} reference_box;

static kvp_status make_reference(world *w, void **out, kvp_error *err)
{
    static reference_box box;
    double input[2 * 3 * D];
    row_input(input, 2, 3, 40);
    kvp_tensor view = kvp_tensor3(input, 2, 3, D);
    kvp_status status = kvp_attention_reference(w->layer, &view, box.out, 2 * 3 * D, NULL, NULL,
                                                0, err);
    if (status == KVP_OK) {
        *out = &box;
    }
    return status;
}

static void destroy_nothing(world *w, void *object)
{
    (void)w;
    (void)object;
}

/*
 * Fills the pool's free and evictable pages with a cache of its own (the
 * evictable ones evicted); returns it.
 */
static kvp_cache *fill_pool(world *w, kvp_ticket **ticket)
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

static void test_nothing_changed_attention_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_ticket *ticket = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_create(NULL, &ticket, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_create(w.cache, NULL, &e));
    /* A layer-kind binding whose owner record is not attention's (hand-made):
     * attention cannot size a ticket for it. */
    kvp_binding not_attention;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &not_attention, &err), &err);
    memset(not_attention.record, 0, sizeof not_attention.record);
    kvp_cache *foreign_cache = kvpt_cache(w.pool, &not_attention, 1, 1);
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_ticket_create(foreign_cache, &ticket, &e));
    kvpt_destroy_cache(foreign_cache, w.pool);
    assert_ptr_equal(ticket, SENTINEL);
    sweep_call ticket_call = {make_ticket, destroy_ticket};
    assert_int_equal(sweep(&w, &ticket_call, 2), 2);
    EXPECT_NOOP(&w, kvp_ticket_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_discard(NULL, &e));

    /* Commit: the held ticket keeps its row and page through every refusal. */
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &binding, &err), &err);
    kvp_cache *foreign = kvpt_cache(w.pool, &binding, CACHE_B, CACHE_C);
    kvpt_snapshot_add_cache(&w.snap, foreign);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_commit(NULL, w.cache, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_commit(w.held, NULL, &e));
    EXPECT_FAIL(&w, KVP_TICKET_EMPTY, 0, kvp_ticket_commit(w.ticket, w.cache, &e));
    EXPECT_FAIL(&w, KVP_TICKET_FOREIGN_CACHE, 0, kvp_ticket_commit(w.held, foreign, &e));
    kvp_attention_result result;
    memset(&result, 0x5A, sizeof result);
    kvp_attention_result sentinel_result = result;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_result(NULL, &result, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_result(w.held, NULL, &e));
    kvp_ticket *fresh = kvpt_ticket(w.cache);
    EXPECT_FAIL(&w, KVP_TICKET_EMPTY, 0, kvp_ticket_result(fresh, &result, &e));
    assert_memory_equal(&result, &sentinel_result, sizeof result);

    /* Prepare and forward refuse, in the seed's order, leaving every ticket as it was. */
    double x[CACHE_B * 2 * (D + 1)];
    row_input(x, CACHE_B, 2, 41);
    kvp_tensor good = kvp_tensor3(x, CACHE_B, 1, D);
    kvp_tensor rank2 = good;
    rank2.shape.rank = 2;
    kvp_tensor two = kvp_tensor3(x, CACHE_B, 2, D);
    kvp_tensor batch2 = kvp_tensor3(x, CACHE_B + 1, 1, D);
    kvp_tensor wide = kvp_tensor3(x, CACHE_B, 1, D + 1);
    double nan_row[CACHE_B * D] = {0.5, NAN, 0.25, 1.0};
    kvp_tensor nan_input = kvp_tensor3(nan_row, CACHE_B, 1, D);
    const kvp_layer *layer1 = kvp_model_layer(w.model, 1);
    /* The same parameters under another RoPE base: only the RoPE check can tell. */
    kvp_layer *other_base = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_model_param_mut(w.model, 0, 0),
                                    kvp_model_param_mut(w.model, 0, 1),
                                    kvp_model_param_mut(w.model, 0, 2),
                                    kvp_model_param_mut(w.model, 0, 3),
                                    HEADS, POSITIONS, 500.0, &other_base, &err),
                   &err);
    /* An MQA layer of the same width and heads: only the KV head count differs. */
    kvp_layer *mqa = NULL;
    kvpt_assert_ok(kvp_layer_create_grouped(kvp_model_param_mut(w.model, 0, 0), w.narrow, w.narrow,
                                            kvp_model_param_mut(w.model, 0, 3), HEADS, 1, POSITIONS,
                                            BASE, &mqa, &err),
                   &err);
    const kvp_tensor *inputs[] = {&rank2, &two, &batch2, &wide, &good, &nan_input};
    const kvp_status input_errors[] = {KVP_INPUT_RANK,       KVP_SINGLE_TOKEN_REQUIRED,
                                       KVP_INPUT_BATCH_MISMATCH, KVP_INPUT_WIDTH_MISMATCH,
                                       KVP_CACHE_LAYER_MISMATCH, KVP_NONFINITE_PROJECTION};
    for (int forward = 0; forward < 2; forward++) {
        for (size_t i = 0; i < KVPT_COUNT_OF(inputs); i++) {
            const kvp_layer *with = i == 4 ? layer1 : w.layer;
            if (forward) {
                EXPECT_FAIL(&w, input_errors[i], 0,
                            kvp_attention_forward(with, inputs[i], w.cache, fresh, &e));
            } else {
                EXPECT_FAIL(&w, input_errors[i], 0,
                            kvp_attention_prepare(with, inputs[i], w.cache, fresh, &e));
            }
        }
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_forward(NULL, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_prepare(w.layer, NULL, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_prepare(w.layer, &good, NULL, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_forward(w.layer, &good, w.cache, NULL, &e));
        EXPECT_FAIL(&w, KVP_CACHE_ROPE_MISMATCH, 0,
                    kvp_attention_forward(other_base, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_CACHE_KV_HEAD_COUNT_MISMATCH, 0,
                    kvp_attention_prepare(mqa, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_CACHE_KV_HEAD_COUNT_MISMATCH, 0,
                    kvp_attention_forward(mqa, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_TICKET_BUSY, 0,
                    kvp_attention_forward(w.layer, &good, w.cache, w.held, &e));
    }
    /* A ticket too small for the cache. */
    kvp_cache *small = kvpt_cache(w.pool, &binding, CACHE_B, 1);
    kvp_ticket *small_ticket = kvpt_ticket(small);
    EXPECT_FAIL(&w, KVP_TICKET_GEOMETRY_MISMATCH, 0,
                kvp_attention_prepare(w.layer, &good, w.cache, small_ticket, &e));
    /* FULL: the small cache after one row. */
    kvpt_assert_ok(kvp_attention_forward(w.layer, &good, small, small_ticket, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, small);
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_attention_forward(w.layer, &good, small, fresh, &e));
    /* A score that overflows: a huge input row whose projections stay finite. */
    double huge_row[CACHE_B * D] = {1e156, -1e156, 1e156, 1e156};
    kvp_tensor huge = kvp_tensor3(huge_row, CACHE_B, 1, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_SCORE, 0,
                kvp_attention_forward(w.layer, &huge, w.cache, fresh, &e));

    /* The stale ticket: prepared, then the cache moves on through another ticket. */
    kvp_ticket *stale = kvpt_ticket(small);
    kvpt_assert_ok(kvp_cache_reset(small, &err), &err);
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &good, small, stale, &err), &err);
    kvpt_assert_ok(kvp_attention_forward(w.layer, &good, small, small_ticket, &err), &err);
    kvpt_snapshot_add_ticket(&w.snap, stale);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_TICKET_STALE, 0, kvp_ticket_commit(stale, small, &e));
    kvpt_assert_ok(kvp_ticket_discard(stale, &err), &err);

    /* POOL_EXHAUSTED: the cache opens a block (len 4 -> the held row is at a boundary). */
    kvpt_assert_ok(kvp_ticket_discard(w.held, &err), &err);
    kvp_ticket *filler_ticket = NULL;
    kvp_cache *filler = fill_pool(&w, &filler_ticket);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_attention_prepare(w.layer, &good, w.cache, fresh, &e));
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_attention_forward(w.layer, &good, w.cache, fresh, &e));

    /* The reference: nothing written on any error. */
    double out[2 * 3 * D];
    double keys[2 * 3 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_fill(keys, KVPT_COUNT_OF(keys), 7.0);
    double input[2 * 3 * D];
    row_input(input, 2, 3, 42);
    kvp_tensor three = kvp_tensor3(input, 2, 3, D);
    kvp_tensor bad_shape = kvp_tensor3(input, 2, 3, D + 1);
    kvp_tensor too_long = kvp_tensor3(input, 1, POSITIONS + 1, D);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(NULL, &three, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(w.layer, NULL, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(w.layer, &three, NULL, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_REFERENCE_INPUT_SHAPE, 0,
                kvp_attention_reference(w.layer, &bad_shape, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_ROPE_POSITION_OUT_OF_RANGE, 0,
                kvp_attention_reference(w.layer, &too_long, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_attention_reference(w.layer, &three, out, 23, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, NULL, 23, &e));
    input[D + 1] = NAN; /* lane 0, token 1 */
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, keys, 24, &e));
    row_input(input, 2, 3, 42);
    for (size_t i = 0; i < D; i++) {
        input[2 * D + i] = huge_row[i]; /* lane 0, token 2 */
    }
    EXPECT_FAIL(&w, KVP_NONFINITE_SCORE, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, keys, 24, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_assert_filled(keys, KVPT_COUNT_OF(keys), 7.0);
    sweep_call reference_call = {make_reference, destroy_nothing};
    assert_int_equal(sweep(&w, &reference_call, 1), 1);

    kvpt_destroy_ticket(filler_ticket, w.pool);
    kvpt_destroy_cache(filler, w.pool);
    kvpt_destroy_ticket(stale, w.pool);
    kvpt_destroy_ticket(small_ticket, w.pool);
    kvpt_destroy_cache(small, w.pool);
    kvpt_destroy_ticket(fresh, w.pool);
    kvpt_destroy_cache(foreign, w.pool);
    kvpt_destroy_layer(other_base);
    kvpt_destroy_layer(mqa);
    world_free(&w);
}

/* ---- model.h ---------------------------------------------------------------------------- */

static kvp_status make_model(world *w, void **out, kvp_error *err)
{
    const kvp_layer *layers[2] = {kvp_model_layer(w->model, 1), w->layer};
    return kvp_model_create(layers, 2, (kvp_model **)out, err);
}

static kvp_status make_random_model(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_model_create_random(2, D, HEADS, POSITIONS, BASE, 3, (kvp_model **)out, err);
}

static kvp_status make_random_grouped_model(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_model_create_random_grouped(2, D, HEADS, 1, POSITIONS, BASE, 3,
                                           (kvp_model **)out, err);
}

static void destroy_model(world *w, void *object)
{
    (void)w;
    kvpt_destroy_model((kvp_model *)object);
}

static void test_nothing_changed_model_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_model *model = SENTINEL;
    kvp_layer *odd = kvpt_random_layer(D, 1, POSITIONS, BASE, 9);
    const kvp_layer *layers[3] = {w.layer, NULL, odd};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(NULL, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(layers, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_model_create(layers, 0, &model, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(layers, 2, &model, &e));
    layers[1] = odd;
    EXPECT_FAIL(&w, KVP_MODEL_GEOMETRY_MISMATCH, 0, kvp_model_create(layers, 2, &model, &e));
    /* Same width, heads and head width; only the KV heads differ. */
    kvp_layer *mqa = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D, HEADS, 1, POSITIONS, BASE, 9, &mqa, &err),
                   &err);
    layers[1] = mqa;
    EXPECT_FAIL(&w, KVP_MODEL_GEOMETRY_MISMATCH, 0, kvp_model_create(layers, 2, &model, &e));
    kvpt_destroy_layer(mqa);
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_model_create_random_grouped(2, D, HEADS, 3, 8, BASE, 1, &model, &e));
    assert_ptr_equal(model, SENTINEL);
    sweep_call grouped_model_call = {make_random_grouped_model, destroy_model};
    assert_true(sweep(&w, &grouped_model_call, 12) >= 12);
    sweep_call model_call = {make_model, destroy_model};
    assert_int_equal(sweep(&w, &model_call, 3), 3);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_model_create_random(2, D, HEADS, 8, BASE, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_model_create_random(0, D, HEADS, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_model_create_random(SIZE_MAX, D, HEADS, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_model_create_random(2, D, 3, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_model_create_random(2, 64, 1, 8, 5e-324, 1, &model, &e));
    assert_ptr_equal(model, SENTINEL);
    sweep_call random_call = {make_random_model, destroy_model};
    assert_true(sweep(&w, &random_call, 12) >= 12);

    EXPECT_NOOP(&w, kvp_model_destroy(NULL, &e));
    /* The world's sequence still runs the model (world_free then destroys both). */
    EXPECT_FAIL(&w, KVP_MODEL_BUSY, 0, kvp_model_destroy(w.model, &e));
    kvp_model_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_model_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_info_get(w.model, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);
    kvpt_destroy_layer(odd);
    world_free(&w);
}

/* ---- sequence.h ----------------------------------------------------------------------------- */

static kvp_status make_sequence(world *w, void **out, kvp_error *err)
{
    return kvp_sequence_create(w->model, w->pool, 2, 4, (kvp_sequence **)out, err);
}

static void destroy_sequence(world *w, void *object)
{
    kvpt_destroy_sequence((kvp_sequence *)object, w->pool);
}

static kvp_status make_decoder(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_decoder_create(3, (kvp_decoder **)out, err);
}

static void destroy_decoder(world *w, void *object)
{
    (void)w;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_destroy((kvp_decoder *)object, &err), &err);
}

static void test_nothing_changed_sequence_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_sequence *seq = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(NULL, w.pool, 1, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(w.model, NULL, 1, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(w.model, w.pool, 1, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_ZERO_BATCH_SIZE, 0, kvp_sequence_create(w.model, w.pool, 0, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_ZERO_CAPACITY, 0, kvp_sequence_create(w.model, w.pool, 1, 0, &seq, &e));
    EXPECT_FAIL(&w, KVP_CAPACITY_EXCEEDS_POSITIONS, 0,
                kvp_sequence_create(w.model, w.pool, 1, POSITIONS + 1, &seq, &e));
    kvp_model *wide = kvpt_random_model(1, 2 * D, HEADS, POSITIONS, BASE, 4);
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_sequence_create(wide, w.pool, 1, 1, &seq, &e));
    assert_ptr_equal(seq, SENTINEL);
    sweep_call sequence_call = {make_sequence, destroy_sequence};
    /* Probe cache (2), sequence, buffers, ticket (2), then cache (2) and ticket (2). */
    assert_int_equal(sweep(&w, &sequence_call, 10), 10);
    EXPECT_NOOP(&w, kvp_sequence_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_reset(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_promise(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_sequence_promise(w.seq, SIZE_MAX, &e));

    /* Steps. */
    double x[B * 4 * D];
    row_input(x, B, 4, 50);
    double out[B * 4 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    kvp_tensor one = kvp_tensor3(x, B, 1, D);
    kvp_tensor rank2 = one;
    rank2.shape.rank = 2;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(NULL, &one, NULL, NULL, out, 8, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(w.seq, NULL, NULL, NULL, out, 8, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(w.seq, &one, NULL, NULL, NULL, 8, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D - 1, &e));
    EXPECT_FAIL(&w, KVP_INPUT_RANK, 0,
                kvp_sequence_step(w.seq, &rank2, NULL, NULL, out, B * D, &e));
    double nan_x[B * D];
    memcpy(nan_x, x, sizeof nan_x);
    nan_x[D + 1] = NAN;
    kvp_tensor nan_one = kvp_tensor3(nan_x, B, 1, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_sequence_step(w.seq, &nan_one, NULL, NULL, out, B * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* Prefill: every refusal before the first token, and a NaN at token 2. */
    kvp_tensor prompt = kvp_tensor3(x, B, 4, D);
    kvp_tensor prompt_rank = prompt;
    prompt_rank.shape.rank = 4;
    kvp_tensor prompt_batch = kvp_tensor3(x, 1, 4, D);
    kvp_tensor prompt_width = kvp_tensor3(x, B, 2, D + 1);
    kvp_tensor empty = kvp_tensor3(x, B, 0, D);
    kvp_tensor too_long = kvp_tensor3(x, B, C - PREFILLED + 1, D);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_sequence_prefill(NULL, &prompt, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_sequence_prefill(w.seq, NULL, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_RANK, 0,
                kvp_sequence_prefill(w.seq, &prompt_rank, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_BATCH_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt_batch, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_WIDTH_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt_width, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_sequence_prefill(w.seq, &empty, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0,
                kvp_sequence_prefill(w.seq, &too_long, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 4 * D - 1, &e));
    double nan_prompt[B * 4 * D];
    memcpy(nan_prompt, x, sizeof nan_prompt);
    nan_prompt[(1 * 4 + 2) * D + 3] = NAN; /* lane 1, token 2 */
    kvp_tensor nan_view = kvp_tensor3(nan_prompt, B, 4, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_sequence_prefill(w.seq, &nan_view, NULL, NULL, out, B * 4 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* A stale binding: layer 1's key updated in place; then restored by a second sequence. */
    kvp_param *key1 = kvp_model_param_mut(w.model, 1, KVP_PARAM_KEY);
    kvpt_assert_ok(kvp_param_update_with(key1, bump, NULL, &err), &err);
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 4 * D, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &e));
    /* Token 0's checks come first: the stale binding, not token 2's NaN, is reported. */
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &nan_view, NULL, NULL, out, B * 4 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* Decoder. */
    kvp_decoder *decoder = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_create(1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_decoder_create(4097, &decoder, &e));
    assert_ptr_equal(decoder, SENTINEL);
    sweep_call decoder_call = {make_decoder, destroy_decoder};
    assert_int_equal(sweep(&w, &decoder_call, 2), 2);
    EXPECT_NOOP(&w, kvp_decoder_destroy(NULL, &e));
    kvpt_assert_ok(kvp_decoder_create(2, &decoder, &err), &err);
    kvp_decode_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    jobs[0].sequence = w.seq;
    jobs[0].input = one;
    jobs[0].output = out;
    jobs[0].output_len = B * D;
    jobs[0].status = (kvp_status)77;
    jobs[1] = jobs[0];
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(NULL, jobs, 1, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(decoder, NULL, 1, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &e));
    jobs[1].sequence = NULL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &e));
    assert_int_equal(jobs[0].status, 77); /* nothing ran */
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_assert_ok(kvp_decoder_destroy(decoder, &err), &err);

    kvpt_destroy_model(wide);
    world_free(&w);
}

/*
 * The issue's case and its neighbours on a pool close to full: POOL_EXHAUSTED
 * from a prefill and a step, and a prefill that fails at token 2 after
 * computing tokens 0 and 1 (a score that overflows): stats, promise, caches
 * and the audit are exactly as before; only free slab bytes differ.
 */
static void test_nothing_changed_failed_prefill_counters_exact(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    double x[B * 4 * D];
    row_input(x, B, 4, 60);
    kvp_tensor prompt = kvp_tensor3(x, B, 3, D); /* one new block: 4 pages of the 5 free */
    /* Token 2 of lane 0 is huge: projections stay finite, its scores overflow. */
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + 2 * D, huge, sizeof huge);
    kvpt_snapshot before = w.snap;
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(w.pool);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    assert_int_equal(err.layer, 0);
    /*
     * The failure is in the first block of tokens, which commits nothing:
     * no slab byte was written, and the pages borrowed from the LRU list (the
     * cached world) are back with their keys and places.
     */
    assert_prefix_unchanged(&prefix, w.pool);
    kvpt_snapshot now = before;
    kvpt_snapshot_take(&now);
    assert_int_equal(now.pool_digest, before.pool_digest);
    assert_memory_equal(&now.stats, &before.stats, sizeof now.stats);
    assert_memory_equal(now.seq_digest, before.seq_digest, sizeof now.seq_digest);
    assert_memory_equal(now.cache_digest, before.cache_digest, sizeof now.cache_digest);
    assert_int_equal(now.seq_len[0], PREFILLED);
    assert_int_equal(now.seq_promised[0], 2);
    assert_int_equal(now.stats.tentative_pages, 0);
    w.failures++;

    /* POOL_EXHAUSTED for a prefill and a step: only the exhaustions counter moves. */
    kvpt_assert_ok(kvp_ticket_discard(w.held, &err), &err);
    kvp_ticket *filler_ticket = NULL;
    kvp_cache *filler = fill_pool(&w, &filler_ticket);
    kvpt_snapshot_take(&w.snap);
    row_input(x, B, 4, 60);
    double out[B * 4 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 3 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvp_tensor one = kvp_tensor3(x, B, 1, D);
    kvpt_assert_ok(kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &err), &err);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &e));
    kvpt_destroy_ticket(filler_ticket, w.pool);
    kvpt_destroy_cache(filler, w.pool);
    world_free(&w);
}

/*
 * Successful calls that together must leave everything as it was (a take
 * and its cancellation): the statements run between two snapshots.
 */
#define EXPECT_UNCHANGED_AFTER(w, exhaustions, ...)                                     \
    do {                                                                                \
        kvpt_snapshot before_ = (w)->snap;                                              \
        kvpt_snapshot_take(&before_);                                                   \
        prefix_state prefix_ = prefix_state_of((w)->pool);                              \
        __VA_ARGS__                                                                     \
        kvpt_assert_unchanged(&before_, (exhaustions));                                 \
        assert_prefix_unchanged(&prefix_, (w)->pool);                                   \
        (w)->failures++;                                                                \
    } while (0)

/* How many of the cached world's keys lookups find now (borrowed pages are hidden). */
static size_t keys_found(const world *w)
{
    size_t found = 0;
    kvpi_pool_lock(w->pool);
    for (size_t i = 0; i < w->lru_pages; i++) {
        found += kvpi_prefix_lookup_locked(w->pool, &w->lru_keys[i]) != KVPI_NO_PAGE;
    }
    kvpi_pool_unlock(w->pool);
    return found;
}

/*
 * Takes that are cancelled (issue 16): reserve then discard, a multi-layer
 * step whose second layer is refused POOL_EXHAUSTED after the first took its
 * pages (the scheduler's compute-off step), a copy-on-write reservation
 * discarded, and a ticket's page discarded after prepare or after a
 * TICKET_STALE commit. In the cached world every page they take is borrowed
 * from the LRU list: it must come back with its key, index slot and LRU
 * place, and evictions must not move.
 */
static void test_nothing_changed_cancelled_takes_keep_cached_pages(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    size_t available = kvpt_stats(w.pool).free_pages + kvpt_stats(w.pool).evictable_pages;
    assert_int_equal(available, 5);
    kvp_cache *a = kvpt_cache(w.pool, &w.ext, 2, POSITIONS);
    kvp_cache *b = kvpt_cache(w.pool, &w.ext, 2, POSITIONS);
    kvpt_snapshot_add_cache(&w.snap, a);
    kvpt_snapshot_add_cache(&w.snap, b);
    kvpt_snapshot_take(&w.snap);

    /* Reserve (two blocks, two lanes: 4 pages) then discard. */
    EXPECT_UNCHANGED_AFTER(&w, 0, {
        kvpt_assert_ok(kvp_cache_reserve_rows(a, BT + 1, &err), &err);
        kvpt_assert_pool_ok(w.pool);
        if (cached_world) {
            /* Borrowed: still indexed (cached), hidden from lookups, off the LRU list. */
            kvp_pool_stats mid = kvpt_stats(w.pool);
            assert_int_equal(mid.cached_pages, w.snap.stats.cached_pages);
            assert_int_equal(mid.evictable_pages, w.lru_pages - 4);
            assert_int_equal(mid.evictions, w.snap.stats.evictions);
            assert_int_equal(keys_found(&w), w.lru_pages - 4);
        }
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });
    if (cached_world) {
        assert_int_equal(keys_found(&w), w.lru_pages);
    }

    /* A step over two layers: layer 0 takes 4 pages, layer 1 is refused, layer 0 discards. */
    EXPECT_UNCHANGED_AFTER(&w, 1, {
        kvpt_assert_ok(kvp_cache_reserve_rows(a, BT + 1, &err), &err);
        kvp_error e;
        assert_int_equal(kvp_cache_reserve_rows(b, 1, &e), KVP_POOL_EXHAUSTED);
        assert_int_equal(e.needed, 2);
        assert_int_equal(e.available, 1);
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });

    /* Copy-on-write: a fork at a mid-block length; each side's reservation copies 2 pages. */
    double rows[2 * HEADS * HD];
    kvpt_fill_random(rows, KVPT_COUNT_OF(rows), 90);
    kvpt_assert_ok(kvp_cache_append_rows(a, rows, rows, 1, &err), &err);
    kvp_cache *child = NULL;
    kvpt_assert_ok(kvp_cache_fork(a, &child, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, child);
    kvpt_snapshot_take(&w.snap);
    assert_int_equal(kvp_cache_pages_for(child, 2), 2); /* the two copies, no new block */
    EXPECT_UNCHANGED_AFTER(&w, 0, {
        kvpt_assert_ok(kvp_cache_reserve_rows(child, 1, &err), &err);
        kvpt_assert_pool_ok(w.pool);
        kvpt_assert_ok(kvp_cache_discard_rows(child, &err), &err);
        kvpt_assert_ok(kvp_cache_reserve_rows(a, 1, &err), &err);
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });

    /*
     * Tickets: prepare takes the page of block 2 (counted in acquires, as
     * tickets' pages are); discard gives it back to its LRU place.
     */
    double x[CACHE_B * D];
    row_input(x, CACHE_B, 1, 91);
    kvp_tensor in = kvp_tensor3(x, CACHE_B, 1, D);
    kvp_ticket *fresh = kvpt_ticket(w.cache);
    prefix_state before_prepare = prefix_state_of(w.pool);
    size_t found = keys_found(&w);
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &in, w.cache, fresh, &err), &err);
    kvpt_assert_ok(kvp_ticket_discard(fresh, &err), &err);
    assert_prefix_unchanged(&before_prepare, w.pool);
    /* Prepared, made stale by the held ticket's commit, refused, then discarded. */
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &in, w.cache, fresh, &err), &err);
    kvpt_assert_ok(kvp_ticket_commit(w.held, w.cache, &err), &err);
    kvpt_snapshot_add_ticket(&w.snap, fresh);
    kvpt_snapshot_take(&w.snap);
    prefix_state before_discard = prefix_state_of(w.pool);
    EXPECT_FAIL(&w, KVP_TICKET_STALE, 0, kvp_ticket_commit(fresh, w.cache, &e));
    kvpt_assert_ok(kvp_ticket_discard(fresh, &err), &err);
    kvpt_assert_pool_ok(w.pool);
    prefix_state after_discard = prefix_state_of(w.pool);
    assert_int_equal(after_discard.evictions, before_discard.evictions);
    assert_int_equal(after_discard.cached, before_discard.cached);
    assert_int_equal(after_discard.evictable, before_discard.evictable + cached_world);
    assert_int_equal(keys_found(&w), found);

    kvpt_destroy_ticket(fresh, w.pool);
    kvpt_destroy_cache(child, w.pool);
    kvpt_destroy_cache(b, w.pool);
    kvpt_destroy_cache(a, w.pool);
    world_free(&w);
}

static void residual_input(void *ctx, size_t layer, const double *input, const double *output,
                           size_t elements, double *next)
{
    (void)ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
}

/* A pool of `pages` pages whose free list is empty and whose LRU list holds them all, published. */
static kvp_pool *cached_pool(size_t block_tokens, size_t pages, kvp_block_key *keys)
{
    kvp_pool *pool = kvpt_pool(block_tokens, HEADS, HD, pages);
    kvp_binding eb;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, block_tokens, 3, 4, &err), &err);
    kvp_cache *publisher = kvpt_cache(pool, &eb, pages, block_tokens);
    size_t n = pages * HEADS * block_tokens * HD;
    double *rows = kvpt_doubles(n);
    kvpt_fill_random(rows, n, 92);
    kvpt_assert_ok(kvp_cache_append_rows(publisher, rows, rows, block_tokens, &err), &err);
    for (size_t lane = 0; lane < pages; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, publisher, &lane, sizeof lane, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_destroy_cache(publisher, pool);
    free(rows);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.free_pages, 0);
    assert_int_equal(s.evictable_pages, pages);
    return pool;
}

/*
 * A prefill of a forked sequence (copy-on-write) that fails at token 1, in
 * a pool whose free list is empty: its copies are borrowed from the LRU
 * list. In blocks (the residual stream) the failing block writes nothing:
 * everything is as before, slab bytes included. Token by token (a
 * next_input function), token 0 wrote its copies before token 1 failed:
 * those borrowed pages cannot hold their cached blocks again, so they are
 * evicted (counted) and go back free; nothing else changes (DESIGN.md,
 * Eviction: the one exception).
 */
static void test_nothing_changed_failed_prefill_of_a_fork_keeps_cached_pages(void **state)
{
    (void)state;
    enum { FBT = 4, SEQ_PAGES = L * B, LRU = 6 };
    kvp_block_key keys[SEQ_PAGES + LRU];
    kvp_pool *pool = kvpt_pool(FBT, HEADS, HD, SEQ_PAGES + LRU);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 11);
    kvp_sequence *parent = kvpt_sequence(model, pool, B, C);
    double x[B * 2 * D];
    row_input(x, B, 2, 93);
    kvp_tensor two = kvp_tensor3(x, B, 2, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(parent, &two, NULL, NULL, NULL, 0, &err), &err);
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    assert_int_equal(kvp_sequence_pages_for(child, 4), SEQ_PAGES); /* the copies */
    /* The rest of the pool: published and evictable. */
    kvp_binding eb;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, FBT, 3, 4, &err), &err);
    kvp_cache *publisher = kvpt_cache(pool, &eb, LRU, FBT);
    double rows[LRU * HEADS * FBT * HD];
    kvpt_fill_random(rows, KVPT_COUNT_OF(rows), 94);
    kvpt_assert_ok(kvp_cache_append_rows(publisher, rows, rows, FBT, &err), &err);
    for (size_t lane = 0; lane < LRU; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, publisher, &lane, sizeof lane, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_destroy_cache(publisher, pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 0);

    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, parent);
    kvpt_snapshot_add_sequence(&before, child);
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(pool);
    uint32_t order[LRU];
    assert_int_equal(kvpt_lru_order(pool, order), LRU);
    /* Token 1 of lane 0 is huge: its own score overflows. */
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + D, huge, sizeof huge);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(child, &two, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 1);
    kvpt_assert_unchanged(&before, 0);
    assert_prefix_unchanged(&prefix, pool);

    /* Token by token: token 0's copies were written into the 4 oldest LRU pages. */
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(child, &two, residual_input, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 1);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats now = kvpt_stats(pool);
    kvp_pool_stats expected = before.stats;
    expected.evictions += SEQ_PAGES;
    expected.cached_pages -= SEQ_PAGES;
    expected.evictable_pages -= SEQ_PAGES;
    expected.free_pages += SEQ_PAGES;
    assert_memory_equal(&now, &expected, sizeof now);
    uint32_t after[LRU];
    assert_int_equal(kvpt_lru_order(pool, after), LRU - SEQ_PAGES);
    assert_memory_equal(after, order + SEQ_PAGES, (LRU - SEQ_PAGES) * sizeof *after);
    kvpi_pool_lock(pool);
    for (size_t i = 0; i < SEQ_PAGES; i++) {
        assert_int_equal(pool->registered[order[i]], 0);
    }
    kvpi_pool_unlock(pool);
    kvpt_snapshot unchanged = before;
    kvpt_snapshot_take(&unchanged);
    assert_memory_equal(unchanged.seq_digest, before.seq_digest, sizeof before.seq_digest);
    assert_memory_equal(unchanged.seq_len, before.seq_len, sizeof before.seq_len);

    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    kvpt_destroy_model(model);
    destroy_cached_pool(pool);
}

/*
 * The exception, precisely: a prefill token by token, from an empty
 * sequence, in a pool whose 8 pages are all cached and evictable. It takes
 * the 4 oldest (blocks 0 and 1 of two layers), token 0 writes block 0 into
 * the 2 oldest, token 2 (opening block 1) fails. The 2 written pages lose
 * their keys (evictions + 2, now free); the 2 unwritten ones are back with
 * their keys at their LRU places. In blocks the same prompt writes nothing.
 */
static void test_nothing_changed_failed_prefill_loses_only_written_pages(void **state)
{
    (void)state;
    enum { PAGES8 = 8, T = 3 };
    kvp_block_key keys[PAGES8];
    kvp_pool *pool = cached_pool(BT, PAGES8, keys);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 11);
    kvp_sequence *seq = kvpt_sequence(model, pool, 1, C);
    double x[T * D];
    row_input(x, 1, T, 95);
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + 2 * D, huge, sizeof huge);
    kvp_tensor prompt = kvp_tensor3(x, 1, T, D);
    uint32_t order[PAGES8];
    assert_int_equal(kvpt_lru_order(pool, order), PAGES8);
    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, seq);
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(pool);
    kvp_error err;
    assert_int_equal(kvp_sequence_prefill(seq, &prompt, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    kvpt_assert_unchanged(&before, 0);
    assert_prefix_unchanged(&prefix, pool);

    assert_int_equal(kvp_sequence_prefill(seq, &prompt, residual_input, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats now = kvpt_stats(pool);
    kvp_pool_stats expected = before.stats;
    expected.evictions += L;
    expected.cached_pages -= L;
    expected.evictable_pages -= L;
    expected.free_pages += L;
    assert_memory_equal(&now, &expected, sizeof now);
    uint32_t after[PAGES8];
    assert_int_equal(kvpt_lru_order(pool, after), PAGES8 - L);
    assert_memory_equal(after, order + L, (PAGES8 - L) * sizeof *after);
    size_t found = 0;
    kvpi_pool_lock(pool);
    for (size_t i = 0; i < PAGES8; i++) {
        uint32_t page = kvpi_prefix_lookup_locked(pool, &keys[i]);
        found += page != KVPI_NO_PAGE;
        assert_true(page == KVPI_NO_PAGE || (page != order[0] && page != order[1]));
    }
    assert_int_equal(pool->registered[order[0]], 0);
    assert_int_equal(pool->registered[order[1]], 0);
    kvpi_pool_unlock(pool);
    assert_int_equal(found, PAGES8 - L);
    assert_int_equal(kvp_sequence_len(seq), 0);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_model(model);
    destroy_cached_pool(pool);
}

/* Mid-prefill observations, made from the next-input callback between layers. */
typedef struct midway {
    kvp_pool *pool;
    size_t calls;
    kvp_pool_stats first;  /* token 0, after layer 0: no page taken yet */
    kvp_pool_stats second; /* token 1, after layer 0: every page taken, tentatively */
} midway;

static void observe(void *ctx, size_t layer, const double *input, const double *output,
                    size_t elements, double *next)
{
    midway *m = ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
    kvpt_assert_pool_ok(m->pool); /* the audit counts tentative pages */
    if (m->calls == 0) {
        m->first = kvpt_stats(m->pool);
    } else if (m->calls == L) {
        m->second = kvpt_stats(m->pool);
    }
    m->calls++;
}

/*
 * While a prefill runs, its pages are held and tentative: the audit passes,
 * held_pages includes them, acquires and the high-water mark do not; on
 * success both count them.
 */
static void test_nothing_changed_prefill_pages_are_tentative_until_success(void **state)
{
    (void)state;
    enum { T = 5 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 70);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double x[B * T * D];
    row_input(x, B, T, 71);
    kvp_tensor prompt = kvp_tensor3(x, B, T, D);
    kvp_pool_stats before = kvpt_stats(pool);
    midway m = {pool, 0, {0}, {0}};
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(seq, &prompt, observe, &m, NULL, 0, &err), &err);
    size_t pages = L * B * KVPT_CEIL_DIV(T, BT);
    assert_int_equal(m.calls, T * L);
    /* Token 0 is prepared before any page is taken. */
    assert_memory_equal(&m.first, &before, sizeof before);
    /* From token 1 on, every page is taken, none counted yet. */
    assert_int_equal(m.second.tentative_pages, pages);
    assert_int_equal(m.second.held_pages, before.held_pages + pages);
    assert_int_equal(m.second.acquires, before.acquires);
    assert_int_equal(m.second.high_water_pages, before.high_water_pages);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.tentative_pages, 0);
    assert_int_equal(after.acquires, before.acquires + pages);
    assert_int_equal(after.held_pages, pages);
    assert_int_equal(after.high_water_pages, pages);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);
}

static int cached_setup(void **state)
{
    (void)state;
    cached_world = 1;
    return 0;
}

static int cached_teardown(void **state)
{
    cached_world = 0;
    return kvpt_disarm(state);
}

/* A world test again in the cached world (free list empty, LRU list holding cached pages). */
#define CACHED_TEST(f) {"cached: " #f, f, cached_setup, cached_teardown, NULL}

/* ---- a scheduler step the decoder refuses (DECODER_BUSY) --------------- */

/* Another caller's decoder step, held open in its next_input callback until released. */
typedef struct decoder_hold {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int inside;  /* its step is running, blocked in the callback */
    int release;
    kvp_decoder *decoder;
    kvp_sequence *sequence; /* on a pool of its own */
    kvp_status status;
} decoder_hold;

static void hold_next_input(void *ctx, size_t layer, const double *input, const double *output,
                            size_t elements, double *next)
{
    decoder_hold *h = ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
    pthread_mutex_lock(&h->lock);
    h->inside = 1;
    pthread_cond_broadcast(&h->changed);
    while (!h->release) {
        pthread_cond_wait(&h->changed, &h->lock);
    }
    pthread_mutex_unlock(&h->lock);
}

static void *hold_decoder(void *arg)
{
    decoder_hold *h = arg;
    double x[D];
    double out[D];
    kvpt_fill_random(x, D, 90);
    kvp_decode_job job;
    memset(&job, 0, sizeof job);
    job.sequence = h->sequence;
    job.kind = KVP_JOB_STEP;
    job.input = kvp_tensor3(x, 1, 1, D);
    job.output = out;
    job.output_len = D;
    h->status = kvp_decoder_step(h->decoder, &job, 1, hold_next_input, h, NULL);
    return NULL;
}

/* Rows: the first 8 prompt positions are every request's (a shared prefix), the rest their own. */
static void busy_rows(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                      size_t width)
{
    (void)ctx;
    uint64_t own = position < 8 ? 0 : 1000 * (id + 1) + 100 * sample;
    kvpt_fill_random(row, width, 5000 + own + position);
}

/* Submits (9 prompt tokens, 1 decoded, `samples`) and returns its id. */
static uint64_t busy_submit(kvp_scheduler *scheduler, size_t samples)
{
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = 9;
    request.max_new_tokens = 1;
    request.samples = samples;
    request.input = busy_rows;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(scheduler, &request, &id, &err), &err);
    return id;
}

/*
 * A scheduler step refused DECODER_BUSY for its prefill batch changes
 * nothing: request 0 (9 tokens) ran and published its prompt's 4 blocks,
 * now evictable; request 1 (the same 8 first rows, 2 samples) would adopt
 * them and need a second lease. While another caller's decoder step is held
 * open (barriers, so under any scheduling), the step is refused with
 * DECODER_BUSY and the pool (every counter: prefix hits and misses,
 * acquires, attached caches; the digest; the audit) and the scheduler's
 * counters (held samples included) are as before. It used to adopt
 * (prefix_hits + 8, those pages acquired and released) and keep the new
 * lease (attached_caches + 2) before undoing the admission. Released, the
 * next step admits request 1, adopting 8 tokens.
 */
static void test_nothing_changed_scheduler_step_decoder_busy(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_pool *hold_pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 91);
    kvp_decoder *decoder = kvpt_decoder(1);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 12;
    config.watermark = 0.0;
    config.reserve_tokens = 2;
    kvp_scheduler *scheduler = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &scheduler, &err), &err);
    busy_submit(scheduler, 1);
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvpt_assert_ok(kvp_scheduler_step(scheduler, &st, &err), &err);
    assert_int_equal(st.finished, 1);
    assert_int_equal(kvpt_stats(pool).evictable_pages, L * 5); /* 9 tokens: 5 blocks */
    busy_submit(scheduler, 2);

    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_take(&snap);
    kvp_scheduler_stats before;
    kvp_scheduler_stats_init(&before);
    kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &before, &err), &err);

    decoder_hold h;
    memset(&h, 0, sizeof h);
    pthread_mutex_init(&h.lock, NULL);
    pthread_cond_init(&h.changed, NULL);
    h.decoder = decoder;
    h.sequence = kvpt_sequence(model, hold_pool, 1, 4);
    h.status = KVP_STATUS_COUNT_;
    pthread_t holder;
    assert_int_equal(pthread_create(&holder, NULL, hold_decoder, &h), 0);
    pthread_mutex_lock(&h.lock);
    while (!h.inside) {
        pthread_cond_wait(&h.changed, &h.lock);
    }
    pthread_mutex_unlock(&h.lock);
    kvp_step_stats_init(&st);
    st.admitted = 77;
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_scheduler_step(scheduler, &st, &err), KVP_DECODER_BUSY);
    assert_int_equal(err.status, KVP_DECODER_BUSY);
    assert_int_equal(st.admitted, 77); /* stats untouched on failure */
    kvpt_assert_unchanged(&snap, 0);
    kvp_scheduler_stats now;
    kvp_scheduler_stats_init(&now);
    kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &now, &err), &err);
    assert_memory_equal(&now, &before, sizeof now);
    pthread_mutex_lock(&h.lock);
    h.release = 1;
    pthread_cond_broadcast(&h.changed);
    pthread_mutex_unlock(&h.lock);
    assert_int_equal(pthread_join(holder, NULL), 0);
    pthread_cond_destroy(&h.changed);
    pthread_mutex_destroy(&h.lock);
    kvpt_assert_ok(h.status, NULL);

    kvpt_assert_ok(kvp_scheduler_step(scheduler, &st, &err), &err);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 8);
    assert_int_equal(st.finished, 1);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_scheduler_destroy(scheduler, &err), &err);
    kvpt_destroy_sequence(h.sequence, hold_pool);
    kvpt_destroy_decoder(decoder);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(hold_pool);
    assert_int_equal(kvpt_stats(pool).held_pages, 0); /* the prefixes stay evictable */
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_nothing_changed_pool_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_cache_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_external_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_param_rope_layer_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_attention_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_model_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_sequence_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_failed_prefill_counters_exact, kvpt_disarm),
        cmocka_unit_test(test_nothing_changed_prefill_pages_are_tentative_until_success),
        cmocka_unit_test_teardown(test_nothing_changed_cancelled_takes_keep_cached_pages,
                                  kvpt_disarm),
        cmocka_unit_test(test_nothing_changed_failed_prefill_of_a_fork_keeps_cached_pages),
        cmocka_unit_test(test_nothing_changed_failed_prefill_loses_only_written_pages),
        CACHED_TEST(test_nothing_changed_pool_functions),
        CACHED_TEST(test_nothing_changed_cache_functions),
        CACHED_TEST(test_nothing_changed_external_functions),
        CACHED_TEST(test_nothing_changed_param_rope_layer_functions),
        CACHED_TEST(test_nothing_changed_attention_functions),
        CACHED_TEST(test_nothing_changed_model_functions),
        CACHED_TEST(test_nothing_changed_sequence_functions),
        CACHED_TEST(test_nothing_changed_failed_prefill_counters_exact),
        CACHED_TEST(test_nothing_changed_cancelled_takes_keep_cached_pages),
        cmocka_unit_test(test_nothing_changed_scheduler_step_decoder_busy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
