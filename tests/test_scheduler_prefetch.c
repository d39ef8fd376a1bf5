/*
 * test_scheduler_prefetch.c: the scheduler prefetches a waiting request's
 * missed prompt blocks from the pool's tier (kvpager/scheduler.h, 6.;
 * scheduler_tier.c; kvp_pool_tier_prefetch and kvp_cache_group_tier_map in
 * kvpager/tier.h).
 *
 * A held tier over a host tier: contains and puts go through at once; a get
 * goes through at once too until the test holds gets, and then waits until
 * the test releases it (completing it on the test's thread, optionally
 * corrupting a block first). A second held get fails the test: a scheduler
 * that waited for a held get would hang instead.
 *
 * The workload: request 0 publishes group 0's prompt (written through to
 * the tier), 1 (its own rows) and 2 (group 1) evict it from the pool; then
 * 3 (group 1: every adoptable block from the index) and 4 (group 0) are
 * submitted together: 3 is admitted, 4 waits for pages because its prefix
 * missed, and the plan's prefetch asks the tier for 4's missed run. The
 * cases, each compared bit for bit with the run without a tier and audited
 * (kvp_pool_check) after every step:
 *   - the prefetch completed before 4's admission: mapped, no second get;
 *   - still in flight at 4's admission: not waited for, 4 computes those
 *     blocks, counted late; the late completion frees its buffers;
 *   - a corrupted block in the prefetched buffers: rejected, counted,
 *     never mapped (the blocks before it are);
 *   - the scheduler destroyed with the prefetch in flight (its request
 *     dropped): the completion frees it, the pool detaches cleanly;
 *   - the pool's tier detached while the prefetch is in flight: the detach
 *     waits for it (forced: the test sees the detach under way, then
 *     releases), and 4 computes (the prefetch is counted wasted).
 * Threaded only in the last (the detaching thread); its pass condition
 * holds under any scheduling.
 * Callers: ctest (test_scheduler_prefetch, memcheck.test_scheduler_prefetch).
 */
#include "sched_tier_support.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

/* ---- a tier whose gets the test holds -------------------------------------------- */

#define MAX_KEYS 64

typedef struct held_tier {
    kvp_tier *inner; /* the host tier holding the blocks */
    int hold;        /* 1: the next get waits for held_release */
    size_t gets;     /* gets seen */
    size_t keys_asked; /* keys of the last get */
    kvp_block_key keys[MAX_KEYS];
    int held;        /* a get is held */
    kvp_tier_block *blocks;
    size_t count;
    kvp_tier_done_fn done;
    void *ctx;
} held_tier;

static kvp_status held_contains(void *impl, kvp_tier_block *blocks, size_t count,
                                kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    held_tier *h = impl;
    return kvp_tier_issue(h->inner, KVP_TIER_CONTAINS, blocks, count, done, ctx, err);
}

static kvp_status held_put(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    held_tier *h = impl;
    return kvp_tier_issue(h->inner, KVP_TIER_PUT, blocks, count, done, ctx, err);
}

static kvp_status held_get(void *impl, kvp_tier_block *blocks, size_t count,
                           kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    held_tier *h = impl;
    h->gets++;
    h->keys_asked = count;
    for (size_t i = 0; i < count && i < MAX_KEYS; i++) {
        h->keys[i] = blocks[i].key;
    }
    if (!h->hold) {
        return kvp_tier_issue(h->inner, KVP_TIER_GET, blocks, count, done, ctx, err);
    }
    if (h->held) {
        fail_msg("a second get while one is held: the scheduler would wait for it");
    }
    h->held = 1;
    h->blocks = blocks;
    h->count = count;
    h->done = done;
    h->ctx = ctx;
    return KVP_OK;
}

