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
 *     counters, preemptions included, with a model or without one (the
 *     config's geometry), prefix keys from rows or from block digests;
 *     create refuses a missing model or geometry, changing nothing;
 *   - max_running caps the sequences decoded per step;
 *   - create, submit, step and collect refuse bad input with typed errors
 *     and change nothing (stats, ids, pool); samples > 1 is refused until
 *     fork is wired in;
 *   - sharing: prompt prefixes and a completed request's decoded blocks
 *     (each sample's own) are adopted by later prompts holding them,
 *     outputs unchanged;
 *   - the cache-aware schedule admits a cached-prefix request ahead of an
 *     uncached head that does not fit, within its starvation bound, with
 *     every output as under FCFS;
 *   - sessions: a finished turn's sequence is kept so the conversation's
 *     next turn adopts its blocks across eviction pressure (outputs as
 *     without sessions) and goes to the front of the queue; it is given
 *     back on each rule (expiry at its ttl, replacement, session_fraction,
 *     running sequences' pages before any preemption, stale parameters,
 *     a stalled queue), counted exactly; under seeded random conversations
 *     the audit, the cap and the counts hold and outputs stay exact;
 *   - an allocation fault at every allocation of a step changes nothing
 *     (the scheduler's counters and the pool's), and the run then finishes
 *     with the same outputs;
 *   - records are recycled once collected: ids stay unique, a collected id
 *     is REQUEST_UNKNOWN, and a steady stream allocates nothing once warm;
 *   - fairness: a steady stream of session turns overtakes a plain request
 *     at most KVP_SESSION_MAX_OVERTAKES times;
 *   - admission counts evictable pages as available, forked samples over a
 *     partial prompt page are counted exactly, and an output-projection
 *     update makes running and kept sequences stale.
 * kvp_pool_check runs after every step. Unit test: public API, plus the
 * fault injector (pager/alloc.h).
 */
#include "support.h"

#include <math.h>
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
#define SAMPLES 4

/*
 * The rows and the recorded outputs of one test's requests. Request id's
 * first shared[id] positions take the rows of prefix group group[id] (so
 * requests can share a prompt prefix); its other prompt rows are its own,
 * and from prompt[id] on every sample has its own rows.
 */
typedef struct book {
    double outputs[MAX_REQUESTS][SAMPLES][CAPACITY][WIDTH];
    int seen[MAX_REQUESTS][SAMPLES][CAPACITY];
    size_t tokens[MAX_REQUESTS][SAMPLES];
    size_t prompt[MAX_REQUESTS];
    size_t shared[MAX_REQUESTS];
    uint64_t group[MAX_REQUESTS];
} book;

static void row_mix(uint64_t key, size_t position, double *row, size_t width)
{
    for (size_t i = 0; i < width; i++) {
        /* Deterministic, distinct per (key, position, i), within [-1, 1]. */
        unsigned v = (unsigned)((key * 131u + position * 31u + i * 7u) % 97u);
        row[i] = (double)v / 48.5 - 1.0;
    }
}

/* The row of (id, sample, position); prompt rows do not depend on the sample. */
static void row_at(const book *b, uint64_t id, size_t sample, size_t position, double *row)
{
    if (position < b->shared[id]) {
        row_mix(1000 + b->group[id], position, row, WIDTH);
    } else if (position < b->prompt[id] || sample == 0) {
        row_mix(id, position, row, WIDTH);
    } else {
        row_mix(id + 7919u * sample, position, row, WIDTH);
    }
}

static void row_of(uint64_t id, size_t position, double *row, size_t width)
{
    (void)width;
    static const book plain; /* no shared prefix: sample 0's rows */
    row_at(&plain, id, 0, position, row);
}

static void input_cb(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                     size_t width)
{
    const book *b = ctx;
    assert_int_equal(width, WIDTH);
    assert_true(sample < SAMPLES);
    if (position < b->prompt[id]) {
        assert_int_equal(sample, 0); /* the prompt is every sample's */
    }
    row_at(b, id, sample, position, row);
}

static void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                     const double *output, size_t width)
{
    book *b = ctx;
    assert_true(id < MAX_REQUESTS);
    assert_true(sample < SAMPLES);
    assert_true(position < CAPACITY);
    assert_true(position >= b->prompt[id]);
    assert_int_equal(width, WIDTH);
    assert_false(b->seen[id][sample][position]); /* each token once, recomputation included */
    b->seen[id][sample][position] = 1;
    memcpy(b->outputs[id][sample][position], output, sizeof b->outputs[id][sample][position]);
    b->tokens[id][sample]++;
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

/* 1: an allocator-only fixture (compute 0) gets no model: the config gives the geometry. */
static int fixture_without_model;

static void setup_fixture_full(fixture *f, size_t pages, size_t threads, int compute,
                               size_t max_running, int sharing, kvp_schedule schedule,
                               size_t session_ttl, double session_fraction)
{
    memset(f, 0, sizeof *f);
    f->model = compute || !fixture_without_model ? make_model() : NULL;
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
    config.sharing = sharing;
    config.schedule = schedule;
    config.session_ttl = session_ttl;
    config.session_fraction = session_fraction;
    if (f->model == NULL) {
        config.layers = LAYERS;
        config.model_width = WIDTH;
    }
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_create(f->model, f->pool, f->decoder, &config, &f->scheduler,
                                        &err),
                   &err);
}

static void setup_fixture_schedule(fixture *f, size_t pages, size_t threads, int compute,
                                   size_t max_running, int sharing, kvp_schedule schedule)
{
    setup_fixture_full(f, pages, threads, compute, max_running, sharing, schedule, 0, 0.5);
}

/* Sharing on, FCFS, 1 decoder thread, sessions kept `ttl` steps within `fraction` of the pool. */
static void setup_fixture_sessions(fixture *f, size_t pages, size_t ttl, double fraction)
{
    setup_fixture_full(f, pages, 1, 1, 0, 1, KVP_SCHEDULE_FCFS, ttl, fraction);
}

static void setup_fixture_sharing(fixture *f, size_t pages, size_t threads, int compute,
                                  size_t max_running, int sharing)
{
    setup_fixture_schedule(f, pages, threads, compute, max_running, sharing,
                           KVP_SCHEDULE_FCFS);
}

static void setup_fixture(fixture *f, size_t pages, size_t threads, int compute,
                          size_t max_running)
{
    setup_fixture_sharing(f, pages, threads, compute, max_running, 1);
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

/*
 * 1: requests give block digests and no rows (allocator-only fixtures): the
 * digest of a block hashes its rows' bits (row_at), so equal content gives
 * equal digests and prefix keys match exactly where row keys would.
 */
static int requests_by_digest;
static size_t digest_calls;

static void digest_cb(void *ctx, uint64_t id, size_t sample, size_t block, kvp_block_key *digest)
{
    const book *b = ctx;
    assert_true(sample < SAMPLES);
    if ((block + 1) * BLOCK <= b->prompt[id]) {
        assert_int_equal(sample, 0); /* a prompt block is every sample's */
    }
    uint64_t lo = 0xcbf29ce484222325ull;
    uint64_t hi = 0x84222325cbf29ce4ull;
    for (size_t p = block * BLOCK; p < (block + 1) * BLOCK; p++) {
        double row[WIDTH];
        row_at(b, id, sample, p, row);
        for (size_t i = 0; i < WIDTH; i++) {
            uint64_t bits;
            memcpy(&bits, &row[i], sizeof bits);
            lo = (lo ^ bits) * 0x100000001b3ull;
            hi = (hi ^ (bits >> 7)) * 0x100000001b3ull + 1;
        }
    }
    digest->lo = lo;
    digest->hi = hi;
    digest_calls++;
}

static uint64_t submit_session(fixture *f, book *b, size_t prompt, size_t new_tokens,
                               const double *rows, size_t samples, uint64_t session)
{
    kvp_scheduler_stats before;
    kvp_scheduler_stats_init(&before);
    kvpt_assert_ok(kvp_scheduler_stats_get(f->scheduler, &before, NULL), NULL);
    b->prompt[before.submitted] = prompt; /* the id it will get */
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = prompt;
    request.prompt = rows;
    request.input = input_cb;
    request.on_token = token_cb;
    request.ctx = b;
    request.max_new_tokens = new_tokens;
    request.samples = samples;
    request.session = session;
    if (requests_by_digest) {
        request.prompt = NULL; /* no rows at all: a row read would crash the test */
        request.input = NULL;
        request.block_digest = digest_cb;
    }
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &request, &id, &err), &err);
    assert_int_equal(id, before.submitted);
    return id;
}

static uint64_t submit_samples(fixture *f, book *b, size_t prompt, size_t new_tokens,
                               const double *rows, size_t samples)
{
    return submit_session(f, b, prompt, new_tokens, rows, samples, 0);
}

static uint64_t submit(fixture *f, book *b, size_t prompt, size_t new_tokens,
                       const double *rows)
{
    return submit_samples(f, b, prompt, new_tokens, rows, 1);
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
        kvpt_assert_committed(f->pool);
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

/* Changes a parameter's values in place, deterministically (a weight update). */
static void scale_values(void *ctx, double *values, size_t width)
{
    (void)ctx;
    (void)width;
    values[0] = values[0] * 0.5 + 0.25;
    values[1] = -values[1];
}

/* Updates every parameter of every layer once (each revision + 1). */
static void update_weights(kvp_model *model)
{
    for (size_t l = 0; l < LAYERS; l++) {
        for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
            kvp_error err;
            kvpt_assert_ok(kvp_param_update_with(kvp_model_param_mut(model, l, i), scale_values,
                                                 NULL, &err),
                           &err);
        }
    }
}

/*
 * Sample `sample`'s decoded outputs at positions in [from, to) against a
 * fresh sequence fed the same rows alone, under `updates` weight updates.
 */
