/*
 * test_scheduler.c: the continuous-batching scheduler (kvpager/scheduler.h)
 * through its public API, over pools small enough to force what each test
 * is about:
 *   - every request runs to its output budget, and every decoded token's
 *     output is bit-identical to a fresh sequence fed the same rows alone,
 *     with and without preemption by recompute (a pool too small for all),
 *     with 1 and 2 decoder threads, with prompt rows or an input callback;
 *   - a request that can never fit is rejected, and the others still run;
 *   - compute off (external caches) takes the same schedule: the same
 *     counters, preemptions included;
 *   - max_running caps the sequences decoded per step;
 *   - create, submit, step and collect refuse bad input with typed errors
 *     and change nothing (stats, ids, pool); samples > 1 is refused until
 *     fork is wired in;
 *   - an allocation fault at every allocation of a step changes nothing
 *     (the scheduler's counters and the pool's), and the run then finishes
 *     with the same outputs.
 * kvp_pool_check runs after every step. Unit test: public API, plus the
 * fault injector (pager/alloc.h).
 */
#include "support.h"

#include <string.h>

#include "pager/alloc.h"

#define WIDTH 8
#define HEADS 2
#define KV_HEADS 1
#define HEAD_WIDTH (WIDTH / HEADS)
#define LAYERS 2
#define BLOCK 4
#define CAPACITY 64
#define MAX_REQUESTS 16
#define SEED 7

/* The rows and the recorded outputs of one test's requests. */
typedef struct book {
    double outputs[MAX_REQUESTS][CAPACITY][WIDTH];
    int seen[MAX_REQUESTS][CAPACITY];
    size_t tokens[MAX_REQUESTS];
} book;

static void row_of(uint64_t id, size_t position, double *row, size_t width)
{
    for (size_t i = 0; i < width; i++) {
        /* Deterministic, distinct per (id, position, i), within [-1, 1]. */
        unsigned v = (unsigned)((id * 131u + position * 31u + i * 7u) % 97u);
        row[i] = (double)v / 48.5 - 1.0;
    }
}

static void input_cb(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                     size_t width)
{
    (void)ctx;
    assert_int_equal(sample, 0);
    row_of(id, position, row, width);
}

static void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                     const double *output, size_t width)
{
    assert_int_equal(sample, 0);
    book *b = ctx;
    assert_true(id < MAX_REQUESTS);
    assert_true(position < CAPACITY);
    assert_int_equal(width, WIDTH);
    assert_false(b->seen[id][position]); /* each token once, recomputation included */
    b->seen[id][position] = 1;
    memcpy(b->outputs[id][position], output, sizeof b->outputs[id][position]);
    b->tokens[id]++;
}

typedef struct fixture {
    kvp_model *model;
    kvp_pool *pool;
    kvp_decoder *decoder;
    kvp_scheduler *scheduler;
} fixture;

static kvp_model *make_model(void)
{
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create_random_grouped(LAYERS, WIDTH, HEADS, KV_HEADS, CAPACITY,
                                                   10000.0, SEED, &model, &err),
                   &err);
    return model;
}

static void setup_fixture(fixture *f, size_t pages, size_t threads, int compute,
                          size_t max_running)
{
    memset(f, 0, sizeof *f);
    f->model = make_model();
    f->pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, pages);
    f->decoder = compute ? kvpt_decoder(threads) : NULL;
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = CAPACITY;
    config.watermark = 0.0;
    config.reserve_tokens = 4;
    config.compute = compute;
    config.max_running = max_running;
    config.identity = SEED;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_create(f->model, f->pool, f->decoder, &config, &f->scheduler,
                                        &err),
                   &err);
}

static void teardown_fixture(fixture *f)
{
    kvpt_assert_ok(kvp_scheduler_destroy(f->scheduler, NULL), NULL);
    kvp_pool_stats stats;
    kvp_pool_stats_init(&stats);
    kvpt_assert_ok(kvp_pool_stats_get(f->pool, &stats, NULL), NULL);
    assert_int_equal(stats.held_pages, 0); /* every sequence gave its pages back */
    kvpt_assert_pool_ok(f->pool);
    if (f->decoder != NULL) {
        kvpt_destroy_decoder(f->decoder);
    }
    kvpt_assert_ok(kvp_pool_destroy(f->pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(f->model, NULL), NULL);
}

static uint64_t submit(fixture *f, book *b, size_t prompt, size_t new_tokens,
                       const double *rows)
{
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = prompt;
    request.prompt = rows;
    request.input = input_cb;
    request.on_token = token_cb;
    request.ctx = b;
    request.max_new_tokens = new_tokens;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &request, &id, &err), &err);
    return id;
}

static kvp_scheduler_stats stats_of(const fixture *f)
{
    kvp_scheduler_stats stats;
    kvp_scheduler_stats_init(&stats);
    kvpt_assert_ok(kvp_scheduler_stats_get(f->scheduler, &stats, NULL), NULL);
    return stats;
}

/* Steps until nothing runs or waits, auditing the pool after every step; returns the steps. */
static size_t run(fixture *f, size_t max_running)
{
    size_t steps = 0;
    for (;;) {
        kvp_scheduler_stats s = stats_of(f);
        if (s.running == 0 && s.waiting == 0) {
            return steps;
        }
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        kvpt_assert_ok(kvp_scheduler_step(f->scheduler, &st, &err), &err);
        kvpt_assert_pool_ok(f->pool);
        assert_true(st.decoded > 0 || st.rejected > 0);
        if (max_running != 0) {
            assert_true(st.decoded <= max_running);
        }
        kvp_pool_stats pool;
        kvp_pool_stats_init(&pool);
        kvpt_assert_ok(kvp_pool_stats_get(f->pool, &pool, NULL), NULL);
        assert_int_equal(st.held_pages, pool.held_pages);
        assert_int_equal(st.running, stats_of(f).running);
        assert_true(++steps < 10000);
    }
}