/* Completes the held get from the host tier; corrupt: block `corrupt - 1`'s last byte flipped. */
static void held_release(held_tier *h, size_t corrupt)
{
    assert_true(h->held);
    kvp_error err;
    kvpt_assert_ok(kvp_tier_run(h->inner, KVP_TIER_GET, h->blocks, h->count, &err), &err);
    if (corrupt != 0) {
        kvp_tier_block *b = &h->blocks[corrupt - 1];
        assert_int_equal(b->status, KVP_OK);
        assert_true(b->bytes > KVP_TIER_HEADER_BYTES);
        ((unsigned char *)b->data)[b->bytes - 1] ^= 0x5a;
    }
    h->held = 0;
    h->done(h->ctx, h->blocks, h->count);
}

static void held_destroy(void *impl)
{
    held_tier *h = impl;
    assert_false(h->held); /* every test releases what it held */
    kvpt_assert_ok(kvp_tier_destroy(h->inner, NULL), NULL);
}

static kvp_tier *held_create(held_tier *h)
{
    memset(h, 0, sizeof *h);
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_create(1u << 20, &h->inner, &err), &err);
    kvp_tier_vtable vtable;
    kvp_tier_vtable_init(&vtable);
    vtable.name = "held";
    vtable.contains = held_contains;
    vtable.get = held_get;
    vtable.put = held_put;
    vtable.destroy = held_destroy;
    kvp_tier *tier = NULL;
    kvpt_assert_ok(kvp_tier_create(&vtable, h, &tier, &err), &err);
    return tier;
}

/* ---- the workload ------------------------------------------------------------------ */

/* Steps until idle, then collects `n` results: every one succeeded. */
static void finish_all(fixture *f, book *b, size_t n)
{
    for (size_t steps = 0;; steps++) {
        kvp_scheduler_stats s = stats_of(f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(steps < 1000);
        step(f);
    }
    kvp_request_result results[2];
    for (size_t i = 0; i < n; i++) {
        kvp_request_result_init(&results[i]);
    }
    size_t got = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_collect(f->scheduler, results, n, &got, &err), &err);
    assert_int_equal(got, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(results[i].status, KVP_OK);
        assert_int_equal(b->tokens[results[i].id], NEW_TOKENS);
    }
}

/* Requests 0 (group 0), 1 (own rows), 2 (group 1), served one at a time: 0's blocks evicted. */
static void before(fixture *f, book *b)
{
    serve(f, b, 0, 0, PROMPT);
    serve(f, b, 1, 0, 0);
    serve(f, b, 2, 1, PROMPT);
}

/* Submits 3 (group 1) and 4 (group 0) and takes one step: 3 runs, 4 waits. */
static void first_step(fixture *f, book *b)
{
    submit(f, b, 3, 1, PROMPT - 1);
    submit(f, b, 4, 0, PROMPT - 1);
    step(f);
    kvp_scheduler_stats s = stats_of(f);
    assert_int_equal(s.running, 1);
    assert_int_equal(s.waiting, 1);
}

/* The run without a tier. */
static void plain_run(book *plain)
{
    memset(plain, 0, sizeof *plain);
    fixture f;
    setup_with(&f, model, 1, NULL, 0, 0, KVP_TIER_LOADS_ALWAYS);
    before(&f, plain);
    first_step(&f, plain);
    finish_all(&f, plain, 2);
    teardown(&f);
}

typedef struct run {
    held_tier h;
    kvp_tier *tier;
    fixture f;
    size_t gets; /* gets before 3 and 4 were submitted */
} run;

/* A tiered run up to 4's prefetch held: exactly one get, for 4's missed adoptable blocks. */
static void run_to_prefetch(run *r, book *b)
{
    memset(b, 0, sizeof *b);
    r->tier = held_create(&r->h);
    setup_with(&r->f, model, 1, r->tier, 1, 1, KVP_TIER_LOADS_ALWAYS);
    before(&r->f, b);
    r->gets = r->h.gets;
    r->h.hold = 1;
    first_step(&r->f, b);
    kvp_scheduler_stats s = stats_of(&r->f);
    assert_int_equal(s.tier_prefetches, 1);
    assert_int_equal(r->h.gets, r->gets + 1); /* the prefetch: no other get */
    assert_true(r->h.held);
    /* Whole blocks of every layer, at most the 8 adoptable ones. */
    assert_int_equal(r->h.keys_asked % LAYERS, 0);
    assert_true(r->h.keys_asked > 0 && r->h.keys_asked <= 8 * LAYERS);
}