static void assert_sample_exact_range(const book *b, size_t id, size_t sample, size_t prompt,
                                      size_t new_tokens, size_t from, size_t to, size_t updates)
{
    kvp_model *model = make_model();
    for (size_t u = 0; u < updates; u++) {
        update_weights(model);
    }
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 64);
    kvp_sequence *seq = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_create(model, pool, 1, CAPACITY, &seq, &err), &err);
    double rows[CAPACITY][WIDTH];
    for (size_t t = 0; t < prompt + new_tokens; t++) {
        row_at(b, id, sample, t, rows[t]);
    }
    kvp_tensor input = kvp_tensor3(&rows[0][0], 1, prompt, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &input, NULL, NULL, NULL, 0, &err), &err);
    assert_int_equal(b->tokens[id][sample], new_tokens);
    for (size_t k = 0; k < new_tokens; k++) {
        size_t position = prompt + k;
        double out[WIDTH];
        kvp_tensor one = kvp_tensor3(rows[position], 1, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &one, NULL, NULL, out, WIDTH, &err), &err);
        assert_true(b->seen[id][sample][position]);
        if (position >= from && position < to) {
            /* bit for bit */
            assert_memory_equal(out, b->outputs[id][sample][position], sizeof out);
        }
    }
    kvpt_assert_ok(kvp_sequence_destroy(seq, NULL), NULL);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

/* Every sample's decoded outputs against a fresh sequence fed the same rows, alone. */
static void assert_samples_exact(const book *b, size_t id, size_t samples, size_t prompt,
                                 size_t new_tokens)
{
    for (size_t k = 0; k < samples; k++) {
        assert_sample_exact_range(b, id, k, prompt, new_tokens, 0, CAPACITY, 0);
    }
}

/* Each decoded token's output against a fresh sequence fed the same rows, alone. */
static void assert_outputs_exact(const book *b, size_t id, size_t prompt, size_t new_tokens)
{
    assert_samples_exact(b, id, 1, prompt, new_tokens);
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

/* Collects the `n` finished requests (all of them), then tears the fixture down. */
static void teardown_collected(fixture *f, size_t n)
{
    kvp_request_result done[MAX_REQUESTS];
    assert_true(n <= sizeof done / sizeof done[0]);
    assert_int_equal(collect_all(f, done, sizeof done / sizeof done[0]), n);
    teardown_fixture(f);
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
static kvp_pool_stats pool_of(const fixture *f);

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

/* ---- sharing: samples, the prefix index, weight updates ---------------- */

/* The requests of the sample runs: (prompt, new tokens); prompts end mid-block and on one. */
static const size_t sample_lengths[3][2] = {{5, 9}, {8, 6}, {3, 5}};

typedef struct sample_run {
    kvp_scheduler_stats stats;
    size_t max_held;
    size_t request_preemptions; /* summed over the requests' results */
} sample_run;

/*
 * The three requests with `samples` samples each, under sharing on or off,
 * over `pages` pages; every sample's outputs checked against a fresh sequence.
 */
static sample_run run_samples(size_t samples, int sharing, size_t pages, size_t threads)
{
    fixture f;
    setup_fixture_sharing(&f, pages, threads, 1, 0, sharing);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 3; i++) {
        submit_samples(&f, &b, sample_lengths[i][0], sample_lengths[i][1], NULL, samples);
    }
    sample_run out;
    memset(&out, 0, sizeof out);
    for (size_t steps = 0;; steps++) {
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(steps < 10000);
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        kvpt_assert_ok(kvp_scheduler_step(f.scheduler, &st, &err), &err);
        kvpt_assert_pool_ok(f.pool);
        assert_int_equal(st.running % samples, 0); /* samples run together */
        assert_int_equal(st.preempted % samples, 0);
        assert_true(st.held_pages <= st.unshared_pages);
        if (!sharing) {
            assert_int_equal(st.held_pages, st.unshared_pages); /* nothing shared */
            assert_int_equal(st.prefix_hit_tokens, 0);
            assert_int_equal(st.cached_pages, 0);
        }
        if (st.held_pages > out.max_held) {
            out.max_held = st.held_pages;
        }
    }
    kvp_request_result done[4];
    assert_int_equal(collect_all(&f, done, 4), 3);
    size_t prompt_tokens = 0;
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(done[i].status, KVP_OK);
        assert_int_equal(done[i].tokens_generated, samples * sample_lengths[done[i].id][1]);
        out.request_preemptions += done[i].preemptions;
        /* every admission's prompt, recomputation included */
        prompt_tokens += sample_lengths[done[i].id][0] * (1 + done[i].preemptions);
    }
    for (size_t i = 0; i < 3; i++) {
        assert_samples_exact(&b, i, samples, sample_lengths[i][0], sample_lengths[i][1]);
    }
    out.stats = stats_of(&f);
    assert_int_equal(out.stats.completed, 3);
    /* A fork per extra sample at every admission, recomputation included. */
    assert_int_equal(out.stats.forks,
                     sharing ? (samples - 1) * (3 + out.request_preemptions) : 0);
    assert_int_equal(out.stats.preemptions, samples * out.request_preemptions);
    assert_int_equal(out.stats.prompt_tokens, prompt_tokens);
    teardown_fixture(&f);
    return out;
}

static void test_scheduler_samples_exact_with_and_without_sharing(void **state)
{
    (void)state;
    for (size_t n = 1; n <= SAMPLES; n++) {
        for (int sharing = 0; sharing <= 1; sharing++) {
            /* Room for everything: no preemption. */
            sample_run roomy = run_samples(n, sharing, 128, 1 + (n % 2));
            assert_int_equal(roomy.request_preemptions, 0);
            assert_int_equal(roomy.stats.prompt_tokens, 5 + 8 + 3);
            assert_int_equal(roomy.stats.prefill_tokens,
                             sharing ? 5 + 8 + 3 : n * (5 + 8 + 3));
            /*
             * Tight: the first two requests are admitted together (with a
             * 4-token reserve, sharing: 4 + 4n and 4 + 2n pages; without:
             * 6n each) but cannot both grow to their whole length (sharing:
             * 8 + 10n; without: 16n), so growth preempts. One sample: 12
             * pages, as the preemption test above.
             */
            size_t pages = n == 1 ? 12 : sharing ? 6 * n + 9 : 12 * n + 2;
            sample_run tight = run_samples(n, sharing, pages, 2);
            assert_true(tight.request_preemptions > 0);
            assert_true(tight.max_held <= pages);
        }
    }
}

/*
 * Pages held with 4 samples of a 9-token prompt after the first step:
 * sharing holds the prompt's 2 full blocks once (x 2 layers) plus the
 * partial block, which sample 0 writes in place while the 3 others copy it
 * (4 x 2): 12, and never more: 3 copies x 2 layers (6, not 8) and the high
 * water mark 12 (copying in all 4 samples held the original beside 4
 * copies: 14). Without sharing every sample holds 3 blocks x 2 layers: 24.
 * On 1 and on 3 decoder threads (the 4 samples' first tokens run at once:
 * sample 0's in-place row beside the others' copies of the rows below it),
 * the pool audited after every step, outputs equal to fresh sequences. After
 * the run the published blocks stay cached and evictable: the prompt's, and
 * each sample's full third block (9 + 3 tokens), published when it completes.
 */

static void test_scheduler_sharing_holds_fewer_pages(void **state)
{
    (void)state;
    for (int run_ = 0; run_ < 3; run_++) {
        int sharing = run_ > 0;
        size_t threads = run_ == 2 ? 3 : 1;
        fixture f;
        setup_fixture_sharing(&f, 64, threads, 1, 0, sharing);
        static book b;
        memset(&b, 0, sizeof b);
        submit_samples(&f, &b, 9, 3, NULL, 4);
        kvp_step_stats st;
        kvp_step_stats_init(&st);
        kvp_error err;
        kvpt_assert_ok(kvp_scheduler_step(f.scheduler, &st, &err), &err);
        kvpt_assert_pool_ok(f.pool);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.running, 4);
        assert_int_equal(st.decoded, 4);
        assert_int_equal(st.prompt_tokens, 9);
        assert_int_equal(st.prefill_tokens, sharing ? 9 : 36);
        assert_int_equal(st.unshared_pages, 24);
        assert_int_equal(st.held_pages, sharing ? 12 : 24);
        assert_int_equal(st.cached_pages, sharing ? 4 : 0);
        assert_int_equal(st.evictable_pages, 0);
        assert_int_equal(stats_of(&f).forks, sharing ? 3 : 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.cow_copies, sharing ? 6 : 0); /* 3 forked samples x 2 layers */
        assert_int_equal(pool.high_water_pages, sharing ? 12 : 24);
        assert_int_equal(pool.promised_pages, 0);
        run(&f, 0);
        pool = pool_of(&f);
        assert_int_equal(pool.held_pages, 0);
        /* the prompt's 2 blocks, and each sample's third, full at completion */
        assert_int_equal(pool.evictable_pages, sharing ? 4 + 4 * 2 : 0);
        assert_int_equal(pool.cow_copies, sharing ? 6 : 0);
        assert_int_equal(pool.high_water_pages, sharing ? 12 : 24);
        assert_samples_exact(&b, 0, 4, 9, 3);
        kvp_request_result done[2];
        assert_int_equal(collect_all(&f, done, 2), 1);
        teardown_fixture(&f);
    }
}

/* One step that admits the waiting head: its step stats. */
static kvp_step_stats step_once(fixture *f)
{
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_step(f->scheduler, &st, &err), &err);
    kvpt_assert_pool_ok(f->pool);
    return st;
}

/*
 * Admission counts an adopted prefix's pages once: request 0 (12 tokens of
 * group 0, still running) holds its prompt's 3 full blocks, published; request
 * 1 (13 tokens, the first 12 of group 0) adopts them and needs only its own
 * pages past them (13 + 2 tokens: 4 blocks, 3 adopted) x 2 layers, which a
 * pool of 10 pages has beside request 0's 8 (12 + 4 reserve tokens: 4 blocks
 * x 2 layers). Counted as its own, the prompt would not fit until request 0
 * completes.
 */
