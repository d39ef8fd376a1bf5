/*
 * test_scheduler.c: the continuous-batching scheduler (kvpager/scheduler.h)
 * through its public API, its schedule and its refusals, over pools small
 * enough to force what each test is about:
 *   - every request runs to its output budget, and every decoded token's
 *     output is bit-identical to a fresh sequence fed the same rows alone,
 *     with and without preemption by recompute (a pool too small for all),
 *     with 1 and 2 decoder threads, with prompt rows or an input callback;
 *   - a request that can never fit is rejected, and the others still run;
 *   - compute off (external caches) takes the same schedule: the same
 *     counters, preemptions included, with a model or without one (the
 *     config's geometry); create refuses a missing model or geometry,
 *     changing nothing;
 *   - max_running caps the sequences decoded per step;
 *   - create, submit, step and collect refuse bad input with typed errors
 *     and change nothing (stats, ids, pool);
 *   - an allocation fault at every allocation of a step changes nothing
 *     (the scheduler's counters and the pool's), and the run then finishes
 *     with the same outputs; a failed step keeps the stale idle leases;
 *   - records are recycled once collected: ids stay unique, a collected id
 *     is REQUEST_UNKNOWN, and a steady stream allocates nothing once warm;
 *   - admission counts evictable pages as available; collect before any
 *     step and an allocator-only request with nothing to key are handled.
 * Sharing, samples and weight updates: test_scheduler_sharing.c; sessions:
 * test_scheduler_sessions.c; the fixture all three use: sched_support.h.
 * kvp_pool_check runs after every step. Unit test: public API, plus the
 * fault injector (pager/alloc.h). Run by ctest (test_scheduler).
 */
#include "sched_support.h"

static void row_of(uint64_t id, size_t position, double *row, size_t width)
{
    (void)width;
    static const book plain; /* no shared prefix: sample 0's rows */
    row_at(&plain, id, 0, position, row);
}

/* The five requests of the runs below: (prompt, new tokens). */
static const size_t lengths[5][2] = {{5, 9}, {12, 3}, {1, 14}, {8, 8}, {3, 1}};

static void run_five(size_t pages, size_t threads, int prompt_rows, size_t *preemptions)
{
    fixture f;
    setup_fixture(&f, pages, threads, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    static double rows[5][CAPACITY][WIDTH];
    for (size_t i = 0; i < 5; i++) {
        for (size_t t = 0; t < lengths[i][0]; t++) {
            row_of(i, t, rows[i][t], WIDTH);
        }
        uint64_t id = submit(&f, &b, lengths[i][0], lengths[i][1],
                             prompt_rows ? &rows[i][0][0] : NULL);
        assert_int_equal(id, i);
    }
    run(&f, 0);
    kvp_request_result done[8];
    size_t n = collect_all(&f, done, 8);
    assert_int_equal(n, 5);
    size_t seen = 0;
    uint64_t tokens = 0;
    size_t preempted = 0;
    size_t recomputed = 0;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(done[i].status, KVP_OK);
        assert_false(done[i].rejected);
        assert_true(done[i].id < 5);
        seen |= (size_t)1 << done[i].id;
        assert_int_equal(done[i].tokens_generated, lengths[done[i].id][1]);
        tokens += done[i].tokens_generated;
        preempted += done[i].preemptions;
        /* Each request's schedule: admitted 1 + preemptions times; no prefix is shared, so
         * the first admission adopts nothing and every later one recomputes. */
        assert_int_equal(done[i].admissions, 1 + done[i].preemptions);
        assert_int_equal(done[i].first_hit_tokens, 0);
        assert_true(done[i].preemptions > 0 || done[i].recomputed_tokens == 0);
        assert_true(done[i].preemptions == 0 || done[i].recomputed_tokens > 0);
        recomputed += done[i].recomputed_tokens;
        assert_true(done[i].admitted_step <= done[i].first_token_step);
        assert_true(done[i].first_token_step <= done[i].finished_step);
    }
    assert_int_equal(seen, 0x1f);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.submitted, 5);
    assert_int_equal(s.completed, 5);
    assert_int_equal(s.rejected, 0);
    assert_int_equal(s.tokens_generated, tokens);
    assert_int_equal(s.preemptions, preempted);
    assert_int_equal(s.uncollected, 0);
    /* Prefill tokens: every prompt once, plus each recomputation's prompt and output so far. */
    assert_true(s.prefill_tokens >= 5 + 12 + 1 + 8 + 3);
    assert_true(s.preemptions > 0 || s.prefill_tokens == 5 + 12 + 1 + 8 + 3);
    /* The requests' recomputed tokens are exactly the prefill beyond every prompt once. */
    assert_int_equal(s.prefill_tokens, 5 + 12 + 1 + 8 + 3 + recomputed);
    for (size_t i = 0; i < 5; i++) {
        assert_outputs_exact(&b, i, lengths[i][0], lengths[i][1]);
    }
    *preemptions = (size_t)s.preemptions;
    teardown_fixture(&f);
}

