/*
 * sched_support.h: the fixture of test_scheduler.c, test_scheduler_sharing.c
 * and test_scheduler_sessions.c (the scheduler through its public API):
 *   - a book of request rows and recorded outputs: request id's first
 *     shared[id] rows are its prefix group's, its other prompt rows its own,
 *     and from prompt[id] on each of SAMPLES samples has rows of its own;
 *     token_cb records every decoded token once (recomputation included);
 *   - fixtures over a model seeded SEED (or none: compute off with
 *     fixture_without_model), a pool of `pages` pages, a decoder of
 *     `threads` threads, and the scheduler's knobs (max_running, sharing,
 *     schedule, sessions); teardown_fixture checks every page came back and
 *     audits the pool;
 *   - run() steps until idle with kvp_pool_check after every step, and
 *     assert_*_exact compare decoded outputs bit for bit against a fresh
 *     sequence fed the same rows alone;
 *   - the session helpers (a first turn, a conversation's book) and the
 *     row-less submits the split files share.
 * The geometry, the fixture struct, the base scheduler config and stats_of
 * come from sched_fixture.h (sched_tier_support.h shares them). Static
 * inline; tests only.
 */
#ifndef KVPAGER_TESTS_SCHED_SUPPORT_H
#define KVPAGER_TESTS_SCHED_SUPPORT_H

#include "sched_fixture.h" /* geometry, fixture, base config, stats_of */

#include <math.h>
#include <string.h>

#include "pager/alloc.h"

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

static inline void row_mix(uint64_t key, size_t position, double *row, size_t width)
{
    for (size_t i = 0; i < width; i++) {
        /* Deterministic, distinct per (key, position, i), within [-1, 1]. */
        unsigned v = (unsigned)((key * 131u + position * 31u + i * 7u) % 97u);
        row[i] = (double)v / 48.5 - 1.0;
    }
}

/* The row of (id, sample, position); prompt rows do not depend on the sample. */
static inline void row_at(const book *b, uint64_t id, size_t sample, size_t position, double *row)
{
    if (position < b->shared[id]) {
        row_mix(1000 + b->group[id], position, row, WIDTH);
    } else if (position < b->prompt[id] || sample == 0) {
        row_mix(id, position, row, WIDTH);
    } else {
        row_mix(id + 7919u * sample, position, row, WIDTH);
    }
}