static void test_scheduler_admission_counts_adopted_pages_once(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sharing(&f, 10, 1, 1, 0, 1);
    static book b;
    memset(&b, 0, sizeof b);
    b.shared[0] = 12;
    b.shared[1] = 12;
    submit_samples(&f, &b, 12, 8, NULL, 1);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.held_pages, 8); /* 12 prompt + 4 reserve tokens: 4 blocks x 2 layers */
    submit_samples(&f, &b, 13, 2, NULL, 1);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 12);
    assert_int_equal(st.held_pages, 10);
    assert_int_equal(st.running, 2);
    run(&f, 0);
    assert_samples_exact(&b, 0, 1, 12, 8);
    assert_samples_exact(&b, 1, 1, 13, 2);
    kvp_request_result done[4];
    assert_int_equal(collect_all(&f, done, 4), 2);
    teardown_fixture(&f);
}

/*
 * Prompts sharing a prefix hit the prefix index: request 0 (10 tokens of
 * group 0) publishes 2 full blocks; a later request with 13 tokens, the
 * first 10 of group 0, adopts both (8 tokens; at most (13 - 1) / 4 blocks);
 * one with the same 10 tokens adopts 8 (at most (10 - 1) / 4 = 2 blocks);
 * one with 8 tokens of the group adopts 4 (its last token is computed);
 * one of another group adopts nothing. Outputs stay exact, samples too;
 * sharing off never hits.
 */
static void test_scheduler_shared_prefixes_hit_the_index(void **state)
{
    (void)state;
    static const size_t prompts[5] = {10, 13, 10, 8, 10};
    static const size_t shared[5] = {10, 10, 10, 8, 10};
    static const uint64_t groups[5] = {0, 0, 0, 0, 1};
    static const size_t hits[5] = {0, 8, 8, 4, 0};
    for (int sharing = 0; sharing <= 1; sharing++) {
        fixture f;
        setup_fixture_sharing(&f, 64, 2, 1, 0, sharing);
        static book b;
        memset(&b, 0, sizeof b);
        size_t total_hits = 0;
        for (size_t i = 0; i < 5; i++) {
            b.shared[i] = shared[i];
            b.group[i] = groups[i];
            submit_samples(&f, &b, prompts[i], 3, NULL, 1 + i % 2);
            kvp_step_stats st = step_once(&f);
            assert_int_equal(st.admitted, 1);
            assert_int_equal(st.prompt_tokens, prompts[i]);
            assert_int_equal(st.prefix_hit_tokens, sharing ? hits[i] : 0);
            total_hits += sharing ? hits[i] : 0;
        }
        run(&f, 0);
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.prefix_hit_tokens, total_hits);
        assert_int_equal(s.prompt_tokens, 10 + 13 + 10 + 8 + 10);
        for (size_t i = 0; i < 5; i++) {
            assert_samples_exact(&b, i, 1 + i % 2, prompts[i], 3);
        }
        kvp_request_result done[8];
        assert_int_equal(collect_all(&f, done, 8), 5);
        for (size_t k = 0; k < 5; k++) {
            /* Request i was admitted alone in step i, with its hits; it decoded its first
             * token in that step and its 3 tokens in steps i .. i + 2. */
            uint64_t i = done[k].id;
            assert_int_equal(done[k].admissions, 1);
            assert_int_equal(done[k].first_hit_tokens, sharing ? hits[i] : 0);
            assert_int_equal(done[k].recomputed_tokens, 0);
            assert_int_equal(done[k].admitted_step, i);
            assert_int_equal(done[k].first_token_step, i);
            assert_int_equal(done[k].finished_step, i + 2);
        }
        teardown_fixture(&f);
    }
}

/*
 * A weight update between steps: the running requests (2 samples each) are
 * preempted as stale and recomputed under the new weights; a new request
 * with the same prefix gets no hit of the old blocks, then later ones hit
 * the new blocks; every token decoded after the update equals a fresh
 * sequence under the new weights, bit for bit.
 */
static void test_scheduler_weight_update_recomputes(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 64, 2, 1, 0);
    static book b;
    memset(&b, 0, sizeof b);
    for (size_t i = 0; i < 4; i++) {
        b.shared[i] = 9;
        b.group[i] = 0;
    }
    submit_samples(&f, &b, 9, 10, NULL, 2);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 0);
    submit_samples(&f, &b, 11, 10, NULL, 2);
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 8); /* request 0's 2 blocks */
    st = step_once(&f);
    assert_int_equal(st.running, 4);
    size_t before_update[2] = {b.tokens[0][0], b.tokens[1][0]};
    assert_int_equal(before_update[0], 3);
    assert_int_equal(before_update[1], 2);
    update_weights(f.model);
    st = step_once(&f); /* the two stale requests go back to the queue, nothing decodes */
    assert_int_equal(st.stale_preempted, 4);
    assert_int_equal(st.preempted, 4);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.running, 0);
    assert_int_equal(st.waiting, 2);
    submit_samples(&f, &b, 10, 4, NULL, 1); /* request 2: the same prefix */
    st = step_once(&f); /* all three admitted together: no block of the new weights yet */
    assert_int_equal(st.admitted, 3);
    assert_int_equal(st.prefix_hit_tokens, 0);
    assert_int_equal(st.prompt_tokens, 9 + 11 + 10);
    assert_int_equal(st.prefill_tokens, 9 + 2 * 3 + 11 + 2 * 2 + 10);
    assert_int_equal(st.stale_preempted, 0);
    submit_samples(&f, &b, 12, 2, NULL, 1); /* request 3: hits the new blocks */
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 8);
    run(&f, 0);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.stale_preemptions, 4);
    assert_int_equal(s.preemptions, 4);
    assert_int_equal(s.prefix_hit_tokens, 16);
    assert_int_equal(s.completed, 4);
    for (size_t k = 0; k < 2; k++) {
        assert_sample_exact_range(&b, 0, k, 9, 10, 9 + before_update[0], CAPACITY, 1);
        assert_sample_exact_range(&b, 1, k, 11, 10, 11 + before_update[1], CAPACITY, 1);
        /* Before the update, the outputs were the old weights'. */
        assert_sample_exact_range(&b, 0, k, 9, 10, 0, 9 + before_update[0], 0);
        assert_sample_exact_range(&b, 1, k, 11, 10, 0, 11 + before_update[1], 0);
    }
    assert_sample_exact_range(&b, 2, 0, 10, 4, 0, CAPACITY, 1);
    assert_sample_exact_range(&b, 3, 0, 12, 2, 0, CAPACITY, 1);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 4);
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(done[i].status, KVP_OK);
    }
    teardown_fixture(&f);
}

/* The schedule of shared-prefix requests with samples: compute on and off alike. */
static void schedule_shared(int compute, size_t pages, kvp_step_stats *steps, size_t *count)
{
    fixture f;
    setup_fixture(&f, pages, 1, compute, 0);
    static book b;
    memset(&b, 0, sizeof b);
    *count = 0;
    for (size_t i = 0;; i++) {
        if (i < 6) { /* one request a step, so later ones find earlier ones' blocks */
            b.shared[i] = 8;
            b.group[i] = i % 2;
            submit_samples(&f, &b, 9 + i, 3 + i % 3, NULL, 1 + i % 3);
        }
        kvp_scheduler_stats s = stats_of(&f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(*count < 256);
        steps[(*count)++] = step_once(&f);
    }
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 6);
    teardown_fixture(&f);
}