static void test_scheduler_runs_every_request_exactly(void **state)
{
    (void)state;
    size_t preemptions = SIZE_MAX;
    run_five(64, 1, 1, &preemptions); /* room for all: no preemption */
    assert_int_equal(preemptions, 0);
    run_five(64, 2, 0, &preemptions);
    assert_int_equal(preemptions, 0);
}

static void test_scheduler_preempts_by_recompute_exactly(void **state)
{
    (void)state;
    /*
     * 12 pages of 4 positions, 2 layers: the 5 requests' whole lengths need
     * 2 x (4 + 4 + 4 + 4 + 1) = 34 pages, so admission with a 4-token
     * reserve lets more in than can finish together, and growth preempts.
     */
    size_t preemptions = 0;
    run_five(12, 1, 1, &preemptions);
    assert_true(preemptions > 0);
    run_five(12, 2, 0, &preemptions);
    assert_true(preemptions > 0);
}

static void test_scheduler_rejects_what_never_fits(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 8, 1, 1, 0); /* 8 pages: 2 layers x 16 positions at most */
    static book b;
    memset(&b, 0, sizeof b);
    uint64_t small = submit(&f, &b, 4, 4, NULL);   /* 2 x 2 pages */
    uint64_t huge = submit(&f, &b, 20, 20, NULL);  /* 2 x 10 pages: never */
    uint64_t after = submit(&f, &b, 2, 3, NULL);
    run(&f, 0);
    kvp_request_result done[4];
    size_t n = collect_all(&f, done, 4);
    assert_int_equal(n, 3);
    int found = 0;
    for (size_t i = 0; i < n; i++) {
        if (done[i].id == huge) {
            assert_true(done[i].rejected);
            assert_int_equal(done[i].tokens_generated, 0);
            found = 1;
        } else {
            assert_false(done[i].rejected);
            assert_int_equal(done[i].status, KVP_OK);
        }
    }
    assert_true(found);
    assert_int_equal(b.tokens[huge][0], 0);
    assert_outputs_exact(&b, small, 4, 4);
    assert_outputs_exact(&b, after, 2, 3);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.completed, 2);
    assert_int_equal(s.rejected, 1);
    teardown_fixture(&f);
}

/* The schedule of one workload: counters after the run. */
static kvp_scheduler_stats schedule_of(int compute, size_t pages, size_t *steps)
{
    fixture f;
    setup_fixture(&f, pages, 1, compute, 0);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 5; i++) {
        submit(&f, &b, lengths[i][0], lengths[i][1], NULL);
    }
    *steps = run(&f, 0);
    kvp_scheduler_stats s = stats_of(&f);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 5);
    teardown_fixture(&f);
    return s;
}

static void test_scheduler_compute_off_takes_the_same_schedule(void **state)
{
    (void)state;
    size_t pages[] = {64, 12, 10};
    for (size_t i = 0; i < 3; i++) {
        size_t steps_on = 0;
        size_t steps_off = 0;
        kvp_scheduler_stats on = schedule_of(1, pages[i], &steps_on);
        kvp_scheduler_stats off = schedule_of(0, pages[i], &steps_off);
        assert_int_equal(steps_on, steps_off);
        assert_int_equal(on.completed, off.completed);
        assert_int_equal(on.preemptions, off.preemptions);
        assert_int_equal(on.tokens_generated, off.tokens_generated);
        assert_int_equal(on.prefill_tokens, off.prefill_tokens);
        assert_int_equal(on.peak_running, off.peak_running);
    }
}

static void test_scheduler_max_running_caps_the_batch(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 64, 1, 1, 2);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 5; i++) {
        submit(&f, &b, lengths[i][0], lengths[i][1], NULL);
    }
    run(&f, 2);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.peak_running, 2);
    assert_int_equal(s.completed, 5);
    for (size_t i = 0; i < 5; i++) {
        assert_outputs_exact(&b, i, lengths[i][0], lengths[i][1]);
    }
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 5);
    teardown_fixture(&f);
}

