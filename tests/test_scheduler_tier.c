/*
 * test_scheduler_tier.c: the scheduler reads the pool's second tier
 * (kvpager/scheduler.h, 6.; scheduler_tier.c).
 *
 * A computed scheduler over a small pool runs a prompt, then other prompts
 * that evict its published blocks, then a prompt sharing its prefix: with a
 * host tier attached the evicted blocks are loaded instead of computed.
 * Every output is compared bit for bit with the run without a tier, the
 * pool is audited after every step, and the tier counters are checked
 * exactly. Also: a second scheduler on a fresh pool (another "process")
 * reads the first one's blocks from the shared tier; blocks under another
 * deployment secret are rejected, counted and never mapped; tier_loads
 * NEVER reads nothing; a bad tier_loads is refused; an allocator-only
 * scheduler over a pool without data loads the same blocks from a
 * keys-only tier; neither a load nor an allocator-only append in a step
 * borrows an evictable hit a later request of the step counted (every
 * admitted request adopts first).
 * Deterministic: one decoder thread, requests one at a time (the
 * adoption-order test: a few a step, admitted in queue order).
 */
#include "sched_tier_support.h"

static void setup(fixture *f, kvp_tier *tier, unsigned char seed, int write_through,
                  kvp_tier_loads loads)
{
    setup_with(f, model, 1, tier, seed, write_through, loads);
}

/* Request 0 (group 0), requests 1 and 2 (their own rows: they evict 0's blocks), request 3 (group 0). */
static void workload(fixture *f, book *b)
{
    serve(f, b, 0, 0, PROMPT);
    serve(f, b, 1, 0, 0);
    serve(f, b, 2, 0, 0);
    serve(f, b, 3, 0, PROMPT - 1);
}

static kvp_tier *host(void)
{
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_create(1u << 20, &tier, &err), &err);
    return tier;
}

static size_t block_bytes(void)
{
    return KVP_TIER_HEADER_BYTES + KV_HEADS * BLOCK * HEAD_WIDTH * 2 * sizeof(double);
}

static void test_scheduler_tier_loads_evicted_prefix_exactly(void **state)
{
    (void)state;
    static book plain, tiered;
    memset(&plain, 0, sizeof plain);
    memset(&tiered, 0, sizeof tiered);
    fixture f;
    setup(&f, NULL, 0, 0, KVP_TIER_LOADS_MODEL);
    workload(&f, &plain);
    kvp_scheduler_stats without = stats_of(&f);
    teardown(&f);

    kvp_tier *tier = host();
    setup(&f, tier, 1, 0, KVP_TIER_LOADS_ALWAYS);
    workload(&f, &tiered);
    kvp_scheduler_stats with = stats_of(&f);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);

    assert_outputs_equal(&plain, &tiered, 4);
    /* Without a tier, request 3 found (some of) request 0's blocks evicted. */
    assert_true(without.prefix_hit_tokens < 8 * BLOCK);
    /* With one, every adoptable block: from the index, or loaded. */
    assert_int_equal(with.prefix_hit_tokens, 8 * BLOCK);
    assert_true(with.tier_hit_blocks > 0);
    assert_int_equal(with.tier_hit_blocks, 8 - without.prefix_hit_tokens / BLOCK);
    assert_int_equal(with.tier_hit_tokens, with.tier_hit_blocks * BLOCK);
    assert_int_equal(with.tier_load_bytes, with.tier_hit_blocks * LAYERS * block_bytes());
    assert_true(with.tier_load_seconds > 0.0);
    assert_int_equal(with.prefill_tokens, without.prefill_tokens - with.tier_hit_tokens);
    assert_int_equal(with.tier_rejected, 0);
    assert_int_equal(with.tier_errors, 0);
    assert_int_equal(with.tier_recomputes, 0);
    assert_int_equal(without.tier_hit_blocks, 0);
    /* The cost model's rates: measured once a load brought blocks, and a prefill ran. */
    assert_true(with.tier_bytes_per_second > 0.0);
    assert_true(with.prefill_tokens_per_second > 0.0);
    assert_true(without.tier_bytes_per_second == 0.0);
    assert_true(without.prefill_tokens_per_second > 0.0);
}

/*
 * Two "processes": a scheduler on its own pool (the same key secret)
 * publishes through to a tier; a second one, on a fresh pool, reads every
 * adoptable block of the same prompt from it. tier_loads MODEL: the first
 * ask loads (the optimistic prior, nothing measured yet).
 */