static void test_scheduler_compute_off_shares_alike(void **state)
{
    (void)state;
    static kvp_step_stats on[256];
    static kvp_step_stats off[256];
    size_t pages[] = {96, 20};
    for (size_t i = 0; i < 2; i++) {
        size_t n_on = 0;
        size_t n_off = 0;
        schedule_shared(1, pages[i], on, &n_on);
        schedule_shared(0, pages[i], off, &n_off);
        assert_int_equal(n_on, n_off);
        size_t hit = 0;
        for (size_t k = 0; k < n_on; k++) {
            assert_memory_equal(&on[k], &off[k], sizeof on[k]);
            hit += on[k].prefix_hit_tokens;
        }
        assert_true(hit > 0);
        /* Without a model (the config's geometry): the same steps, hits included;
           and with block digests instead of rows too. */
        fixture_without_model = 1;
        for (int digests = 0; digests <= 1; digests++) {
            requests_by_digest = digests;
            digest_calls = 0;
            schedule_shared(0, pages[i], off, &n_off);
            assert_true(digests ? digest_calls > 0 : digest_calls == 0);
            assert_int_equal(n_on, n_off);
            for (size_t k = 0; k < n_on; k++) {
                assert_memory_equal(&on[k], &off[k], sizeof on[k]);
            }
        }
        requests_by_digest = 0;
        fixture_without_model = 0;
    }
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

/*
 * A completed request publishes its decoded blocks too: request 0 (6 prompt
 * tokens, 10 decoded: 4 full blocks, the last 3 holding decoded tokens)
 * runs to completion; request 1, whose prompt is request 0's 16 rows and 3
 * more (a conversation's next turn), adopts all 4 blocks ((19 - 1) / 4 = 4:
 * 16 tokens), not only the prompt's first. With 2 samples each sample
 * publishes its own blocks (here their rows are the same: the second finds
 * the keys taken and leaves them). Outputs equal a fresh sequence's, and
 * sharing off's, bit for bit; compute off hits alike, keyed by rows or,
 * with no model, by block digests (no row read); after a weight update
 * nothing of the old blocks is adopted.
 */
static void test_scheduler_publishes_decoded_blocks(void **state)
{
    (void)state;
    static double off_outputs[3][2][CAPACITY][WIDTH]; /* request 1's, sharing off, by samples */
    /* mode 2: computed; 1: allocator-only; 0: allocator-only, no model, block digests */
    for (int mode = 2; mode >= 0; mode--) {
        int compute = mode == 2;
        fixture_without_model = requests_by_digest = mode == 0;
        for (size_t samples = 1; samples <= 2; samples++) {
            for (int sharing = 0; sharing <= 1; sharing++) {
                /* compute off binds the configured identity: no update to make */
                for (int update = 0; update <= (sharing && compute); update++) {
                    fixture f;
                    setup_fixture_sharing(&f, 64, 2, compute, 0, sharing);
                    static book b;
                    memset(&b, 0, sizeof b);
                    for (size_t i = 0; i < 2; i++) {
                        b.shared[i] = CAPACITY; /* every row of both is group 0's */
                        b.group[i] = 0;
                    }
                    submit_samples(&f, &b, 6, 10, NULL, samples);
                    run(&f, 0);
                    assert_int_equal(stats_of(&f).completed, 1);
                    if (update) {
                        update_weights(f.model);
                    }
                    submit_samples(&f, &b, 19, 2, NULL, 1);
                    kvp_step_stats st = step_once(&f);
                    assert_int_equal(st.admitted, 1);
                    assert_int_equal(st.prompt_tokens, 19);
                    assert_int_equal(st.prefix_hit_tokens, sharing && !update ? 16 : 0);
                    run(&f, 0);
                    if (compute) {
                        assert_samples_exact(&b, 0, samples, 6, 10);
                        assert_sample_exact_range(&b, 1, 0, 19, 2, 0, CAPACITY, (size_t)update);
                        if (!sharing) {
                            memcpy(off_outputs[samples], b.outputs[1], sizeof off_outputs[0]);
                        } else if (!update) {
                            assert_memory_equal(off_outputs[samples], b.outputs[1],
                                                sizeof off_outputs[0]);
                        }
                    }
                    teardown_collected(&f, 2);
                }
            }
        }
    }
    fixture_without_model = requests_by_digest = 0;
}

/*
 * Publication continues the prompt's block keys kept from its admission, and
 * reads its own rows for the rest: request 0 (6 prompt tokens, the last 2
 * in a partial block, 10 decoded) is admitted, then request 1 (rows of its
 * own, 6 tokens, 2 decoded) in the next step, whose rows replace request
 * 0's in the step's scratch; request 0 completes after it. Request 2,
 * request 0's 16 rows and 3 more, adopts 4 blocks (16 tokens): the block
 * holding the prompt's partial rows and the decoded ones was keyed from
 * request 0's rows, not the scratch's (computed, and allocator-only keyed
 * by rows or by block digests).
 */
static void test_scheduler_publication_keys_its_own_partial_block(void **state)
{
    (void)state;
    for (int mode = 2; mode >= 0; mode--) {
        int compute = mode == 2;
        fixture_without_model = requests_by_digest = mode == 0;
        fixture f;
        setup_fixture_sharing(&f, 64, 1, compute, 0, 1);
        static book b;
        memset(&b, 0, sizeof b);
        b.shared[0] = b.shared[2] = CAPACITY; /* requests 0 and 2: group 0's rows */
        b.group[0] = b.group[2] = 0;
        submit_samples(&f, &b, 6, 10, NULL, 1);
        assert_int_equal(step_once(&f).admitted, 1);
        submit_samples(&f, &b, 6, 2, NULL, 1); /* rows of its own */
        assert_int_equal(step_once(&f).admitted, 1);
        run(&f, 0);
        assert_int_equal(stats_of(&f).completed, 2);
        submit_samples(&f, &b, 19, 2, NULL, 1);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prompt_tokens, 19);
        assert_int_equal(st.prefix_hit_tokens, 16);
        run(&f, 0);
        if (compute) {
            assert_samples_exact(&b, 0, 1, 6, 10);
            assert_samples_exact(&b, 2, 1, 19, 2);
        }
        teardown_collected(&f, 3);
    }
    fixture_without_model = requests_by_digest = 0;
}

/*
 * Outputs of a request whose prompt rows were given (`rows`, its first
 * `prompt`) and whose decoded rows come from the book, against a fresh
 * sequence fed the same rows alone, bit for bit.
 */
static void assert_given_prompt_exact(const book *b, uint64_t id, const double *rows,
                                      size_t prompt, size_t new_tokens)
{
    kvp_model *model = make_model();
    kvp_pool *pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, 64);
    kvp_sequence *seq = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_create(model, pool, 1, CAPACITY, &seq, &err), &err);
    kvp_tensor input = kvp_tensor3((double *)(uintptr_t)rows, 1, prompt, WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &input, NULL, NULL, NULL, 0, &err), &err);
    assert_int_equal(b->tokens[id][0], new_tokens);
    for (size_t position = prompt; position < prompt + new_tokens; position++) {
        double row[WIDTH];
        double out[WIDTH];
        row_at(b, id, 0, position, row);
        kvp_tensor one = kvp_tensor3(row, 1, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &one, NULL, NULL, out, WIDTH, &err), &err);
        assert_true(b->seen[id][0][position]);
        assert_memory_equal(out, b->outputs[id][0][position], sizeof out);
    }
    kvpt_assert_ok(kvp_sequence_destroy(seq, NULL), NULL);
    kvpt_assert_ok(kvp_pool_destroy(pool, NULL), NULL);
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
}

/*
 * Each sample publishes its own decoded blocks, chained from the prompt:
 * request 0 (6 prompt tokens, 10 decoded, 2 samples whose decoded rows
 * differ) completes; then request 1 + k, whose 19-token prompt is request
 * 0's prompt, sample k's 10 rows and 3 of its own (the next turn after
 * sample k's reply), adopts 4 blocks (16 tokens) for each k: both samples'
 * chains, the one keyed first and the one keyed after it, reach every
 * decoded block. With sharing off nothing is adopted; compute off hits
 * alike; outputs equal a fresh sequence's bit for bit. One decoder thread.
 */
static void test_scheduler_publishes_each_samples_decoded_blocks(void **state)
{
    (void)state;
    enum { PROMPT = 6, NEW = 10, NEXT = 19 };
    static double rows[2][NEXT][WIDTH];
    for (int compute = 1; compute >= 0; compute--) {
        for (int sharing = 0; sharing <= 1; sharing++) {
            fixture f;
            setup_fixture_sharing(&f, 64, 1, compute, 0, sharing);
            static book b;
            memset(&b, 0, sizeof b); /* nothing shared: sample k > 0 decodes its own rows */
            submit_samples(&f, &b, PROMPT, NEW, NULL, 2);
            run(&f, 0);
            assert_int_equal(stats_of(&f).completed, 1);
            for (size_t k = 0; k < 2; k++) {
                uint64_t id = 1 + k;
                for (size_t t = 0; t < NEXT; t++) {
                    if (t < PROMPT + NEW) {
                        row_at(&b, 0, k, t, rows[k][t]); /* the prompt, then sample k's reply */
                    } else {
                        row_at(&b, id, 0, t, rows[k][t]);
                    }
                }
                assert_int_equal(submit(&f, &b, NEXT, 2, &rows[k][0][0]), id);
                kvp_step_stats st = step_once(&f);
                assert_int_equal(st.admitted, 1);
                assert_int_equal(st.prompt_tokens, NEXT);
                assert_int_equal(st.prefix_hit_tokens, sharing ? 16 : 0);
                run(&f, 0);
            }
            /* The replies differ from position PROMPT on: two chains, not one. */
            assert_memory_not_equal(rows[0][PROMPT], rows[1][PROMPT], sizeof rows[0][PROMPT]);
            if (compute) {
                assert_samples_exact(&b, 0, 2, PROMPT, NEW);
                for (size_t k = 0; k < 2; k++) {
                    assert_given_prompt_exact(&b, 1 + k, &rows[k][0][0], NEXT, 2);
                }
            }
            teardown_collected(&f, 3);
        }
    }
}

/*
 * One run of the overtaking scenario under `schedule`: request 0 (33
 * tokens of group 0, 30 new) runs and holds most of a 32-page pool; request
 * 1 (25 tokens of its own) waits at the head, never fitting beside it (14
 * pages asked, at most 12 available); requests 2 .. 13 (33 tokens of group
 * 0, 1 new), one submitted before each step, adopt request 0's 8 prompt
 * blocks and fit in 2 pages. Writes the step each request was admitted at
 * (its first decoded token) and the steps that admitted a request behind
 * request 1 while it waited.
 */
#define OVERTAKERS 12
static void run_overtaking(kvp_schedule schedule, book *b, size_t *admitted_at,
                           size_t *overtaking_steps)
{
    fixture f;
    setup_fixture_schedule(&f, 32, 2, 1, 0, 1, schedule);
    memset(b, 0, sizeof *b);
    for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
        b->shared[i] = i == 1 ? 0 : 33;
        b->group[i] = 0;
        admitted_at[i] = SIZE_MAX;
    }
    submit_samples(&f, b, 33, 30, NULL, 1);
    assert_int_equal(step_once(&f).admitted, 1);
    submit_samples(&f, b, 25, 3, NULL, 1);
    *overtaking_steps = 0;
    for (size_t step = 1; stats_of(&f).running + stats_of(&f).waiting > 0; step++) {
        assert_true(step < 1000);
        if (step <= OVERTAKERS) {
            submit_samples(&f, b, 33, 1, NULL, 1);
        }
        kvp_step_stats st = step_once(&f);
        if (step == 1) {
            /* Only the cached request fits: cache-aware admits it ahead of the head. */
            assert_int_equal(st.admitted, schedule == KVP_SCHEDULE_CACHE_AWARE);
            assert_int_equal(st.prefix_hit_tokens, 32 * st.admitted);
        }
        int overtaken = 0;
        for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
            if (admitted_at[i] == SIZE_MAX && b->tokens[i][0] > 0) {
                admitted_at[i] = step;
                overtaken |= i > 1 && admitted_at[1] == SIZE_MAX;
            }
        }
        *overtaking_steps += (size_t)overtaken;
    }
    for (size_t i = 0; i < 2 + OVERTAKERS; i++) {
        assert_true(admitted_at[i] != SIZE_MAX);
        assert_sample_exact_range(b, i, 0, i == 1 ? 25 : 33, i == 0 ? 30 : i == 1 ? 3 : 1, 0,
                                  CAPACITY, 0);
    }
    kvp_request_result done[2 + OVERTAKERS];
    assert_int_equal(collect_all(&f, done, 2 + OVERTAKERS), 2 + OVERTAKERS);
    teardown_fixture(&f);
}