static void test_scheduler_create_refuses_bad_input(void **state)
{
    (void)state;
    kvp_model *model = make_model();
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 8);
    kvp_decoder *decoder = kvpt_decoder(1);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = CAPACITY;
    kvp_scheduler *out = (kvp_scheduler *)&config; /* a sentinel: must stay untouched */
    kvp_scheduler *const sentinel = out;
    kvp_error err;
    assert_int_equal(kvp_scheduler_create(NULL, pool, decoder, &config, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "model");
    assert_int_equal(kvp_scheduler_create(model, NULL, decoder, &config, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, NULL, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_create(model, pool, NULL, &config, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "decoder");
    config.watermark = 1.0;
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "watermark");
    config.watermark = 0.0;
    config.schedule = KVP_SCHEDULE_CACHE_AWARE + 1;
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "schedule");
    config.schedule = KVP_SCHEDULE_FCFS;
    /* session_fraction outside [0, 1] (NaN too) is refused, naming it, creating nothing. */
    const double bad_fractions[3] = {-0.1, 1.5, nan("")};
    for (size_t i = 0; i < 3; i++) {
        config.session_fraction = bad_fractions[i];
        memset(&err, 0, sizeof err);
        assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                         KVP_INVALID_ARGUMENT);
        assert_int_equal(err.status, KVP_INVALID_ARGUMENT);
        assert_string_equal(err.argument, "session_fraction");
        assert_ptr_equal(out, sentinel);
        kvp_pool_stats refused;
        kvp_pool_stats_init(&refused);
        kvpt_assert_ok(kvp_pool_stats_get(pool, &refused, NULL), NULL);
        assert_int_equal(refused.attached_caches, 0);
        assert_int_equal(refused.held_pages, 0);
    }
    /* Its bounds are accepted. */
    for (int bound = 0; bound <= 1; bound++) {
        config.session_fraction = bound;
        kvp_scheduler *made = NULL;
        kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &made, &err), &err);
        kvpt_assert_ok(kvp_scheduler_destroy(made, NULL), NULL);
    }
    config.session_fraction = 0.5;
    config.capacity = 0;
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                     KVP_ZERO_CAPACITY);
    config.capacity = CAPACITY + 1; /* past the model's positions */
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                     KVP_CAPACITY_EXCEEDS_POSITIONS);
    config.capacity = CAPACITY;
    config.struct_size = 0;
    assert_int_equal(kvp_scheduler_create(model, pool, decoder, &config, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "struct_size");
    assert_ptr_equal(out, sentinel);
    kvp_pool *other = kvpt_pool(BLOCK, 2, HEAD_WIDTH, 8); /* pages of 2 KV heads: wrong */
    config.struct_size = sizeof config;
    assert_int_not_equal(kvp_scheduler_create(model, other, decoder, &config, &out, &err),
                         KVP_OK);
    assert_ptr_equal(out, sentinel);
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, NULL), NULL);
    assert_int_equal(stats.attached_caches, 0); /* nothing was left behind */
    kvpt_assert_ok(kvp_pool_destroy(other, NULL), NULL);
    /* A fault at each allocation of create leaves nothing behind. */
    for (uint64_t nth = 1;; nth++) {
        kvpi_fault_arm(nth);
        kvp_status status = kvp_scheduler_create(model, pool, decoder, &config, &out, &err);
        int fired = kvpi_fault_fired();
        kvpi_fault_arm(0);
        if (!fired) {
            kvpt_assert_ok(status, &err);
            kvpt_assert_ok(kvp_scheduler_destroy(out, NULL), NULL);
            break;
        }
        assert_int_equal(status, KVP_ALLOCATION_FAILED);
        assert_ptr_equal(out, sentinel);
        kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, NULL), NULL);
        assert_int_equal(stats.attached_caches, 0);
    }
    kvpt_destroy_decoder(decoder);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

static void assert_stats_equal(const kvp_scheduler_stats *a, const kvp_scheduler_stats *b)
{
    assert_memory_equal(a, b, sizeof *a);
}