static void test_scheduler_tier_second_pool_reads_first_ones_blocks(void **state)
{
    (void)state;
    static book first, second;
    memset(&first, 0, sizeof first);
    memset(&second, 0, sizeof second);
    kvp_tier *tier = host();
    fixture f;
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_MODEL);
    serve(&f, &first, 0, 0, PROMPT);
    kvp_scheduler_stats one = stats_of(&f);
    teardown(&f);
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_MODEL);
    serve(&f, &second, 0, 0, PROMPT);
    kvp_scheduler_stats two = stats_of(&f);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    assert_outputs_equal(&first, &second, 1);
    assert_int_equal(one.tier_hit_blocks, 0);
    assert_int_equal(two.tier_hit_blocks, 8);
    assert_int_equal(two.prefix_hit_tokens, 8 * BLOCK);
    assert_int_equal(two.prefill_tokens, one.prefill_tokens - 8 * BLOCK);
}

/* Blocks under another deployment secret: rejected, counted, never mapped; outputs unchanged. */
static void test_scheduler_tier_foreign_blocks_are_rejected(void **state)
{
    (void)state;
    static book first, second;
    memset(&first, 0, sizeof first);
    memset(&second, 0, sizeof second);
    kvp_tier *tier = host();
    fixture f;
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_ALWAYS);
    serve(&f, &first, 0, 0, PROMPT);
    kvp_scheduler_stats one = stats_of(&f);
    teardown(&f);
    setup(&f, tier, 2, 1, KVP_TIER_LOADS_ALWAYS); /* another secret */
    serve(&f, &second, 0, 0, PROMPT);
    kvp_scheduler_stats two = stats_of(&f);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    assert_outputs_equal(&first, &second, 1);
    assert_int_equal(two.tier_hit_blocks, 0);
    assert_int_equal(two.tier_rejected, 8 * LAYERS); /* every page of every block asked */
    assert_int_equal(two.prefill_tokens, one.prefill_tokens);
}

/*
 * A tier that fails: `refuse` 1 refuses every batch (the load is refused:
 * one error), 0 accepts it and completes every block TIER_UNAVAILABLE (one
 * error a page). Puts are taken and dropped.
 */
typedef struct failing {
    int refuse;
} failing;

static kvp_status failing_batch(void *impl, kvp_tier_block *blocks, size_t count,
                                kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    const failing *f = impl;
    if (f->refuse) {
        if (err != NULL) {
            memset(err, 0, sizeof *err);
            err->status = KVP_TIER_UNAVAILABLE;
        }
        return KVP_TIER_UNAVAILABLE;
    }
    for (size_t i = 0; i < count; i++) {
        blocks[i].bytes = 0;
        blocks[i].status = KVP_TIER_UNAVAILABLE;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static kvp_status put_dropped(void *impl, kvp_tier_block *blocks, size_t count,
                              kvp_tier_done_fn done, void *ctx, kvp_error *err)
{
    (void)impl;
    (void)err;
    for (size_t i = 0; i < count; i++) {
        blocks[i].status = KVP_OK;
    }
    done(ctx, blocks, count);
    return KVP_OK;
}

static void failing_destroy(void *impl)
{
    (void)impl;
}

static kvp_tier *failing_tier(failing *f)
{
    kvp_tier_vtable vtable;
    kvp_tier_vtable_init(&vtable);
    vtable.name = "failing";
    vtable.contains = failing_batch;
    vtable.get = failing_batch;
    vtable.put = put_dropped;
    vtable.destroy = failing_destroy;
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_create(&vtable, f, &tier, &err), &err);
    return tier;
}

/* A tier that fails or refuses every load: the run computes as without one, errors counted. */
static void test_scheduler_tier_failing_tier_changes_nothing(void **state)
{
    (void)state;
    static book plain, failed;
    for (int refuse = 0; refuse < 2; refuse++) {
        memset(&plain, 0, sizeof plain);
        memset(&failed, 0, sizeof failed);
        fixture f;
        setup(&f, NULL, 0, 0, KVP_TIER_LOADS_ALWAYS);
        workload(&f, &plain);
        kvp_scheduler_stats without = stats_of(&f);
        teardown(&f);
        failing impl = {refuse};
        kvp_tier *tier = failing_tier(&impl);
        setup(&f, tier, 1, 0, KVP_TIER_LOADS_ALWAYS);
        workload(&f, &failed);
        kvp_scheduler_stats with = stats_of(&f);
        teardown(&f);
        kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
        assert_outputs_equal(&plain, &failed, 4);
        assert_int_equal(with.prefill_tokens, without.prefill_tokens);
        assert_int_equal(with.prefix_hit_tokens, without.prefix_hit_tokens);
        assert_int_equal(with.tier_hit_blocks, 0);
        assert_int_equal(with.tier_load_bytes, 0);
        assert_int_equal(with.tier_rejected, 0);
        /* Each of the 4 requests asked once for its 8 adoptable blocks less those the
           index held (only request 3 held some, fewer than 8: checked above): a refused
           ask is one error, a failed one an error a page. */
        assert_true(without.prefix_hit_tokens < 8 * BLOCK);
        uint64_t asked = 4 * 8 - without.prefix_hit_tokens / BLOCK;
        assert_int_equal(with.tier_errors, refuse ? 4 : asked * LAYERS);
    }
}

/* tier_loads NEVER asks nothing; a value past NEVER is refused. */
static void test_scheduler_tier_never_and_bad_loads(void **state)
{
    (void)state;
    static book first, second;
    memset(&first, 0, sizeof first);
    memset(&second, 0, sizeof second);
    kvp_tier *tier = host();
    fixture f;
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_NEVER);
    serve(&f, &first, 0, 0, PROMPT);
    teardown(&f);
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_NEVER);
    serve(&f, &second, 0, 0, PROMPT);
    kvp_scheduler_stats two = stats_of(&f);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = CAPACITY;
    config.tier_loads = KVP_TIER_LOADS_NEVER + 1;
    kvp_scheduler *bad = NULL;
    kvp_error err;
    assert_int_equal(kvp_scheduler_create(f.model, f.pool, f.decoder, &config, &bad, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "tier_loads");
    assert_null(bad);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    assert_outputs_equal(&first, &second, 1);
    assert_int_equal(two.tier_hit_blocks, 0);
    assert_int_equal(two.tier_recomputes, 0);
    assert_int_equal(two.tier_load_bytes, 0);
}