/*
 * Cache-aware admission: a request whose prompt prefix the index holds is
 * admitted ahead of an uncached head that does not fit; the head is
 * overtaken in at most KVP_SCHEDULE_MAX_SKIPS steps, after which nothing
 * behind it goes first; every request's outputs are bit-identical to FCFS's
 * (and to a fresh sequence's).
 */
static void test_scheduler_cache_aware_admits_cached_prefix_first(void **state)
{
    (void)state;
    static book fcfs;
    static book aware;
    size_t fcfs_at[2 + OVERTAKERS];
    size_t aware_at[2 + OVERTAKERS];
    size_t fcfs_overtakes;
    size_t aware_overtakes;
    run_overtaking(KVP_SCHEDULE_FCFS, &fcfs, fcfs_at, &fcfs_overtakes);
    run_overtaking(KVP_SCHEDULE_CACHE_AWARE, &aware, aware_at, &aware_overtakes);
    assert_int_equal(fcfs_overtakes, 0);
    assert_int_equal(aware_overtakes, KVP_SCHEDULE_MAX_SKIPS); /* reached, and held */
    for (size_t i = 2; i < 2 + OVERTAKERS; i++) {
        assert_true(fcfs_at[i] >= fcfs_at[1]);
        /* The first MAX_SKIPS overtakers went first; the rest waited behind request 1. */
        if (i < 2 + KVP_SCHEDULE_MAX_SKIPS) {
            assert_true(aware_at[i] < aware_at[1]);
        } else {
            assert_true(aware_at[i] >= aware_at[1]);
        }
    }
    assert_memory_equal(fcfs.outputs, aware.outputs, sizeof fcfs.outputs);
    assert_memory_equal(fcfs.tokens, aware.tokens, sizeof fcfs.tokens);
}

/* The pool's counters now. */
static kvp_pool_stats pool_of(const fixture *f)
{
    kvp_pool_stats pool;
    kvp_pool_stats_init(&pool);
    kvpt_assert_ok(kvp_pool_stats_get(f->pool, &pool, NULL), NULL);
    return pool;
}

/* The scheduler's session counters, against what the test expects. */
static void assert_sessions(const fixture *f, uint64_t keeps, uint64_t hits, uint64_t drops,
                            size_t retained, size_t retained_pages)
{
    kvp_scheduler_stats s = stats_of(f);
    assert_int_equal(s.session_keeps, keeps);
    assert_int_equal(s.session_hits, hits);
    assert_int_equal(s.session_drops, drops);
    assert_int_equal(s.retained, retained);
    assert_int_equal(s.retained_pages, retained_pages);
}

/*
 * Every row of requests `ids` is group `group`'s: a conversation whose
 * later turn's prompt holds an earlier turn's prompt and reply.
 */
static void book_conversation(book *b, const uint64_t *ids, size_t n, uint64_t group)
{
    for (size_t i = 0; i < n; i++) {
        b->shared[ids[i]] = CAPACITY;
        b->group[ids[i]] = group;
    }
}

/* The first turn of session 1 (6 prompt tokens, 10 decoded: 16, 4 full blocks x 2 layers). */
#define TURN1_PROMPT 6
#define TURN1_NEW 10
#define TURN1_PAGES 8
/* Its next turn: the 16 rows and 3 more; adopts the 4 blocks (16 tokens). */
#define TURN2_PROMPT 19
#define TURN2_NEW 2
#define TURN2_PAGES 12 /* 21 tokens: 6 blocks x 2 layers */

/*
 * A conversation's next turn adopts its first turn's blocks across
 * eviction pressure: in a 24-page pool, turn 1 (session 1) completes,
 * then two requests of 28 prompt tokens and 4 decoded (16 pages each) run
 * one after the other. Without sessions (ttl 0) turn 1's 8 evictable pages
 * are the least recently used and the second filler evicts them: turn 2
 * adopts nothing. With sessions turn 1's sequence is kept (held, 8 pages,
 * so the fillers evict each other's instead) and turn 2 adopts its 16
 * tokens; the kept sequence is then given back (a session hit) and turn 2
 * is kept in turn (12 pages, at most half the pool). Every output is
 * bit-identical between the two runs and to a fresh sequence's.
 */
static void test_scheduler_session_keeps_turn_across_pressure(void **state)
{
    (void)state;
    static book runs[2];
    static const size_t ttls[2] = {0, 100};
    for (size_t r = 0; r < 2; r++) {
        size_t ttl = ttls[r];
        int on = ttl != 0;
        fixture f;
        setup_fixture_sessions(&f, 24, ttl, 0.5);
        book *b = &runs[r];
        memset(b, 0, sizeof *b);
        static const uint64_t turns[2] = {0, 3};
        book_conversation(b, turns, 2, 0); /* requests 1 and 2 (the fillers): their own rows */
        submit_session(&f, b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 1);
        run(&f, 0);
        assert_sessions(&f, on, 0, 0, on, on ? TURN1_PAGES : 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.held_pages, on ? TURN1_PAGES : 0);
        assert_int_equal(pool.evictable_pages, on ? 0 : TURN1_PAGES);
        for (size_t i = 0; i < 2; i++) {
            submit_session(&f, b, 28, 4, NULL, 1, 0);
            kvp_step_stats st = step_once(&f);
            assert_int_equal(st.admitted, 1);
            assert_int_equal(st.prefix_hit_tokens, 0);
            assert_int_equal(st.retained_pages, on ? TURN1_PAGES : 0);
            run(&f, 0);
        }
        assert_sessions(&f, on, 0, 0, on, on ? TURN1_PAGES : 0);
        submit_session(&f, b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prompt_tokens, TURN2_PROMPT);
        assert_int_equal(st.prefix_hit_tokens, on ? 16 : 0);
        assert_int_equal(st.retained_pages, 0); /* given back once turn 2 adopted it */
        assert_sessions(&f, on, on, 0, 0, 0);
        run(&f, 0);
        assert_sessions(&f, 2 * (uint64_t)on, on, 0, on, on ? TURN2_PAGES : 0);
        assert_int_equal(pool_of(&f).held_pages, on ? TURN2_PAGES : 0);
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.prefix_hit_tokens, on ? 16 : 0);
        assert_int_equal(s.preemptions, 0);
        assert_int_equal(s.completed, 4);
        assert_samples_exact(b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(b, 1, 1, 28, 4);
        assert_samples_exact(b, 2, 1, 28, 4);
        assert_samples_exact(b, 3, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 4); /* the kept turn 2 gives its pages back: none held */
    }
    assert_memory_equal(runs[0].outputs, runs[1].outputs, sizeof runs[0].outputs);
    assert_memory_equal(runs[0].tokens, runs[1].tokens, sizeof runs[0].tokens);
}

/*
 * A request submitted while its session's sequence is kept goes to the
 * front of the queue: turn 1 (session 1) is kept (8 pages of 24); request
 * 1 (20 prompt tokens, 4 decoded: 12 pages) runs; request 2 (8 + 2
 * tokens: 6 pages) waits, 4 pages being left. Turn 2 of session 1 (4 new
 * pages past its 4 adopted blocks) is then admitted ahead of request 2.
 * Submitted under session 2 (nothing kept), the same request queues behind
 * request 2 and FCFS admits neither. Outputs exact either way.
 */
static void test_scheduler_session_request_goes_first(void **state)
{
    (void)state;
    for (uint64_t session = 1; session <= 2; session++) {
        int first = session == 1;
        fixture f;
        setup_fixture_sessions(&f, 24, 100, 0.5);
        static book b;
        memset(&b, 0, sizeof b);
        static const uint64_t turns[2] = {0, 3};
        book_conversation(&b, turns, 2, 0);
        submit_session(&f, &b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 1);
        run(&f, 0);
        submit_session(&f, &b, 20, 4, NULL, 1, 0);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.held_pages, TURN1_PAGES + 12);
        submit_session(&f, &b, 8, 2, NULL, 1, 0);
        st = step_once(&f);
        assert_int_equal(st.admitted, 0);
        assert_int_equal(st.waiting, 1);
        submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, session);
        st = step_once(&f);
        assert_int_equal(st.admitted, first);
        assert_int_equal(st.prefix_hit_tokens, first ? 16 : 0);
        assert_int_equal(st.waiting, first ? 1 : 2);
        assert_int_equal(b.tokens[3][0], first);
        assert_int_equal(b.tokens[2][0], 0);
        assert_sessions(&f, 1, first, 0, !first, first ? 0 : TURN1_PAGES);
        assert_int_equal(stats_of(&f).preemptions, 0);
        run(&f, 0);
        assert_int_equal(stats_of(&f).completed, 4);
        assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(&b, 1, 1, 20, 4);
        assert_samples_exact(&b, 2, 1, 8, 2);
        assert_samples_exact(&b, 3, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 4);
    }
}

/*
 * Runs turn 1 of session 1 to completion in `f` (kept: sessions on, 24
 * pages, fraction 0.5): the step it finished in.
 */
static kvp_step_stats run_turn1(fixture *f, book *b)
{
    memset(b, 0, sizeof *b);
    static const uint64_t turns[2] = {0, 1};
    book_conversation(b, turns, 2, 0);
    submit_session(f, b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 1);
    for (size_t i = 0; i < TURN1_NEW; i++) {
        kvp_step_stats st = step_once(f);
        assert_int_equal(st.decoded, 1);
        if (st.finished == 1) {
            assert_int_equal(i, TURN1_NEW - 1);
            return st;
        }
    }
    fail();
    return (kvp_step_stats){0};
}