static void test_scheduler_submit_refusals_change_nothing(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 16, 1, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    kvp_scheduler_stats before = stats_of(&f);
    kvp_request good;
    kvp_request_init(&good);
    good.prompt_tokens = 3;
    good.max_new_tokens = 2;
    good.input = input_cb;
    good.on_token = token_cb;
    good.ctx = &b;
    uint64_t id = 12345;
    kvp_error err;
    struct {
        size_t prompt, new_tokens, samples, struct_size;
        int no_input;
        kvp_status status;
        const char *argument;
    } cases[] = {
        {0, 2, 1, sizeof good, 0, KVP_INVALID_ARGUMENT, "prompt_tokens"},
        {3, 0, 1, sizeof good, 0, KVP_INVALID_ARGUMENT, "max_new_tokens"},
        {3, 2, 0, sizeof good, 0, KVP_INVALID_ARGUMENT, "samples"},
        {3, 2, 257, sizeof good, 0, KVP_INVALID_ARGUMENT, "samples"},
        {3, 2, 1, 0, 0, KVP_INVALID_ARGUMENT, "struct_size"},
        {3, 2, 1, sizeof good, 1, KVP_NULL_ARGUMENT, "input"},
        {CAPACITY - 1, 2, 1, sizeof good, 0, KVP_FULL, NULL},
        {CAPACITY + 1, 1, 1, sizeof good, 0, KVP_FULL, NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvp_request r = good;
        r.prompt_tokens = cases[i].prompt;
        r.max_new_tokens = cases[i].new_tokens;
        r.samples = cases[i].samples;
        r.struct_size = cases[i].struct_size;
        r.input = cases[i].no_input ? NULL : input_cb;
        memset(&err, 0, sizeof err);
        assert_int_equal(kvp_scheduler_submit(f.scheduler, &r, &id, &err), cases[i].status);
        assert_int_equal(err.status, cases[i].status);
        if (cases[i].argument != NULL) {
            assert_string_equal(err.argument, cases[i].argument);
        } else {
            assert_string_equal(err.what, "request");
            assert_int_equal(err.available, CAPACITY);
        }
        assert_int_equal(id, 12345);
        kvp_scheduler_stats now = stats_of(&f);
        assert_stats_equal(&now, &before);
    }
    assert_int_equal(kvp_scheduler_submit(NULL, &good, &id, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_submit(f.scheduler, NULL, &id, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_submit(f.scheduler, &good, NULL, &err), KVP_NULL_ARGUMENT);
    /* An allocation fault changes nothing either: no id is used. */
    for (uint64_t nth = 1; nth < 8; nth++) {
        kvpi_fault_arm(nth);
        kvp_status status = kvp_scheduler_submit(f.scheduler, &good, &id, &err);
        int fired = kvpi_fault_fired();
        kvpi_fault_arm(0);
        if (!fired) {
            kvpt_assert_ok(status, &err);
            break;
        }
        assert_int_equal(status, KVP_ALLOCATION_FAILED);
        kvp_scheduler_stats now = stats_of(&f);
        assert_stats_equal(&now, &before);
    }
    assert_int_equal(id, 0); /* the first request that got in has id 0 */
    assert_int_equal(stats_of(&f).submitted, 1);
    run(&f, 0);
    assert_outputs_exact(&b, 0, 3, 2);
    kvp_request_result done[2];
    assert_int_equal(collect_all(&f, done, 2), 1);
    teardown_fixture(&f);
}

static void test_scheduler_step_and_collect_refusals_change_nothing(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 16, 1, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    submit(&f, &b, 2, 1, NULL);
    kvp_error err;
    assert_int_equal(kvp_scheduler_step(NULL, NULL, &err), KVP_NULL_ARGUMENT);
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    st.struct_size = 0;
    kvp_scheduler_stats before = stats_of(&f);
    assert_int_equal(kvp_scheduler_step(f.scheduler, &st, &err), KVP_INVALID_ARGUMENT);
    kvp_scheduler_stats now = stats_of(&f);
    assert_stats_equal(&now, &before);
    kvpt_assert_ok(kvp_scheduler_step(f.scheduler, NULL, &err), &err); /* stats optional */
    now = stats_of(&f);
    assert_int_equal(now.completed, 1);
    assert_int_equal(now.uncollected, 1);
    kvp_request_result done[2];
    size_t n = 99;
    assert_int_equal(kvp_scheduler_collect(NULL, done, 2, &n, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_collect(f.scheduler, done, 2, NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_collect(f.scheduler, NULL, 2, &n, &err), KVP_NULL_ARGUMENT);
    done[0].struct_size = 3;
    assert_int_equal(kvp_scheduler_collect(f.scheduler, done, 2, &n, &err),
                     KVP_INVALID_ARGUMENT);
    assert_int_equal(n, 99);
    assert_int_equal(stats_of(&f).uncollected, 1);
    kvpt_assert_ok(kvp_scheduler_collect(f.scheduler, NULL, 0, &n, &err), &err);
    assert_int_equal(n, 0);
    assert_int_equal(collect_all(&f, done, 2), 1);
    assert_int_equal(done[0].id, 0);
    assert_int_equal(done[0].tokens_generated, 1);
    assert_int_equal(collect_all(&f, done, 2), 0);
    kvp_scheduler_stats_init(&now);
    now.struct_size = 0;
    assert_int_equal(kvp_scheduler_stats_get(f.scheduler, &now, &err), KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_scheduler_stats_get(NULL, &now, &err), KVP_NULL_ARGUMENT);
    teardown_fixture(&f);
}

/*
 * One step, first failed by an allocation fault at each of its allocations
 * in turn: each failure is ALLOCATION_FAILED and changes nothing (the
 * scheduler's and the pool's counters, the audit); then the step stands.
 * Returns the faults it met.
 */
static size_t step_through_faults(fixture *f)
{
    size_t faults = 0;
    for (uint64_t nth = 1;; nth++) {
        kvp_scheduler_stats before = stats_of(f);
        kvp_pool_stats pool_before = pool_of(f);
        kvp_error err;
        kvpi_fault_arm(nth);
        kvp_status status = kvp_scheduler_step(f->scheduler, NULL, &err);
        int fired = kvpi_fault_fired();
        kvpi_fault_arm(0);
        kvpt_assert_pool_ok(f->pool);
        if (!fired) {
            kvpt_assert_ok(status, &err);
            return faults;
        }
        faults++;
        assert_int_equal(status, KVP_ALLOCATION_FAILED);
        kvp_scheduler_stats now = stats_of(f);
        assert_stats_equal(&now, &before);
        kvp_pool_stats pool_now = pool_of(f);
        assert_memory_equal(&pool_now, &pool_before, sizeof pool_now);
    }
}

/*
 * A fault at each allocation a step makes, step after step, over a run that
 * preempts: each failed step changes nothing (scheduler and pool counters),
 * the retried step goes on, and the outputs are those of a run without faults.
 */
static void fault_sweep(size_t samples, size_t pages, size_t session_ttl)
{
    fixture f;
    setup_fixture_full(&f, pages, 1, 1, 0, 1, KVP_SCHEDULE_FCFS, session_ttl, 0.5);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 5; i++) {
        b.shared[i] = samples > 1 ? 4 : 0; /* a shared first block: the index is used */
        /* With sessions: two conversations, kept sequences replaced, used, given back. */
        submit_session(&f, &b, lengths[i][0], lengths[i][1], NULL, samples,
                       session_ttl != 0 ? 1 + i % 2 : 0);
    }
    size_t faults = 0;
    for (size_t steps = 0; steps < 10000; steps++) {
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        faults += step_through_faults(&f);
    }
    assert_true(faults > 0); /* the first step allocates: the sweep hit something */
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.completed, 5);
    assert_true(s.preemptions > 0);
    if (samples > 1) {
        assert_true(s.prefix_hit_tokens > 0);
        assert_true(s.forks > 0);
    }
    if (session_ttl != 0) {
        assert_true(s.session_keeps > 0);
        assert_true(s.session_drops + s.session_hits > 0);
    }
    for (size_t i = 0; i < 5; i++) {
        assert_samples_exact(&b, i, samples, lengths[i][0], lengths[i][1]);
    }
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 5);
    teardown_fixture(&f);
}

static void test_scheduler_step_allocation_faults_change_nothing(void **state)
{
    (void)state;
    fault_sweep(1, 12, 0);
    fault_sweep(3, 30, 0); /* samples forked, prefixes shared */
    fault_sweep(1, 12, 4); /* sessions kept between steps */
    fault_sweep(3, 30, 4);
}

/*
 * An allocator-only scheduler needs no model: with model NULL the config
 * gives the layers and the rows' width. Each refusal names its argument,
 * writes no handle and changes nothing in the pool (audited snapshot): a
 * NULL model when computing, layers or model_width 0 without a model, and
 * with a model a value that is neither 0 nor the model's.
 */
static void test_scheduler_create_without_model(void **state)
{
    (void)state;
    kvp_model *model = make_model();
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 16);
    kvp_decoder *decoder = kvpt_decoder(1);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    assert_int_equal(config.layers, 0);
    assert_int_equal(config.model_width, 0);
    config.capacity = CAPACITY;
    kvp_scheduler *out = (kvp_scheduler *)&config; /* a sentinel: must stay untouched */
    kvp_scheduler *const sentinel = out;
    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_take(&snap);
    kvp_error err;
    /* compute 1: a model is required, after the config's checks. */
    assert_int_equal(kvp_scheduler_create(NULL, pool, decoder, &config, &out, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "model");
    config.watermark = 1.0;
    assert_int_equal(kvp_scheduler_create(NULL, pool, decoder, &config, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "watermark");
    config.watermark = 0.0;
    config.compute = 0;
    const struct {
        const kvp_model *model;
        size_t layers;
        size_t width;
        const char *argument;
    } refused[] = {
        {NULL, 0, WIDTH, "layers"},     {NULL, LAYERS, 0, "model_width"},
        {NULL, 0, 0, "layers"},         {model, LAYERS + 1, 0, "layers"},
        {model, 0, WIDTH * 2, "model_width"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        config.layers = refused[i].layers;
        config.model_width = refused[i].width;
        memset(&err, 0, sizeof err);
        assert_int_equal(kvp_scheduler_create(refused[i].model, pool, NULL, &config, &out, &err),
                         KVP_INVALID_ARGUMENT);
        assert_string_equal(err.argument, refused[i].argument);
        assert_ptr_equal(out, sentinel);
        kvpt_assert_unchanged(&snap, 0);
    }
    /* With a model, 0 or the model's own values are accepted. */
    config.layers = LAYERS;
    config.model_width = WIDTH;
    kvp_scheduler *made = NULL;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, NULL, &config, &made, &err), &err);
    kvpt_assert_ok(kvp_scheduler_destroy(made, NULL), NULL);
    /* Without one: one external cache per configured layer, of the pool's heads. */
    kvpt_assert_ok(kvp_scheduler_create(NULL, pool, NULL, &config, &made, &err), &err);
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvpt_assert_ok(kvp_pool_stats_get(pool, &stats, NULL), NULL);
    assert_int_equal(stats.attached_caches, LAYERS); /* the first lease */
    kvpt_assert_ok(kvp_scheduler_destroy(made, NULL), NULL);
    kvpt_assert_unchanged(&snap, 0);
    kvpt_destroy_decoder(decoder);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

/* ---- issue 16, section 8: what probing and fuzzing the scheduler found -- */

/*
 * kvp_scheduler_collect before any request finished (before any step):
 * nothing to move, n 0, every cap. The scheduler's result array is not
 * allocated until a step makes room, and collect used to pass that NULL to
 * memmove (UBSan: null pointer passed as argument 1).
 */
static void test_scheduler_collect_before_anything_finished(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 16, 1, 1, 0);
    kvp_request_result done[2];
    size_t n = 99;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_collect(f.scheduler, NULL, 0, &n, &err), &err);
    assert_int_equal(n, 0);
    assert_int_equal(collect_all(&f, done, 2), 0);
    static book b;
    memset(&b, 0, sizeof b);
    submit(&f, &b, 2, 2, NULL); /* waiting, not finished: still nothing */
    assert_int_equal(collect_all(&f, done, 2), 0);
    run(&f, 0);
    assert_int_equal(collect_all(&f, done, 2), 1);
    assert_int_equal(done[0].tokens_generated, 2);
    assert_int_equal(collect_all(&f, done, 2), 0);
    teardown_fixture(&f);
}

/* A request with neither prompt rows nor an input callback (compute off only). */
static uint64_t submit_rowless(fixture *f, size_t prompt, size_t new_tokens, size_t samples)
{
    return submit_counts(f, prompt, new_tokens, samples, NULL);
}

/*
 * Nothing to key, so no rows are ever read and the step's row scratch is
 * never allocated: allocator-only with sharing 0, or with sharing on and
 * requests that have no rows at all. The plan and the prefill used to
 * compute NULL + 0 for those requests' rows (clang's
 * -fsanitize=pointer-overflow, in -fsanitize=undefined: "applying zero
 * offset to null pointer"; gcc does not report it, clang builds such as the
 * fuzz preset do). Every request runs to its budget and gives its pages
 * back; the pool's audit holds after every step (run).
 */
static void test_scheduler_allocator_only_with_nothing_to_key(void **state)
{
    (void)state;
    for (int sharing = 0; sharing <= 1; sharing++) {
        fixture f;
        setup_fixture_sharing(&f, 20, 1, 0, 0, sharing);
        for (size_t i = 0; i < 3; i++) {
            assert_int_equal(submit_rowless(&f, lengths[i][0], lengths[i][1], 1 + i % 2), i);
        }
        run(&f, 0);
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.completed, 3);
        assert_int_equal(s.tokens_generated, 9 + 2 * 3 + 14);
        assert_int_equal(s.prefix_hit_tokens, 0);
        assert_int_equal(pool_of(&f).held_pages, 0);
        teardown_collected(&f, 3);
    }
}