/* ---- allocator-only: a pool without data and a keys-only tier ---- */

/* An allocator-only scheduler (compute 0) over a KVP_SLAB_RESERVED pool; tier keys-only or NULL. */
static void setup_alloc(fixture *f, kvp_tier *tier)
{
    memset(f, 0, sizeof *f);
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = KV_HEADS;
    config.head_width = HEAD_WIDTH;
    config.budget_bytes = (size_t)PAGES * 2 * KV_HEADS * BLOCK * HEAD_WIDTH * sizeof(double);
    config.slab_source = KVP_SLAB_RESERVED;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &f->pool, &err), &err);
    if (tier != NULL) {
        kvp_tier_policy policy;
        kvp_tier_policy_init(&policy);
        sched_secret_fill(policy.secret, 1);
        kvpt_assert_ok(kvp_pool_tier_attach(f->pool, tier, &policy, &err), &err);
    }
    f->decoder = kvpt_decoder(1);
    kvp_scheduler_config sc;
    kvp_scheduler_config_init(&sc);
    sc.capacity = CAPACITY;
    sc.watermark = 0.0;
    sc.reserve_tokens = 4;
    sc.compute = 0;
    sc.identity = SEED;
    sc.layers = LAYERS;
    sc.model_width = WIDTH;
    sc.tier_loads = KVP_TIER_LOADS_MODEL; /* allocator-only: always loads (no rates) */
    kvpt_assert_ok(kvp_scheduler_create(NULL, f->pool, f->decoder, &sc, &f->scheduler, &err),
                   &err);
}

/* As serve(), for an allocator-only run: no output rows (no on_token). */
static void serve_alloc(fixture *f, book *b, uint64_t id, size_t shared)
{
    b->shared[id] = shared;
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = PROMPT;
    request.max_new_tokens = NEW_TOKENS;
    request.input = input_cb;
    request.ctx = b;
    uint64_t got = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &request, &got, &err), &err);
    assert_int_equal(got, id);
    for (size_t steps = 0;; steps++) {
        kvp_scheduler_stats s = stats_of(f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(steps < 1000);
        kvpt_assert_ok(kvp_scheduler_step(f->scheduler, NULL, &err), &err);
        kvpt_assert_pool_ok(f->pool); /* the full audit after every step */
        kvpt_assert_committed(f->pool);
    }
    kvp_request_result result;
    kvp_request_result_init(&result);
    size_t n = 0;
    kvpt_assert_ok(kvp_scheduler_collect(f->scheduler, &result, 1, &n, &err), &err);
    assert_int_equal(n, 1);
    assert_int_equal(result.status, KVP_OK);
}

static kvp_scheduler_stats alloc_workload(kvp_tier *tier)
{
    static book b;
    memset(&b, 0, sizeof b);
    fixture f;
    setup_alloc(&f, tier);
    serve_alloc(&f, &b, 0, PROMPT);
    serve_alloc(&f, &b, 1, 0);
    serve_alloc(&f, &b, 2, 0);
    serve_alloc(&f, &b, 3, PROMPT - 1);
    kvp_scheduler_stats s = stats_of(&f);
    teardown(&f);
    return s;
}