/* A sessions fixture (24 pages, ttl 100, fraction 0.5) with turn 1 run and kept. */
static void start_conversation(fixture *f, book *b)
{
    setup_fixture_sessions(f, 24, 100, 0.5);
    run_turn1(f, b);
}

/*
 * Expiry: with ttl 3 turn 1's sequence is kept through the 3 steps after
 * the one it finished in (a request admitted in the third adopts it: a
 * session hit) and given back at the end of the third (a drop: its pages
 * evictable, still indexed, so the next turn still hits the index).
 */
static void test_scheduler_session_expires_after_ttl(void **state)
{
    (void)state;
    const size_t ttl = 3;
    for (size_t waits = ttl - 1; waits <= ttl; waits++) {
        int kept = waits < ttl;
        fixture f;
        setup_fixture_sessions(&f, 24, ttl, 0.5);
        static book b;
        kvp_step_stats st = run_turn1(&f, &b);
        assert_int_equal(st.retained_pages, TURN1_PAGES);
        assert_int_equal(st.held_pages, TURN1_PAGES);
        for (size_t j = 1; j <= waits; j++) {
            st = step_once(&f); /* nothing runs or waits */
            assert_int_equal(st.retained_pages, j < ttl ? TURN1_PAGES : 0);
            assert_int_equal(st.held_pages, j < ttl ? TURN1_PAGES : 0);
        }
        assert_sessions(&f, 1, 0, !kept, kept, kept ? TURN1_PAGES : 0);
        assert_int_equal(pool_of(&f).evictable_pages, kept ? 0 : TURN1_PAGES);
        submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
        st = step_once(&f);
        assert_int_equal(st.admitted, 1);
        assert_int_equal(st.prefix_hit_tokens, 16);
        assert_sessions(&f, 1, kept, !kept, 0, 0);
        run(&f, 0);
        assert_sessions(&f, 2, kept, !kept, 1, TURN2_PAGES);
        assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
        assert_samples_exact(&b, 1, 1, TURN2_PROMPT, TURN2_NEW);
        teardown_collected(&f, 2);
    }
}

/*
 * Replacement: two requests of session 1 run together (6 prompt tokens of
 * their own; 2 and 5 decoded). The first completes at step 2 and is kept
 * (8 tokens: 4 pages); the second completes at step 5 and is kept instead
 * (11 tokens: 6 pages), the first given back (a drop).
 */
static void test_scheduler_session_replaced_by_same_session(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sessions(&f, 24, 100, 0.5);
    static book b;
    memset(&b, 0, sizeof b);
    submit_session(&f, &b, 6, 2, NULL, 1, 1);
    submit_session(&f, &b, 6, 5, NULL, 1, 1);
    for (size_t step = 1; step <= 5; step++) {
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, step == 1 ? 2 : 0);
        assert_int_equal(st.finished, step == 2 || step == 5);
        assert_int_equal(st.retained_pages, step < 2 ? 0 : step < 5 ? 4 : 6);
        if (step < 5) {
            assert_sessions(&f, step >= 2, 0, 0, step >= 2, step < 2 ? 0 : 4);
        }
    }
    assert_sessions(&f, 2, 0, 1, 1, 6);
    kvp_pool_stats pool = pool_of(&f);
    assert_int_equal(pool.held_pages, 6);
    assert_int_equal(stats_of(&f).running, 0);
    assert_samples_exact(&b, 0, 1, 6, 2);
    assert_samples_exact(&b, 1, 1, 6, 5);
    teardown_collected(&f, 2);
}

/*
 * session_fraction caps the kept pages: fraction 0 keeps nothing, nor does
 * 0.25 (6 of 24 pages) a sequence of 8 pages; at 0.5 (12 pages) a second
 * session's 8 pages push the oldest out (a drop), keeping one.
 */
static void test_scheduler_session_fraction_caps_kept_pages(void **state)
{
    (void)state;
    static const double fractions[2] = {0.0, 0.25};
    for (size_t i = 0; i < 2; i++) {
        fixture f;
        setup_fixture_sessions(&f, 24, 100, fractions[i]);
        static book b;
        kvp_step_stats st = run_turn1(&f, &b);
        assert_int_equal(st.retained_pages, 0);
        assert_sessions(&f, 0, 0, 0, 0, 0);
        kvp_pool_stats pool = pool_of(&f);
        assert_int_equal(pool.held_pages, 0);
        assert_int_equal(pool.evictable_pages, TURN1_PAGES);
        teardown_collected(&f, 1);
    }
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    b.shared[1] = 0; /* request 1: session 2, its own rows, as long */
    submit_session(&f, &b, TURN1_PROMPT, TURN1_NEW, NULL, 1, 2);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN1_PAGES);
    kvp_pool_stats pool = pool_of(&f);
    assert_int_equal(pool.held_pages, TURN1_PAGES);
    assert_int_equal(pool.evictable_pages, TURN1_PAGES); /* session 1's, given back */
    /* Session 2's is the one kept: its next turn goes first, session 1's does not. */
    b.shared[2] = 0;
    submit_session(&f, &b, 8, 2, NULL, 1, 1);
    b.shared[3] = 0;
    submit_session(&f, &b, 8, 2, NULL, 1, 2);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 2);
    assert_sessions(&f, 2, 1, 1, 0, 0);
    run(&f, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, TURN1_PROMPT, TURN1_NEW);
    teardown_collected(&f, 4);
}

/*
 * Running sequences' pages come before kept ones: turn 1 is kept (8 of 24
 * pages); request 1 (8 prompt tokens of its own, 30 decoded) grows to 38
 * tokens, 20 pages, more than the 16 beside the kept sequence. The kept
 * sequence is given back (a drop) in the step the running one first needs
 * a ninth block (step 25 decodes its 33rd token: 18 pages, 16 available
 * beside the kept 8), not before, and nothing is ever preempted.
 */
static void test_scheduler_session_given_back_before_preemption(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    b.shared[1] = 0;
    submit_session(&f, &b, 8, 30, NULL, 1, 0);
    size_t dropped_at = SIZE_MAX;
    for (size_t step = 1; stats_of(&f).running + stats_of(&f).waiting > 0; step++) {
        assert_true(step <= 30);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.preempted, 0);
        assert_int_equal(st.decoded, 1);
        if (st.retained_pages == 0 && dropped_at == SIZE_MAX) {
            dropped_at = step;
            assert_int_equal(b.tokens[1][0], 25); /* 8 + 25 = 33 tokens: a ninth block */
        }
        assert_int_equal(st.retained_pages, step < 25 ? TURN1_PAGES : 0);
    }
    assert_int_equal(dropped_at, 25);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    assert_int_equal(stats_of(&f).preemptions, 0);
    assert_int_equal(pool_of(&f).held_pages, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, 8, 30);
    teardown_collected(&f, 2);
}

/*
 * A kept sequence whose parameters changed is given back at the end of the
 * next step (a drop); its blocks are of the old weights, so the session's
 * next turn adopts nothing, and its outputs are the new weights'.
 */
static void test_scheduler_session_stale_given_back(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    update_weights(f.model);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.retained_pages, 0);
    assert_int_equal(st.held_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN2_PAGES);
    assert_sample_exact_range(&b, 0, 0, TURN1_PROMPT, TURN1_NEW, 0, CAPACITY, 0);
    assert_sample_exact_range(&b, 1, 0, TURN2_PROMPT, TURN2_NEW, 0, CAPACITY, 1);
    teardown_collected(&f, 2);
}

/*
 * A kept sequence made stale by a weight update between steps is no session
 * hit: turn 2, submitted before the next step, does not go first for it,
 * adopts nothing (its keys hold the new digests), and the stale sequence
 * given back at its admission counts as a drop, not a hit.
 */
static void test_scheduler_session_stale_is_no_hit(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    update_weights(f.model);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 0, 1, 1, TURN2_PAGES);
    assert_sample_exact_range(&b, 1, 0, TURN2_PROMPT, TURN2_NEW, 0, CAPACITY, 1);
    teardown_collected(&f, 2);
}