/*
 * A step that fails (an allocation fault at each of its allocations in
 * turn) after a weight update changes nothing: the idle leases bound to the
 * old weights stay until a step stands (they are held samples and attached
 * caches). The step used to free them first. Then the step goes on and the
 * request's outputs are the new weights'.
 */
static void test_scheduler_failed_step_keeps_stale_idle_leases(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 16, 1, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    submit_samples(&f, &b, 5, 2, NULL, 2);
    run(&f, 0);
    assert_int_equal(stats_of(&f).held_samples, 2); /* two idle leases */
    update_weights(f.model);
    submit_samples(&f, &b, 6, 2, NULL, 2);
    assert_int_equal(stats_of(&f).held_samples, 2); /* each failure below keeps them */
    assert_true(step_through_faults(&f) > 0);
    run(&f, 0);
    assert_int_equal(stats_of(&f).completed, 2);
    assert_sample_exact_range(&b, 1, 0, 6, 2, 0, CAPACITY, 1);
    assert_sample_exact_range(&b, 1, 1, 6, 2, 0, CAPACITY, 1);
    teardown_collected(&f, 2);
}

static void assert_state(const fixture *f, uint64_t id, kvp_request_state expected)
{
    kvp_request_state state = (kvp_request_state)99;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_request_state(f->scheduler, id, &state, &err), &err);
    assert_int_equal(state, expected);
}