static void run_end(run *r)
{
    teardown(&r->f);
    kvpt_assert_ok(kvp_tier_destroy(r->tier, NULL), NULL);
}

static book plain;

static int plain_setup(void **state)
{
    model_setup(state);
    plain_run(&plain);
    return 0;
}

/* ---- the cases ---------------------------------------------------------------------- */

/* Completed before the admission: mapped, with no further get; outputs bit-identical. */
static void test_prefetch_completed_is_mapped_without_a_second_get(void **state)
{
    (void)state;
    static book b;
    run r;
    run_to_prefetch(&r, &b);
    size_t asked = r.h.keys_asked / LAYERS;
    kvp_scheduler_stats at = stats_of(&r.f);
    held_release(&r.h, 0);
    r.h.hold = 0;
    finish_all(&r.f, &b, 2);
    kvp_scheduler_stats s = stats_of(&r.f);
    assert_int_equal(r.h.gets, r.gets + 1); /* no second round trip */
    assert_int_equal(s.tier_prefetch_used, 1);
    assert_int_equal(s.tier_prefetch_late, 0);
    assert_int_equal(s.tier_prefetch_wasted, 0);
    /* Every asked block mapped; with the index's, 4 adopted all 8 adoptable blocks. */
    assert_int_equal(s.tier_hit_blocks - at.tier_hit_blocks, asked);
    assert_int_equal(s.prefix_hit_tokens - at.prefix_hit_tokens, 8 * BLOCK);
    assert_int_equal(s.tier_rejected, 0);
    assert_true(s.tier_bytes_per_second > 0.0); /* the prefetch's rate measured */
    run_end(&r);
    assert_outputs_equal(&plain, &b, 5);
}

/* Still in flight at the admission: no wait, computed, counted late; freed when it ends. */
static void test_prefetch_in_flight_at_admission_is_late(void **state)
{
    (void)state;
    static book b;
    run r;
    run_to_prefetch(&r, &b);
    kvp_scheduler_stats at = stats_of(&r.f);
    finish_all(&r.f, &b, 2); /* the get stays held: a wait would hang, a get would fail */
    kvp_scheduler_stats s = stats_of(&r.f);
    assert_int_equal(r.h.gets, r.gets + 1);
    assert_int_equal(s.tier_prefetch_late, 1);
    assert_int_equal(s.tier_prefetch_used, 0);
    assert_int_equal(s.tier_hit_blocks, at.tier_hit_blocks);
    assert_true(s.prefill_tokens - at.prefill_tokens >= r.h.keys_asked / LAYERS * BLOCK);
    held_release(&r.h, 0); /* the late completion frees the cancelled prefetch */
    kvpt_assert_pool_ok(r.f.pool);
    run_end(&r);
    assert_outputs_equal(&plain, &b, 5);
}

/* A corrupted block in the prefetched buffers: rejected and counted, never mapped. */
static void test_prefetch_garbage_is_rejected(void **state)
{
    (void)state;
    static book b;
    run r;
    run_to_prefetch(&r, &b);
    size_t asked = r.h.keys_asked / LAYERS;
    kvp_scheduler_stats at = stats_of(&r.f);
    held_release(&r.h, r.h.keys_asked); /* the last block's last layer */
    r.h.hold = 0;
    finish_all(&r.f, &b, 2);
    kvp_scheduler_stats s = stats_of(&r.f);
    assert_int_equal(r.h.gets, r.gets + 1);
    assert_int_equal(s.tier_prefetch_used, 1);
    assert_int_equal(s.tier_rejected - at.tier_rejected, 1);
    assert_int_equal(s.tier_hit_blocks - at.tier_hit_blocks, asked - 1); /* the run before it */
    kvp_pool_tier_stats ts;
    kvp_pool_tier_stats_init(&ts);
    kvpt_assert_ok(kvp_pool_tier_stats_get(r.f.pool, &ts, NULL), NULL);
    assert_int_equal(ts.rejected_mac, 1);
    run_end(&r);
    assert_outputs_equal(&plain, &b, 5);
}