/* splitmix64: the seeded draws of the random cases below. */
static uint64_t draw(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

/* A draw in [lo, hi]. */
static size_t draw_in(uint64_t *state, size_t lo, size_t hi)
{
    return lo + (size_t)(draw(state) % (hi - lo + 1));
}

#define RANDOM_CASES 24
#define CONVERSATIONS 5

/*
 * Sessions under random conversations, seeded (every run draws the same
 * cases): 5 conversations of 1 to 4 turns (16 requests at most), each
 * turn's prompt its conversation's earlier prompts and replies plus 1 to 6
 * new tokens, its reply 1 to 12, sent 0 to 3 steps after the turn before
 * it finished, over a pool of 34 to 44 pages (some cases preempt) with a
 * ttl of 1 to 24 steps, a session_fraction
 * of 0.25, 0.5 or 1, FCFS or cache-aware, 1 or 2 threads: keeps, hits,
 * expiries, pressure and evictions fall where they may. Whatever they do,
 * the pool's audit holds after every step, kept pages never pass the
 * fraction of the pool, every kept sequence is accounted for (keeps = hits
 * + drops + kept now), every request completes with outputs bit-identical
 * to a fresh sequence fed its rows alone, and destroying the scheduler
 * gives every page back. Over the cases, sessions hit and drop (the cases
 * exercise both).
 */
static void test_scheduler_sessions_random_conversations(void **state)
{
    (void)state;
    static book b;
    static const double fractions[3] = {0.25, 0.5, 1.0};
    uint64_t hits = 0;
    uint64_t drops = 0;
    for (uint64_t c = 0; c < RANDOM_CASES; c++) {
        uint64_t rng = 0x5e5510u + c;
        size_t pages = draw_in(&rng, 34, 44);
        size_t ttl = draw_in(&rng, 1, 24);
        double fraction = fractions[draw_in(&rng, 0, 2)];
        kvp_schedule schedule = draw_in(&rng, 0, 1) ? KVP_SCHEDULE_CACHE_AWARE
                                                      : KVP_SCHEDULE_FCFS;
        fixture f;
        setup_fixture_full(&f, pages, 1 + (size_t)(c % 2), 1, 0, 1, schedule, ttl, fraction);
        size_t cap = (size_t)floor(fraction * (double)pool_of(&f).total_pages);
        memset(&b, 0, sizeof b);
        size_t context[CONVERSATIONS];
        size_t due[CONVERSATIONS];
        size_t turns[CONVERSATIONS];
        uint64_t in_flight[CONVERSATIONS];
        size_t new_tokens[MAX_REQUESTS];
        for (size_t k = 0; k < CONVERSATIONS; k++) {
            context[k] = 0;
            due[k] = draw_in(&rng, 0, 6);
            turns[k] = draw_in(&rng, 1, 4);
            in_flight[k] = UINT64_MAX;
        }
        size_t submitted = 0;
        for (size_t step = 0;; step++) {
            assert_true(step < 4000);
            int pending = 0;
            for (size_t k = 0; k < CONVERSATIONS; k++) {
                uint64_t id = in_flight[k];
                if (id != UINT64_MAX && b.tokens[id][0] == new_tokens[id]) {
                    in_flight[k] = UINT64_MAX; /* finished: the next turn after a think time */
                    due[k] = step + draw_in(&rng, 0, 3);
                    turns[k]--;
                }
                size_t message = draw_in(&rng, 1, 6);
                size_t reply = draw_in(&rng, 1, 12);
                if (in_flight[k] == UINT64_MAX && turns[k] > 0 &&
                    (submitted == MAX_REQUESTS || context[k] + message + reply > CAPACITY)) {
                    turns[k] = 0; /* the conversation ends */
                }
                if (in_flight[k] == UINT64_MAX && turns[k] > 0 && step >= due[k]) {
                    b.shared[submitted] = CAPACITY; /* every row is the conversation's */
                    b.group[submitted] = k;
                    id = submit_session(&f, &b, context[k] + message, reply, NULL, 1, k + 1);
                    new_tokens[id] = reply;
                    context[k] += message + reply;
                    in_flight[k] = id;
                    submitted++;
                }
                pending |= in_flight[k] != UINT64_MAX || turns[k] > 0;
            }
            if (!pending) {
                break;
            }
            kvp_step_stats st = step_once(&f); /* audits the pool */
            assert_true(st.retained_pages <= cap);
            kvp_scheduler_stats s = stats_of(&f);
            assert_true(s.retained_pages <= cap);
            assert_int_equal(s.session_keeps, s.session_hits + s.session_drops + s.retained);
        }
        kvp_scheduler_stats s = stats_of(&f);
        assert_int_equal(s.completed, submitted);
        assert_int_equal(s.running + s.waiting, 0);
        hits += s.session_hits;
        drops += s.session_drops;
        for (size_t id = 0; id < submitted; id++) {
            assert_outputs_exact(&b, id, b.prompt[id], new_tokens[id]);
        }
        teardown_collected(&f, submitted);
    }
    assert_true(hits > 0);
    assert_true(drops > 0);
}

/*
 * Kept sequences never stall the queue: turn 1 is kept (8 of 24 pages);
 * request 1 (36 prompt tokens of its own, 2 decoded: 20 pages) does not fit
 * beside it and nothing runs, so the step that admits nothing gives every
 * kept sequence back (a drop), and the next step admits it.
 */
static void test_scheduler_session_stall_gives_back(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    b.shared[1] = 0;
    submit_session(&f, &b, 36, 2, NULL, 1, 0);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 0);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.waiting, 1);
    assert_int_equal(st.retained_pages, 0);
    assert_int_equal(st.held_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.held_pages, 20);
    run(&f, 0);
    assert_int_equal(stats_of(&f).preemptions, 0);
    assert_samples_exact(&b, 0, 1, TURN1_PROMPT, TURN1_NEW);
    assert_samples_exact(&b, 1, 1, 36, 2);
    teardown_collected(&f, 2);
}

/*
 * The largest ttl never expires: turn 1 kept with session_ttl SIZE_MAX
 * (its expiry step saturates) is still kept after 5 more steps and adopted
 * by the next turn (a session hit, no drop).
 */
static void test_scheduler_session_largest_ttl_never_expires(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_sessions(&f, 24, SIZE_MAX, 0.5);
    static book b;
    kvp_step_stats st = run_turn1(&f, &b);
    assert_int_equal(st.retained_pages, TURN1_PAGES);
    for (size_t j = 0; j < 5; j++) {
        assert_int_equal(step_once(&f).retained_pages, TURN1_PAGES);
    }
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    submit_session(&f, &b, TURN2_PROMPT, TURN2_NEW, NULL, 1, 1);
    st = step_once(&f);
    assert_int_equal(st.prefix_hit_tokens, 16);
    assert_sessions(&f, 1, 1, 0, 0, 0);
    run(&f, 0);
    assert_sessions(&f, 2, 1, 0, 1, TURN2_PAGES);
    assert_samples_exact(&b, 1, 1, TURN2_PROMPT, TURN2_NEW);
    teardown_collected(&f, 2);
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

/*
 * Submits a request of `prompt` tokens, no prompt rows, and `input` for its
 * rows (NULL: no rows at all, compute off only); returns its id.
 */
static uint64_t submit_counts(fixture *f, size_t prompt, size_t new_tokens, size_t samples,
                              kvp_scheduler_input_fn input)
{
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = prompt;
    request.max_new_tokens = new_tokens;
    request.samples = samples;
    request.input = input;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &request, &id, &err), &err);
    return id;
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
 * Kept sequences that share pages count them once: session 1's turn (5
 * prompt tokens, the first 4 of group 0, and 3 decoded: 2 blocks x 2
 * layers, 4 pages) is kept; session 2's request (5 tokens, the same first
 * block) adopts that block from it, and is kept too: 8 pages counted one by
 * one, 6 distinct, all the pool holds. Under session_fraction 0.25 (6 of 24
 * pages) both are kept (the old sum, 8, dropped session 1's); under 0.5 too
 * (the old sum said 8 while the pool held 6). Session 1's next turn (its 8
 * rows and 1 more, 1 decoded: 3 blocks, 6 pages) adopts its 2 blocks (a
 * session hit, 4 pages left kept: session 2's); kept in turn, it shares
 * block 0 with session 2's: 8 distinct pages, within 0.5's cap (12) beside
 * it, over 0.25's (6), which gives session 2's back (a drop). retained_pages
 * equals the pool's held pages throughout.
 */
static void test_scheduler_kept_sessions_count_shared_pages_once(void **state)
{
    (void)state;
    static const double fractions[2] = {0.25, 0.5};
    for (size_t i = 0; i < 2; i++) {
        int small = i == 0;
        fixture f;
        setup_fixture_sessions(&f, 24, 100, fractions[i]);
        static book b;
        memset(&b, 0, sizeof b);
        static const uint64_t turns[2] = {0, 2};
        book_conversation(&b, turns, 2, 0);
        b.shared[1] = 4; /* session 2: group 0's first block, then its own rows */
        b.group[1] = 0;
        submit_session(&f, &b, 5, 3, NULL, 1, 1);
        run(&f, 0);
        assert_sessions(&f, 1, 0, 0, 1, 4);
        submit_session(&f, &b, 5, 3, NULL, 1, 2);
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.prefix_hit_tokens, 4);
        run(&f, 0);
        assert_sessions(&f, 2, 0, 0, 2, 6);
        assert_int_equal(pool_of(&f).held_pages, 6);
        submit_session(&f, &b, 9, 1, NULL, 1, 1);
        st = step_once(&f);
        assert_int_equal(st.prefix_hit_tokens, 8);
        assert_int_equal(st.finished, 1);
        assert_int_equal(st.retained_pages, small ? 6 : 8);
        assert_sessions(&f, 3, 1, small, small ? 1 : 2, small ? 6 : 8);
        assert_int_equal(pool_of(&f).held_pages, small ? 6 : 8);
        assert_samples_exact(&b, 0, 1, 5, 3);
        assert_samples_exact(&b, 1, 1, 5, 3);
        assert_samples_exact(&b, 2, 1, 9, 1);
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

/*
 * A request with more samples than max_running (3 > 2) is admitted only
 * when nothing runs, and then runs alone: request 0 (1 sample) runs first;
 * request 1 (3 samples) waits until it finished, then decodes 3 sequences a
 * step, request 2 (1 sample) waiting behind it until it finishes.
 */
static void test_scheduler_more_samples_than_max_running_run_alone(void **state)
{
    (void)state;
    fixture f;
    setup_fixture(&f, 64, 1, 1, 2);
    static book b;
    memset(&b, 0, sizeof b);
    submit(&f, &b, 5, 2, NULL);
    submit_samples(&f, &b, 5, 2, NULL, 3);
    submit(&f, &b, 5, 2, NULL);
    static const size_t admitted[5] = {1, 0, 1, 0, 1};
    static const size_t decoded[5] = {1, 1, 3, 3, 1};
    for (size_t i = 0; i < 5; i++) {
        kvp_step_stats st = step_once(&f);
        assert_int_equal(st.admitted, admitted[i]);
        assert_int_equal(st.decoded, decoded[i]);
    }
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.decoded, 1);
    assert_int_equal(st.finished, 1);
    assert_int_equal(stats_of(&f).peak_running, 3);
    assert_samples_exact(&b, 1, 3, 5, 2);
    teardown_collected(&f, 3);
}


/* Rows for requests of any id (the book holds MAX_REQUESTS): a stream of its own per sample. */
static void stream_input(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                         size_t width)
{
    (void)ctx;
    row_mix(id * SAMPLES + sample, position, row, width);
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

/* A one-token request of `session` (0: none) over stream_input rows; returns its id. */
static uint64_t submit_stream(fixture *f, size_t prompt, uint64_t session)
{
    kvp_request q;
    kvp_request_init(&q);
    q.prompt_tokens = prompt;
    q.max_new_tokens = 1;
    q.input = stream_input;
    q.session = session;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &q, &id, &err), &err);
    return id;
}