static void assert_unknown(const fixture *f, uint64_t id, uint64_t next)
{
    kvp_request_state state = (kvp_request_state)99;
    kvp_error err;
    memset(&err, 0, sizeof err);
    kvp_scheduler_stats before = stats_of(f);
    assert_int_equal(kvp_scheduler_request_state(f->scheduler, id, &state, &err),
                     KVP_REQUEST_UNKNOWN);
    kvp_scheduler_stats after = stats_of(f);
    assert_stats_equal(&after, &before); /* changes nothing */
    assert_int_equal(err.status, KVP_REQUEST_UNKNOWN);
    assert_int_equal(err.index, id);
    assert_int_equal(err.limit, next);
    assert_int_equal(state, 99); /* not written */
}

/*
 * Records are recycled once collected (issue 16): ids stay 0, 1, 2, ... and
 * unique, a collected id is stale for good (REQUEST_UNKNOWN, as is one never
 * given), and a steady stream of requests (samples and sessions on, compute
 * off) allocates nothing once warm, however many pass. Before, every request
 * kept a record until destroy: the record array grew, so this allocated.
 */
static void test_scheduler_records_recycled(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_full(&f, 64, 1, 0, 0, 1, KVP_SCHEDULE_FCFS, 4, 0.5);
    kvp_request q;
    kvp_request_init(&q);
    q.prompt_tokens = 6;
    q.max_new_tokens = 3;
    q.samples = 2;
    q.input = stream_input;
    kvp_error err;
    uint64_t id = UINT64_MAX;
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 0); /* nothing finished yet (no NULL memmove) */
    assert_unknown(&f, 0, 0); /* never given */
    kvpt_assert_ok(kvp_scheduler_submit(f.scheduler, &q, &id, &err), &err);
    assert_int_equal(id, 0);
    assert_state(&f, 0, KVP_REQUEST_WAITING);
    assert_unknown(&f, 1, 1);
    kvp_request_state st;
    assert_int_equal(kvp_scheduler_request_state(NULL, 0, &st, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_request_state(f.scheduler, 0, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "state");
    kvpt_assert_ok(kvp_scheduler_step(f.scheduler, NULL, &err), &err);
    assert_state(&f, 0, KVP_REQUEST_RUNNING);
    run(&f, 0);
    assert_state(&f, 0, KVP_REQUEST_FINISHED);
    assert_int_equal(collect_all(&f, done, 8), 1);
    assert_int_equal(done[0].id, 0);
    assert_unknown(&f, 0, 1); /* collected: stale */
    /* Rounds of 4 requests, one of them a session's turn; the same shape every round. */
    uint64_t next = 1;
    for (size_t round = 0; round < 300; round++) {
        if (round == 8) {
            kvpi_fault_arm(0); /* warm: count the allocations from here on */
        }
        for (size_t k = 0; k < 4; k++) {
            q.session = k == 0; /* session 1: each round its next turn */
            q.samples = 1 + k % 3;
            kvpt_assert_ok(kvp_scheduler_submit(f.scheduler, &q, &id, &err), &err);
            assert_int_equal(id, next++);
        }
        run(&f, 0);
        assert_int_equal(collect_all(&f, done, 8), 4);
        for (size_t k = 0; k < 4; k++) {
            assert_int_equal(done[k].status, KVP_OK);
            uint64_t nth = done[k].id - (next - 4); /* its place in the round */
            assert_true(nth < 4);
            assert_int_equal(done[k].tokens_generated, 3 * (1 + nth % 3));
            assert_unknown(&f, done[k].id, next);
        }
    }
    assert_int_equal(kvpi_fault_calls(), 0); /* 1168 requests served without an allocation */
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.submitted, 1201);
    assert_int_equal(s.completed, 1201);
    assert_true(s.session_hits > 0);
    assert_true(s.forks > 0);
    teardown_fixture(&f);
}