/*
 * The workload of the first test, allocator-only: the keys-only tier gives
 * request 3 every block the pool evicted, exactly as the byte tier does a
 * computed run, with no byte read or written; the cost model loads (no
 * rates are measured: both stay 0).
 */
static void test_scheduler_tier_allocator_only_keys(void **state)
{
    (void)state;
    kvp_scheduler_stats without = alloc_workload(NULL);
    kvp_tier *tier = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_tier_host_keys_create(1u << 20, &tier, &err), &err);
    kvp_scheduler_stats with = alloc_workload(tier);
    kvp_tier_host_stats hs;
    kvp_tier_host_stats_init(&hs);
    kvpt_assert_ok(kvp_tier_host_stats_get(tier, &hs, &err), &err);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);
    assert_true(without.prefix_hit_tokens < 8 * BLOCK);
    assert_int_equal(with.prefix_hit_tokens, 8 * BLOCK);
    assert_true(with.tier_hit_blocks > 0);
    assert_int_equal(with.tier_hit_blocks, 8 - without.prefix_hit_tokens / BLOCK);
    assert_int_equal(with.tier_hit_tokens, with.tier_hit_blocks * BLOCK);
    assert_int_equal(with.tier_load_bytes, with.tier_hit_blocks * LAYERS * block_bytes());
    assert_int_equal(with.prefill_tokens, without.prefill_tokens - with.tier_hit_tokens);
    assert_int_equal(with.tier_rejected, 0);
    assert_int_equal(with.tier_errors, 0);
    assert_int_equal(with.tier_recomputes, 0);
    assert_true(with.tier_bytes_per_second == 0.0);
    assert_int_equal(hs.hits, with.tier_hit_blocks * LAYERS);
    assert_int_equal(hs.bytes, hs.blocks * block_bytes());
}

static void run_idle(fixture *f)
{
    for (size_t steps = 0; stats_of(f).running + stats_of(f).waiting != 0; steps++) {
        assert_true(steps < 100);
        step(f);
    }
}

#define ORDER_REQUESTS 5

/*
 * Step 0 admits Y (id 0: 17 own rows, 4 full blocks), X (1: group 1's
 * first 5 rows) and R (2: group 1's first 9 rows, 3 new tokens). X and R
 * both compute block 0; X publishes it first, so R's block 0 stays
 * unregistered and R registers block 1. Y and X finish in step 0, X's
 * pages released first (the LRU's head); R runs on. So after step 0: R holds
 * 6 pages, 10 evictable (X's block 0, then Y's 4 blocks, least recent
 * first), 8 free, nothing promised; the index maps group 1's block 0 to
 * X's evictable pages and block 1 to R's held ones. Step 1 admits A (3:
 * group 2's 21 rows, 5 blocks, in the tier when `tiered`) then B (4:
 * group 1's first 8 rows, 13 in all): B's probe finds blocks 0
 * (evictable: 2 pages) and 1 (held: 0), so A (12 pages) and B (4 + 2)
 * ask the 18 pages there are. A's load takes 10 pages: the 8 free ones
 * and 2 borrowed from the LRU's head, X's (B failing on the old order
 * shows it: with Y's borrowed instead B would have adopted block 0).
 */
static void order_workload(fixture *f, book *b, kvp_request_result *results, int outputs)
{
    submit_len(f, b, 0, 0, 0, 17, 1, outputs);  /* Y */
    submit_len(f, b, 1, 1, 5, 5, 1, outputs);   /* X */
    submit_len(f, b, 2, 1, 9, 9, 3, outputs);   /* R */
    step(f);
    kvp_pool_stats ps;
    kvp_pool_stats_init(&ps);
    kvpt_assert_ok(kvp_pool_stats_get(f->pool, &ps, NULL), NULL);
    assert_int_equal(ps.total_pages, 24);
    assert_int_equal(ps.held_pages, 6);
    assert_int_equal(ps.evictable_pages, 10);
    assert_int_equal(ps.free_pages, 8);
    assert_int_equal(ps.promised_pages, 0);
    assert_int_equal(stats_of(f).running, 1);
    submit_len(f, b, 3, 2, 21, 21, 1, outputs); /* A */
    submit_len(f, b, 4, 1, 8, 13, 1, outputs);  /* B */
    run_idle(f);
    size_t n = 0;
    kvp_request_result got[ORDER_REQUESTS];
    for (size_t i = 0; i < ORDER_REQUESTS; i++) {
        kvp_request_result_init(&got[i]);
    }
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_collect(f->scheduler, got, ORDER_REQUESTS, &n, &err), &err);
    assert_int_equal(n, ORDER_REQUESTS);
    for (size_t i = 0; i < ORDER_REQUESTS; i++) {
        assert_true(got[i].id < ORDER_REQUESTS);
        results[got[i].id] = got[i];
    }
}