/* One step, then collects what finished into done[] (at most 8); returns how many. */
static size_t step_collect(fixture *f, kvp_request_result *done)
{
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_step(f->scheduler, NULL, &err), &err);
    kvpt_assert_pool_ok(f->pool);
    return collect_all(f, done, 8);
}

/*
 * Fairness (issue 16, 5.): a steady stream of session turns cannot starve a
 * plain request. max_running 1 and one-token requests (compute off), so
 * each step admits the head of the queue alone and finishes it; after each
 * step in which a turn finished its session sends the next turn, which goes
 * ahead of the queue as its sequence is kept. The plain request, queued
 * behind the first turn, is overtaken by exactly KVP_SESSION_MAX_OVERTAKES
 * turns and admitted at step 2 + KVP_SESSION_MAX_OVERTAKES, while the
 * stream goes on around it (every later turn a session hit). Before, every
 * turn went to the very front: the plain request waited as long as the
 * stream lasted (here 100 steps, never admitted).
 */
static void test_scheduler_session_stream_cannot_starve(void **state)
{
    (void)state;
    fixture f;
    setup_fixture_full(&f, 64, 1, 0, 1, 1, KVP_SCHEDULE_FCFS, 1000, 1.0);
    (void)submit_stream(&f, 5, 1); /* nothing kept yet: at the back */
    uint64_t plain = submit_stream(&f, 6, 0);
    size_t admitted_at = 0;
    for (size_t step = 1; step <= 100; step++) {
        kvp_request_result done[8];
        size_t n = step_collect(&f, done);
        assert_int_equal(n, 1); /* the head alone, finished in its step */
        if (done[0].id == plain) {
            admitted_at = step;
        }
        kvp_request_state st;
        assert_int_equal(kvp_scheduler_request_state(f.scheduler, plain, &st, NULL),
                         admitted_at != 0 ? KVP_REQUEST_UNKNOWN : KVP_OK);
        if (done[0].id != plain) {
            (void)submit_stream(&f, 5, 1); /* the session's next turn: kept, it goes ahead */
        }
    }
    assert_int_equal(admitted_at, 2 + KVP_SESSION_MAX_OVERTAKES);
    kvp_scheduler_stats s = stats_of(&f);
    assert_int_equal(s.session_hits, 98); /* turns 1 to 98: all but the first admitted */
    assert_int_equal(s.completed, 100);
    run(&f, 1); /* the turn still waiting */
    assert_int_equal(collect_all(&f, NULL, 0), 0);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 1);
    teardown_fixture(&f);
}

/* A request of stream_input rows (compute off tests): returns its id. */
static uint64_t submit_rows(fixture *f, size_t prompt, size_t new_tokens, size_t samples)
{
    return submit_counts(f, prompt, new_tokens, samples, stream_input);
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

/*
 * Page accounting of forked samples over a partial prompt page (issue 16,
 * 5. and 9.): request 0 has 3 samples of a 6-token prompt (1 full block and
 * a partial one) and 2 new tokens. It takes the prompt's 2 blocks once (x 2
 * layers: 4 pages); sample 0 then writes the partial page in place and each
 * other sample copies it (x 2 layers: 4 pages): 8 pages, n - 1 copies for n
 * samples. Beside it, request 1 (3 + 1 tokens) needs 2 pages. With 10
 * pages both are admitted in the first step and fill the pool exactly
 * (counting a copy per sample, 10 + 2, request 1 waited); with 9, request 1 waits (admission
 * counts the promises exactly: counting no copies, 4 + 2, it would be
 * admitted) and runs when request 0 finishes. After the first step (the
 * copies made) nothing is promised; the audit holds after every step.
 * Compute off (external caches), and compute on with 1 and 3 decoder
 * threads, whose 3 samples' first tokens run at once.
 */
static void test_scheduler_forked_samples_count_partial_prompt_page(void **state)
{
    (void)state;
    for (size_t pages = 9; pages <= 10; pages++) {
        for (int mode = 0; mode < 3; mode++) {
            fixture f;
            setup_fixture(&f, pages, mode == 2 ? 3 : 1, mode > 0, 0);
            (void)submit_rows(&f, 6, 2, 3);
            (void)submit_rows(&f, 3, 1, 1);
            kvp_step_stats st = step_once(&f);
            int both = pages == 10;
            assert_int_equal(st.admitted, both ? 2 : 1);
            assert_int_equal(st.rejected, 0);
            assert_int_equal(st.preempted, 0);
            assert_int_equal(st.waiting, both ? 0 : 1);
            assert_int_equal(st.decoded, both ? 4 : 3);
            kvp_pool_stats pool = pool_of(&f);
            /* the full block shared, the partial one and 2 copies, x 2 layers; request 1's 2
               until it finished (its 1 token) */
            assert_int_equal(st.finished, both ? 1 : 0);
            assert_int_equal(pool.held_pages, 8);
            assert_int_equal(pool.high_water_pages, both ? 10 : 8);
            assert_int_equal(pool.promised_pages, 0);
            assert_int_equal(pool.cow_copies, 4);
            assert_int_equal(st.unshared_pages, 12); /* 3 samples x 2 blocks x 2 layers */
            run(&f, 0);
            kvp_request_result done[8];
            assert_int_equal(collect_all(&f, done, 8), 2);
            assert_int_equal(stats_of(&f).preemptions, 0);
            assert_int_equal(stats_of(&f).forks, 2);
            assert_int_equal(pool_of(&f).cow_copies, 4);
            teardown_fixture(&f);
        }
    }
}

/* Updates parameter `index` of layer `layer` in place (its revision + 1). */
static void update_param(kvp_model *model, size_t layer, size_t index)
{
    kvp_error err;
    kvpt_assert_ok(kvp_param_update_with(kvp_model_param_mut(model, layer, index), scale_values,
                                         NULL, &err),
                   &err);
}

/*
 * A kept or leased sequence is stale after an output-projection update
 * (issue 16, 9.): W_o of the last layer changes none of the K/V a sequence
 * holds, but its binding covers it. So a running request is preempted for
 * recompute (a stale preemption) and the kept sequence of a finished turn
 * is given back as stale (a drop), its blocks no longer adoptable; the
 * recomputed request then finishes. Checking only W_q, W_k and W_v, or
 * only layer 0, would keep both.
 */
static void test_scheduler_output_projection_update_is_stale(void **state)
{
    (void)state;
    fixture f;
    static book b;
    start_conversation(&f, &b);
    assert_sessions(&f, 1, 0, 0, 1, TURN1_PAGES);
    uint64_t other = submit(&f, &b, 5, 6, NULL);
    kvp_step_stats st = step_once(&f);
    assert_int_equal(st.admitted, 1);
    update_param(f.model, LAYERS - 1, KVP_PARAM_OUTPUT);
    st = step_once(&f);
    assert_int_equal(st.stale_preempted, 1);
    assert_int_equal(st.preempted, 1);
    assert_int_equal(st.decoded, 0);
    assert_int_equal(st.retained_pages, 0);
    assert_sessions(&f, 1, 0, 1, 0, 0);
    assert_int_equal(stats_of(&f).stale_preemptions, 1);
    run(&f, 0);
    assert_int_equal(b.tokens[other][0], 6);
    kvp_request_result done[8];
    assert_int_equal(collect_all(&f, done, 8), 2);
    assert_int_equal(done[1].id, other);
    assert_int_equal(done[1].preemptions, 1);
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
        cmocka_unit_test(test_scheduler_samples_exact_with_and_without_sharing),
        cmocka_unit_test(test_scheduler_sharing_holds_fewer_pages),
        cmocka_unit_test(test_scheduler_admission_counts_adopted_pages_once),
        cmocka_unit_test(test_scheduler_shared_prefixes_hit_the_index),
        cmocka_unit_test(test_scheduler_weight_update_recomputes),
        cmocka_unit_test(test_scheduler_compute_off_shares_alike),
        cmocka_unit_test(test_scheduler_publishes_decoded_blocks),
        cmocka_unit_test(test_scheduler_publication_keys_its_own_partial_block),
        cmocka_unit_test(test_scheduler_publishes_each_samples_decoded_blocks),
        cmocka_unit_test(test_scheduler_cache_aware_admits_cached_prefix_first),
        cmocka_unit_test(test_scheduler_session_keeps_turn_across_pressure),
        cmocka_unit_test(test_scheduler_session_request_goes_first),
        cmocka_unit_test(test_scheduler_session_expires_after_ttl),
        cmocka_unit_test(test_scheduler_session_largest_ttl_never_expires),
        cmocka_unit_test(test_scheduler_session_replaced_by_same_session),
        cmocka_unit_test(test_scheduler_session_fraction_caps_kept_pages),
        cmocka_unit_test(test_scheduler_session_given_back_before_preemption),
        cmocka_unit_test(test_scheduler_session_stale_given_back),
        cmocka_unit_test(test_scheduler_session_stale_is_no_hit),
        cmocka_unit_test(test_scheduler_sessions_random_conversations),
        cmocka_unit_test(test_scheduler_session_stall_gives_back),
        cmocka_unit_test(test_scheduler_records_recycled),
        cmocka_unit_test(test_scheduler_session_stream_cannot_starve),
        cmocka_unit_test(test_scheduler_admission_counts_evictable_pages),
        cmocka_unit_test(test_scheduler_forked_samples_count_partial_prompt_page),
        cmocka_unit_test(test_scheduler_output_projection_update_is_stale),
        cmocka_unit_test(test_scheduler_collect_before_anything_finished),
        cmocka_unit_test(test_scheduler_allocator_only_with_nothing_to_key),
        cmocka_unit_test(test_scheduler_kept_sessions_count_shared_pages_once),
        cmocka_unit_test(test_scheduler_failed_step_keeps_stale_idle_leases),
        cmocka_unit_test(test_scheduler_more_samples_than_max_running_run_alone),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