/* The scheduler destroyed (its waiting request dropped) with the prefetch in flight. */
static void test_prefetch_dropped_in_flight(void **state)
{
    (void)state;
    static book b;
    run r;
    run_to_prefetch(&r, &b);
    kvpt_assert_ok(kvp_scheduler_destroy(r.f.scheduler, NULL), NULL); /* cancels it */
    held_release(&r.h, 0); /* its completion frees it */
    kvpt_assert_pool_ok(r.f.pool);
    kvpt_destroy_decoder(r.f.decoder);
    kvpt_assert_ok(kvp_pool_destroy(r.f.pool, NULL), NULL); /* detaches: no user left */
    kvpt_assert_ok(kvp_tier_destroy(r.tier, NULL), NULL);
}

typedef struct detacher {
    kvp_pool *pool;
    atomic_int released; /* the test released the held get */
    atomic_int returned; /* the detach returned */
    int released_first;  /* the detach returned after the release */
} detacher;

static void *detach_thread(void *arg)
{
    detacher *d = arg;
    kvpt_assert_ok(kvp_pool_tier_detach(d->pool, NULL), NULL);
    d->released_first = atomic_load(&d->released);
    atomic_store(&d->returned, 1);
    return NULL;
}

/* The pool's tier detached with the prefetch in flight: the detach waits for it. */
static void test_prefetch_detach_waits_for_it(void **state)
{
    (void)state;
    static book b;
    run r;
    run_to_prefetch(&r, &b);
    detacher d;
    memset(&d, 0, sizeof d);
    d.pool = r.f.pool;
    pthread_t thread;
    assert_int_equal(pthread_create(&thread, NULL, detach_thread, &d), 0);
    /* The detach is under way once the pool has no tier; it then waits for the get. */
    kvp_pool_tier_stats ts;
    kvp_pool_tier_stats_init(&ts);
    while (kvp_pool_tier_stats_get(r.f.pool, &ts, NULL) == KVP_OK) {
        nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    assert_int_equal(atomic_load(&d.returned), 0); /* a user is in flight */
    atomic_store(&d.released, 1);
    held_release(&r.h, 0);
    assert_int_equal(pthread_join(thread, NULL), 0);
    assert_int_equal(d.released_first, 1);
    r.h.hold = 0;
    finish_all(&r.f, &b, 2); /* 4's prefetch maps under no tier: wasted, 4 computes */
    kvp_scheduler_stats s = stats_of(&r.f);
    assert_int_equal(s.tier_prefetch_wasted, 1);
    assert_int_equal(s.tier_prefetch_used, 0);
    assert_int_equal(r.h.gets, r.gets + 1);
    run_end(&r);
    assert_outputs_equal(&plain, &b, 5);
}

/* tier_prefetch defaults to 2; past KVP_TIER_PREFETCH_MAX it is refused. */
static void test_prefetch_bad_config(void **state)
{
    (void)state;
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    assert_int_equal(config.tier_prefetch, 2);
    config.capacity = CAPACITY;
    config.tier_prefetch = KVP_TIER_PREFETCH_MAX + 1;
    fixture f;
    setup_with(&f, model, 1, NULL, 0, 0, KVP_TIER_LOADS_ALWAYS);
    kvp_scheduler *bad = NULL;
    kvp_error err;
    assert_int_equal(kvp_scheduler_create(f.model, f.pool, f.decoder, &config, &bad, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "tier_prefetch");
    assert_null(bad);
    teardown(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefetch_completed_is_mapped_without_a_second_get),
        cmocka_unit_test(test_prefetch_in_flight_at_admission_is_late),
        cmocka_unit_test(test_prefetch_garbage_is_rejected),
        cmocka_unit_test(test_prefetch_dropped_in_flight),
        cmocka_unit_test(test_prefetch_detach_waits_for_it),
        cmocka_unit_test(test_prefetch_bad_config),
    };
    return cmocka_run_group_tests(tests, plain_setup, model_teardown);
}