/*
 * One step admits A then B; A's tier load takes fresh pages with none
 * free, so it borrows the least recently used cached ones: X's block 0,
 * which B's probe counted as a hit. Adopting after A's load, B would find
 * no block 0, compute blocks 0 and 1 (block 1's 2 pages admission charged
 * nothing, R holds them) and need 2 pages more than the pool has: failed,
 * POOL_EXHAUSTED. Every admitted request adopts before any load, so B
 * holds blocks 0 and 1 first, A's load borrows Y's pages, and everything
 * fits exactly, outputs bit for bit those without a tier.
 */
static void test_scheduler_tier_load_after_every_adoption(void **state)
{
    (void)state;
    static book plain, first, tiered;
    memset(&plain, 0, sizeof plain);
    memset(&first, 0, sizeof first);
    memset(&tiered, 0, sizeof tiered);
    kvp_request_result without[ORDER_REQUESTS], with[ORDER_REQUESTS];
    fixture f;
    setup(&f, NULL, 0, 0, KVP_TIER_LOADS_MODEL);
    order_workload(&f, &plain, without, 1);
    teardown(&f);

    kvp_tier *tier = host();
    setup(&f, tier, 1, 1, KVP_TIER_LOADS_ALWAYS); /* another pool puts A's prompt in the tier */
    submit_len(&f, &first, 0, 2, 21, 21, 1, 1);
    run_idle(&f);
    teardown(&f);
    setup(&f, tier, 1, 0, KVP_TIER_LOADS_ALWAYS);
    order_workload(&f, &tiered, with, 1);
    kvp_scheduler_stats ts = stats_of(&f);
    teardown(&f);
    kvpt_assert_ok(kvp_tier_destroy(tier, NULL), NULL);

    for (size_t i = 0; i < ORDER_REQUESTS; i++) {
        assert_int_equal(without[i].status, KVP_OK);
        assert_int_equal(with[i].status, KVP_OK); /* B: POOL_EXHAUSTED when A's load ran first */
    }
    assert_outputs_equal(&plain, &tiered, ORDER_REQUESTS);
    assert_int_equal(plain.tokens[4], 1);
    assert_int_equal(without[4].first_hit_tokens, 2 * BLOCK);
    assert_int_equal(with[4].first_hit_tokens, 2 * BLOCK); /* B adopted blocks 0 and 1 */
    assert_int_equal(without[3].first_hit_tokens, 0);
    assert_int_equal(with[3].first_hit_tokens, 5 * BLOCK); /* A: loaded */
    assert_int_equal(ts.tier_hit_blocks, 5);
}

/*
 * The same shape without a tier: an allocator-only lease appends its
 * prompt at once (no decoder job), so A's append (12 pages, 8 free) would
 * borrow X's block 0 before B adopts it, and B would fail as above.
 */
static void test_scheduler_allocator_append_after_every_adoption(void **state)
{
    (void)state;
    static book b;
    memset(&b, 0, sizeof b);
    kvp_request_result results[ORDER_REQUESTS];
    fixture f;
    setup_alloc(&f, NULL);
    order_workload(&f, &b, results, 0);
    teardown(&f);
    for (size_t i = 0; i < ORDER_REQUESTS; i++) {
        assert_int_equal(results[i].status, KVP_OK); /* B: POOL_EXHAUSTED with A's append first */
        assert_int_equal(results[i].tokens_generated, i == 2 ? 3 : 1);
    }
    assert_int_equal(results[4].first_hit_tokens, 2 * BLOCK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scheduler_tier_loads_evicted_prefix_exactly),
        cmocka_unit_test(test_scheduler_tier_second_pool_reads_first_ones_blocks),
        cmocka_unit_test(test_scheduler_tier_foreign_blocks_are_rejected),
        cmocka_unit_test(test_scheduler_tier_failing_tier_changes_nothing),
        cmocka_unit_test(test_scheduler_tier_never_and_bad_loads),
        cmocka_unit_test(test_scheduler_tier_allocator_only_keys),
        cmocka_unit_test(test_scheduler_tier_load_after_every_adoption),
        cmocka_unit_test(test_scheduler_allocator_append_after_every_adoption),
    };
    return cmocka_run_group_tests(tests, model_setup, model_teardown);
}