/* Each decoded token's output against a fresh sequence fed the same rows, alone. */
static void assert_outputs_exact(const book *b, size_t id, size_t prompt, size_t new_tokens)
{
    kvp_model *model = make_model();
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 64);
    kvp_sequence *seq = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_create(model, pool, 1, CAPACITY, &seq, &err), &err);
    double rows[CAPACITY][WIDTH];
    for (size_t t = 0; t < prompt + new_tokens; t++) {
        row_of(id, t, rows[t], WIDTH);
    }
    kvp_tensor input = kvp_tensor3(&rows[0][0], 1, prompt, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &input, NULL, NULL, NULL, 0, &err), &err);
    assert_int_equal(b->tokens[id], new_tokens);
    for (size_t k = 0; k < new_tokens; k++) {
        size_t position = prompt + k;
        double out[WIDTH];
        kvp_tensor one = kvp_tensor3(rows[position], 1, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &one, NULL, NULL, out, WIDTH, &err), &err);
        assert_true(b->seen[id][position]);
        assert_memory_equal(out, b->outputs[id][position], sizeof out); /* bit for bit */
    }
    kvpt_assert_ok(kvp_sequence_destroy(seq, NULL), NULL);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

static size_t collect_all(fixture *f, kvp_request_result *out, size_t cap)
{
    if (cap > 0) {
        kvp_request_result_init(&out[0]);
    }
    size_t n = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_collect(f->scheduler, out, cap, &n, &err), &err);
    return n;
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
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(done[i].status, KVP_OK);
        assert_false(done[i].rejected);
        assert_true(done[i].id < 5);
        seen |= (size_t)1 << done[i].id;
        assert_int_equal(done[i].tokens_generated, lengths[done[i].id][1]);
        tokens += done[i].tokens_generated;
        preempted += done[i].preemptions;
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
    assert_int_equal(b.tokens[huge], 0);
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
        {3, 2, 2, sizeof good, 0, KVP_INVALID_ARGUMENT, "samples"},
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
    memset(&err, 0, sizeof err);
    good.samples = 2;
    assert_int_equal(kvp_scheduler_submit(f.scheduler, &good, &id, &err), KVP_INVALID_ARGUMENT);
    assert_non_null(strstr(err.what, "not supported yet"));
    good.samples = 1;
    assert_int_equal(kvp_scheduler_submit(NULL, &good, &id, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_submit(f.scheduler, NULL, &id, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_scheduler_submit(f.scheduler, &good, NULL, &err), KVP_NULL_ARGUMENT);
    /* An allocation fault changes nothing either: no id is used. */
    for (uint64_t nth = 1; nth < 4; nth++) {
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
 * A fault at each allocation a step makes, step after step, over a run that
 * preempts: each failed step changes nothing (scheduler and pool counters),
 * the retried step goes on, and the outputs are those of a run without faults.
 */
static void test_scheduler_step_allocation_faults_change_nothing(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 12, 1, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 5; i++) {
        submit(&f, &b, lengths[i][0], lengths[i][1], NULL);
    }
    size_t faults = 0;
    for (size_t steps = 0; steps < 10000; steps++) {
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        for (uint64_t nth = 1;; nth++) {
            kvp_scheduler_stats before = stats_of(&f);
            kvp_pool_stats pool_before;
            kvp_pool_stats_init(&pool_before);
            kvpt_assert_ok(kvp_pool_stats_get(f.pool, &pool_before, NULL), NULL);
            kvp_error err;
            kvpi_fault_arm(nth);
            kvp_status status = kvp_scheduler_step(f.scheduler, NULL, &err);
            int fired = kvpi_fault_fired();
            kvpi_fault_arm(0);
            kvpt_assert_pool_ok(f.pool);
            if (!fired) {
                kvpt_assert_ok(status, &err);
                break;
            }
            faults++;
            assert_int_equal(status, KVP_ALLOCATION_FAILED);
            kvp_scheduler_stats now = stats_of(&f);
            assert_stats_equal(&now, &before);
            kvp_pool_stats pool_now;
            kvp_pool_stats_init(&pool_now);
            kvpt_assert_ok(kvp_pool_stats_get(f.pool, &pool_now, NULL), NULL);
            assert_int_equal(pool_now.held_pages, pool_before.held_pages);
            assert_int_equal(pool_now.acquires, pool_before.acquires);
            assert_int_equal(pool_now.releases, pool_before.releases);
        }
    }
    assert_true(faults > 0); /* the first step allocates: the sweep hit something */
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.completed, 5);
    assert_true(s.preemptions > 0);
    for (size_t i = 0; i < 5; i++) {
        assert_outputs_exact(&b, i, lengths[i][0], lengths[i][1]);
    }
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 5);
    teardown_fixture(&f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scheduler_runs_every_request_exactly),
        cmocka_unit_test(test_scheduler_preempts_by_recompute_exactly),
        cmocka_unit_test(test_scheduler_rejects_what_never_fits),
        cmocka_unit_test(test_scheduler_compute_off_takes_the_same_schedule),
        cmocka_unit_test(test_scheduler_max_running_caps_the_batch),
        cmocka_unit_test(test_scheduler_create_refuses_bad_input),
        cmocka_unit_test(test_scheduler_submit_refusals_change_nothing),
        cmocka_unit_test(test_scheduler_step_and_collect_refusals_change_nothing),
        cmocka_unit_test(test_scheduler_step_allocation_faults_change_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
