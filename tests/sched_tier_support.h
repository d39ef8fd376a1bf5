/*
 * sched_tier_support.h: the scheduler-over-a-tier fixture that
 * test_scheduler_tier.c, test_tier_faults.c and test_scheduler_prefetch.c
 * share: a computed model (LAYERS x WIDTH, grouped heads), a pool of PAGES
 * pages whose key secret is fixed (pools sharing a tier agree on keys), a
 * one-thread decoder and a scheduler with the tier attached under a test
 * secret; requests of PROMPT rows whose first `shared` rows are their
 * group's, outputs recorded in a book and compared bit for bit; stepping
 * with the full pool audit after every step. The geometry, the fixture
 * struct, the base scheduler config and stats_of come from
 * sched_fixture.h (test_scheduler*.c's fixture shares them). Static
 * inline; tests only.
 */
#ifndef KVPAGER_TESTS_SCHED_TIER_SUPPORT_H
#define KVPAGER_TESTS_SCHED_TIER_SUPPORT_H

#include "sched_fixture.h" /* geometry, fixture, base config, stats_of */

#include <string.h>
#include <time.h>

#include "kvpager/tier.h"

#define SEED 11
#define MAX_REQUESTS 8
#define PROMPT 33 /* 8 full blocks adoptable: (33 - 1) / 4 */
#define NEW_TOKENS 3
#define PAGES 24

/* Request i's prompt: its first shared[i] rows are group[i]'s, the rest its own. */
typedef struct book {
    double outputs[MAX_REQUESTS][CAPACITY][WIDTH];
    size_t tokens[MAX_REQUESTS];
    size_t shared[MAX_REQUESTS];
    unsigned group[MAX_REQUESTS];
} book;

static inline void row_mix(uint64_t key, size_t position, double *row)
{
    for (size_t i = 0; i < WIDTH; i++) {
        unsigned v = (unsigned)((key * 131u + position * 31u + i * 7u) % 97u);
        row[i] = (double)v / 48.5 - 1.0;
    }
}

static inline void input_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                            double *row, size_t width)
{
    const book *b = ctx;
    assert_int_equal(width, WIDTH);
    assert_int_equal(sample, 0);
    row_mix(position < b->shared[id] ? 1000 + b->group[id] : id, position, row);
}

static inline void token_cb(void *ctx, uint64_t id, size_t sample, size_t position,
                            const double *output, size_t width)
{
    book *b = ctx;
    assert_int_equal(sample, 0);
    assert_true(id < MAX_REQUESTS && position < CAPACITY);
    memcpy(b->outputs[id][position], output, width * sizeof *output);
    b->tokens[id]++;
}

static inline void sched_secret_fill(unsigned char *secret, unsigned char seed)
{
    for (size_t i = 0; i < KVP_TIER_SECRET_BYTES; i++) {
        secret[i] = (unsigned char)(seed + 7 * i);
    }
}

/* A pool whose key secret is fixed (pools sharing a tier must agree on keys). */
static inline kvp_pool *shared_key_pool(size_t kv_heads, size_t head_width)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BLOCK;
    config.heads = kv_heads;
    config.head_width = head_width;
    config.budget_bytes = (size_t)PAGES * 2 * kv_heads * BLOCK * head_width * sizeof(double);
    for (size_t i = 0; i < KVP_KEY_SECRET_BYTES / sizeof(uint64_t); i++) {
        config.key_secret[i] = 0x9e3779b97f4a7c15ull * (i + 1);
    }
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    return pool;
}

/*
 * kv_heads 1: the test's geometry (1 KV head of 4); 2: another one whose
 * pages have the same bytes (4 heads, 2 KV heads of 2), so its blocks pass
 * the size check and fail the geometry check.
 */
static inline size_t head_width_of(size_t kv_heads)
{
    return kv_heads == 1 ? WIDTH / HEADS : WIDTH / 4;
}

static inline kvp_model *model_of(size_t kv_heads, uint64_t seed)
{
    kvp_model *m = NULL;
    kvp_error err;
    size_t heads = WIDTH / head_width_of(kv_heads);
    kvpt_assert_ok(kvp_model_create_random_grouped(LAYERS, WIDTH, heads, kv_heads, CAPACITY,
                                                   10000.0, seed, &m, &err),
                   &err);
    return m;
}

/*
 * One model for every fixture of a test group: its parameters' node
 * identities are in every binding digest, so schedulers that share a tier
 * serve one model (as two processes that load the same weights do).
 */
static kvp_model *model;

static inline int model_setup(void **state)
{
    (void)state;
    model = model_of(1, SEED);
    return 0;
}