/*
 * Admission counts evictable pages as available (issue 16, 9.): request 0
 * (16 + 8 tokens, compute off, keyed rows) completes and publishes its 6
 * full blocks, so of 16 pages 12 are evictable and 4 free. Request 1
 * (16 + 3 tokens: 5 blocks x 2 layers = 10 pages, no prefix in common)
 * fits only by evicting: it is admitted in the very next step, its prompt
 * takes 8 pages (4 free, 4 evicted) and its first token a new block (2
 * more evicted), and nothing is preempted. Counting free pages alone, it
 * would wait (admission: LATER for ever) or be preempted at once for its
 * first token's block (make_room).
 */
static void test_scheduler_admission_counts_evictable_pages(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 16, 1, 0, 0);
    (void)submit_rows(&f, 16, 8, 1);
    run(&f, 0);
    kvp_pool_stats pool = pool_of(&f);
    assert_int_equal(pool.held_pages, 0);
    assert_int_equal(pool.evictable_pages, 12);
    assert_int_equal(pool.free_pages, 4);
    (void)submit_rows(&f, 16, 3, 1);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.preempted, 0);
    assert_int_equal(st.decoded, 1);
    pool = pool_of(&f);
    assert_int_equal(pool.held_pages, 10); /* 16 + 1 tokens: 5 blocks x 2 layers */
    assert_int_equal(pool.evictions, 6);   /* 10 pages taken, 4 of them free */
    run(&f, 0);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 2);
    assert_int_equal(stats_of(&f).preemptions, 0);
    teardown_fixture(&f);
}