static inline void input_cb(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
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

static inline void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
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

static inline kvp_model *make_model(void)
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

static inline void setup_fixture_full(fixture *f, size_t pages, size_t threads, int compute,
                                      size_t max_running, int sharing, kvp_schedule schedule,
                                      size_t session_ttl, double session_fraction)
{
    memset(f, 0, sizeof *f);
    f->model = compute || !fixture_without_model ? make_model() : NULL;
    f->pool = kvpt_pool(BLOCK, KV_HEADS, HEAD_WIDTH, pages);
    f->decoder = compute ? kvpt_decoder(threads) : NULL;
    kvp_scheduler_config config;
    sched_fixture_config(&config, SEED);
    config.compute = compute;
    config.max_running = max_running;
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

static inline void setup_fixture_schedule(fixture *f, size_t pages, size_t threads, int compute,
                                          size_t max_running, int sharing, kvp_schedule schedule)
{
    setup_fixture_full(f, pages, threads, compute, max_running, sharing, schedule, 0, 0.5);
}

/* Sharing on, FCFS, 1 decoder thread, sessions kept `ttl` steps within `fraction` of the pool. */
static inline void setup_fixture_sessions(fixture *f, size_t pages, size_t ttl, double fraction)
{
    setup_fixture_full(f, pages, 1, 1, 0, 1, KVP_SCHEDULE_FCFS, ttl, fraction);
}

static inline void setup_fixture_sharing(fixture *f, size_t pages, size_t threads, int compute,
                                         size_t max_running, int sharing)
{
    setup_fixture_schedule(f, pages, threads, compute, max_running, sharing,
                           KVP_SCHEDULE_FCFS);
}

static inline void setup_fixture(fixture *f, size_t pages, size_t threads, int compute,
                                 size_t max_running)
{
    setup_fixture_sharing(f, pages, threads, compute, max_running, 1);
}

static inline void teardown_fixture(fixture *f)
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

static inline void digest_cb(void *ctx, uint64_t id, size_t sample, size_t block,
                             kvp_block_key *digest)
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

static inline uint64_t submit_session(fixture *f, book *b, size_t prompt, size_t new_tokens,
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

static inline uint64_t submit_samples(fixture *f, book *b, size_t prompt, size_t new_tokens,
                                      const double *rows, size_t samples)
{
    return submit_session(f, b, prompt, new_tokens, rows, samples, 0);
}

static inline uint64_t submit(fixture *f, book *b, size_t prompt, size_t new_tokens,
                              const double *rows)
{
    return submit_samples(f, b, prompt, new_tokens, rows, 1);
}

/* Steps until nothing runs or waits, auditing the pool after every step; returns the steps. */
static inline size_t run(fixture *f, size_t max_running)
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
static inline void scale_values(void *ctx, double *values, size_t width)
{
    (void)ctx;
    (void)width;
    values[0] = values[0] * 0.5 + 0.25;
    values[1] = -values[1];
}

/* Updates every parameter of every layer once (each revision + 1). */
static inline void update_weights(kvp_model *model)
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
static inline void assert_sample_exact_range(const book *b, size_t id, size_t sample,
                                             size_t prompt, size_t new_tokens, size_t from,
                                             size_t to, size_t updates)
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
static inline void assert_samples_exact(const book *b, size_t id, size_t samples, size_t prompt,
                                        size_t new_tokens)
{
    for (size_t k = 0; k < samples; k++) {
        assert_sample_exact_range(b, id, k, prompt, new_tokens, 0, CAPACITY, 0);
    }
}

/* Each decoded token's output against a fresh sequence fed the same rows, alone. */
static inline void assert_outputs_exact(const book *b, size_t id, size_t prompt, size_t new_tokens)
{
    assert_samples_exact(b, id, 1, prompt, new_tokens);
}

static inline size_t collect_all(fixture *f, kvp_request_result *out, size_t cap)
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
static inline void teardown_collected(fixture *f, size_t n)
{
    kvp_request_result done[MAX_REQUESTS];
    assert_true(n <= sizeof done / sizeof done[0]);
    assert_int_equal(collect_all(f, done, sizeof done / sizeof done[0]), n);
    teardown_fixture(f);
}

/* One step that admits the waiting head: its step stats. */
static inline kvp_step_stats step_once(fixture *f)
{
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_step(f->scheduler, &st, &err), &err);
    kvpt_assert_pool_ok(f->pool);
    return st;
}

/* The pool's counters now. */
static inline kvp_pool_stats pool_of(const fixture *f)
{
    kvp_pool_stats pool;
    kvp_pool_stats_init(&pool);
    kvpt_assert_ok(kvp_pool_stats_get(f->pool, &pool, NULL), NULL);
    return pool;
}

/* The scheduler's session counters, against what the test expects. */
static inline void assert_sessions(const fixture *f, uint64_t keeps, uint64_t hits, uint64_t drops,
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
static inline void book_conversation(book *b, const uint64_t *ids, size_t n, uint64_t group)
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
 * Runs turn 1 of session 1 to completion in `f` (kept: sessions on, 24
 * pages, fraction 0.5): the step it finished in.
 */
static inline kvp_step_stats run_turn1(fixture *f, book *b)
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
static inline void start_conversation(fixture *f, book *b)
{
    setup_fixture_sessions(f, 24, 100, 0.5);
    run_turn1(f, b);
}

/*
 * Submits a request of `prompt` tokens, no prompt rows, and `input` for its
 * rows (NULL: no rows at all, compute off only); returns its id.
 */
static inline uint64_t submit_counts(fixture *f, size_t prompt, size_t new_tokens, size_t samples,
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

/* Rows for requests of any id (the book holds MAX_REQUESTS): a stream of its own per sample. */
static inline void stream_input(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                                size_t width)
{
    (void)ctx;
    row_mix(id * SAMPLES + sample, position, row, width);
}

/* A request of stream_input rows (compute off tests): returns its id. */
static inline uint64_t submit_rows(fixture *f, size_t prompt, size_t new_tokens, size_t samples)
{
    return submit_counts(f, prompt, new_tokens, samples, stream_input);
}

#endif