static inline int model_teardown(void **state)
{
    (void)state;
    kvpt_assert_ok(kvp_model_destroy(model, NULL), NULL);
    model = NULL;
    return 0;
}

/* tier: NULL for none; else attached under secret `secret`, write_through as given. */
static inline void setup_with(fixture *f, kvp_model *m, size_t kv_heads, kvp_tier *tier,
                              unsigned char secret, int write_through, kvp_tier_loads loads)
{
    memset(f, 0, sizeof *f);
    kvp_error err;
    f->model = m;
    f->pool = shared_key_pool(kv_heads, head_width_of(kv_heads));
    f->decoder = kvpt_decoder(1);
    if (tier != NULL) {
        kvp_tier_policy policy;
        kvp_tier_policy_init(&policy);
        sched_secret_fill(policy.secret, secret);
        policy.write_through = write_through;
        kvpt_assert_ok(kvp_pool_tier_attach(f->pool, tier, &policy, &err), &err);
    }
    kvp_scheduler_config config;
    sched_fixture_config(&config, SEED);
    config.tier_loads = loads;
    kvpt_assert_ok(kvp_scheduler_create(f->model, f->pool, f->decoder, &config, &f->scheduler,
                                        &err),
                   &err);
}

static inline void teardown(fixture *f)
{
    kvpt_assert_ok(kvp_scheduler_destroy(f->scheduler, NULL), NULL);
    kvpt_assert_pool_ok(f->pool);
    kvpt_destroy_decoder(f->decoder);
    kvpt_assert_ok(kvp_pool_destroy(f->pool, NULL), NULL); /* detaches the tier */
}

static inline double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/*
 * Submits request `id` (asserted to be the id the scheduler gives): a prompt
 * of `prompt` rows whose first `shared` are prefix group `group`'s, then
 * `new_tokens` tokens; `outputs` 0 (an allocator-only scheduler): no on_token.
 */
static inline void submit_len(fixture *f, book *b, uint64_t id, unsigned group, size_t shared,
                              size_t prompt, size_t new_tokens, int outputs)
{
    b->shared[id] = shared;
    b->group[id] = group;
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = prompt;
    request.max_new_tokens = new_tokens;
    request.input = input_cb;
    request.on_token = outputs ? token_cb : NULL;
    request.ctx = b;
    uint64_t got = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(f->scheduler, &request, &got, &err), &err);
    assert_int_equal(got, id);
}

/* submit_len of the default shape: PROMPT rows, NEW_TOKENS tokens, outputs recorded. */
static inline void submit(fixture *f, book *b, uint64_t id, unsigned group, size_t shared)
{
    submit_len(f, b, id, group, shared, PROMPT, NEW_TOKENS, 1);
}

/* One step, audited; returns its wall time in ms. */
static inline double step(fixture *f)
{
    kvp_error err;
    double t0 = now_ms();
    kvpt_assert_ok(kvp_scheduler_step(f->scheduler, NULL, &err), &err);
    double ms = now_ms() - t0;
    kvpt_assert_pool_ok(f->pool); /* the full audit after every step */
    return ms;
}

/* Steps until idle, then collects request `id`: it succeeded. Returns the longest step (ms). */
static inline double finish(fixture *f, book *b, uint64_t id)
{
    double longest = 0.0;
    for (size_t steps = 0;; steps++) {
        kvp_scheduler_stats s = stats_of(f);
        if (s.running == 0 && s.waiting == 0) {
            break;
        }
        assert_true(steps < 1000);
        double ms = step(f);
        longest = ms > longest ? ms : longest;
    }
    kvp_request_result result;
    kvp_request_result_init(&result);
    size_t n = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_collect(f->scheduler, &result, 1, &n, &err), &err);
    assert_int_equal(n, 1);
    assert_int_equal(result.id, id);
    assert_int_equal(result.status, KVP_OK); /* no request fails */
    assert_int_equal(b->tokens[id], NEW_TOKENS);
    return longest;
}

static inline double serve(fixture *f, book *b, uint64_t id, unsigned group, size_t shared)
{
    submit(f, b, id, group, shared);
    return finish(f, b, id);
}

static inline void assert_outputs_equal(const book *a, const book *b, size_t requests)
{
    for (size_t id = 0; id < requests; id++) {
        assert_int_equal(a->tokens[id], b->tokens[id]);
        /* bit for bit: a loaded block is the published one, a rejected one is computed */
        assert_memory_equal(a->outputs[id], b->outputs[id], sizeof a->outputs[id]);
    }
}

#endif