/* argv[1], when given, runs only the tests it names (a cmocka pattern; CMakeLists.txt). */
int main(int argc, char **argv)
{
    if (argc > 1) {
        cmocka_set_test_filter(argv[1]);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scheduler_runs_every_request_exactly),
        cmocka_unit_test(test_scheduler_preempts_by_recompute_exactly),
        cmocka_unit_test(test_scheduler_rejects_what_never_fits),
        cmocka_unit_test(test_scheduler_compute_off_takes_the_same_schedule),
        cmocka_unit_test(test_scheduler_max_running_caps_the_batch),
        cmocka_unit_test(test_scheduler_create_refuses_bad_input),
        cmocka_unit_test(test_scheduler_create_without_model),
        cmocka_unit_test(test_scheduler_submit_refusals_change_nothing),
        cmocka_unit_test(test_scheduler_step_and_collect_refusals_change_nothing),
        cmocka_unit_test(test_scheduler_step_allocation_faults_change_nothing),
        cmocka_unit_test(test_scheduler_records_recycled),
        cmocka_unit_test(test_scheduler_admission_counts_evictable_pages),
        cmocka_unit_test(test_scheduler_collect_before_anything_finished),
        cmocka_unit_test(test_scheduler_allocator_only_with_nothing_to_key),
        cmocka_unit_test(test_scheduler_failed_step_keeps_stale_idle_leases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
