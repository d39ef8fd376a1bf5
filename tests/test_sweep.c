/*
 * test_sweep.c: the allocation-failure sweep over a whole serving scenario,
 * and the thread-start sweep of the decoder.
 *
 * The scenario: pool -> layer -> model (two layers sharing the layer's
 * parameters) -> two sequences -> decoder (2 threads) -> prefill of both ->
 * 20 decoder steps over the 2 sequences -> reset -> destroy everything.
 * The sweep runs it once for N = 1, 2, ... with the Nth hooked allocation
 * (pager/alloc.h) made to fail, until a run completes with the fault never
 * firing. At the failing call it asserts AllocationFailed (status and
 * err.status), the out-parameter still holding its sentinel, and through a
 * kvpt_snapshot of everything made so far: the same pool stats (high water
 * included), slab and cache digests, and a passing audit. It then tears the
 * partial scenario down; the memcheck run of this program (ctest) proves
 * that nothing leaked, and every completed run's outputs must equal a
 * fault-free run's bit for bit.
 *
 * The thread sweep fails the kth worker-thread start (serve/decoder_internal.h)
 * for every k: ThreadFailed naming thread k-1 of threads-1, the out-parameter
 * untouched, the k-1 started workers stopped and joined (memcheck and
 * helgrind see no leak or race), and the scenario's state unchanged.
 *
 * Unit test: uses pager/alloc.h and serve/decoder_internal.h.
 */
#include "support.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/alloc.h"
#include "serve/decoder_internal.h"

enum { D = 8, HEADS = 2, HD = 4, BT = 4, LAYERS = 2, B = 2, C = 32, PROMPT = 5, STEPS = 20 };
enum { PAGES = 64, THREADS = 2, SEQS = 2 };

#define BASE 10000.0
#define SWEEP_LIMIT 200
#define SENTINEL ((void *)0x5A5A)

/* Everything the scenario makes, and where it got to. */
typedef struct scenario {
    kvp_pool *pool;
    kvp_layer *layer;
    kvp_model *model;
    kvp_sequence *seqs[SEQS];
    kvp_decoder *decoder;
    size_t threads;
    double outputs[SEQS][STEPS][B * D]; /* each step's output, for the fault-free comparison */
    double prefill_out[SEQS][B * PROMPT * D];
} scenario;

/* The snapshot of every object made so far. */
static void watch(const scenario *s, kvpt_snapshot *snap)
{
    kvpt_snapshot_init(snap, s->pool);
    for (size_t i = 0; i < SEQS; i++) {
        if (s->seqs[i] != NULL) {
            kvpt_snapshot_add_sequence(snap, s->seqs[i]);
        }
    }
    if (s->layer != NULL) {
        for (size_t p = 0; p < KVP_PARAM_COUNT; p++) {
            kvpt_snapshot_add_param(snap, kvp_layer_param(s->layer, p));
        }
    }
    kvpt_snapshot_take(snap);
}

static void teardown(scenario *s)
{
    kvp_error err;
    if (s->decoder != NULL) {
        kvpt_assert_ok(kvp_decoder_destroy(s->decoder, &err), &err);
    }
    for (size_t i = SEQS; i-- > 0;) {
        if (s->seqs[i] != NULL) {
            kvpt_destroy_sequence(s->seqs[i], s->pool);
        }
    }
    if (s->model != NULL) {
        kvpt_destroy_model(s->model);
    }
    if (s->layer != NULL) {
        kvpt_destroy_layer(s->layer);
    }
    if (s->pool != NULL) {
        kvpt_destroy_pool(s->pool);
    }
}

/*
 * A failing creation: `expected` in the status and in err, the out-parameter
 * untouched, and every object made before unchanged (snapshot `before`).
 */
static void check_failure(kvp_status status, const kvp_error *err, kvp_status expected,
                          void *out, const kvpt_snapshot *before)
{
    assert_int_equal(status, expected);
    assert_int_equal(err->status, expected);
    assert_ptr_equal(out, SENTINEL);
    kvpt_assert_unchanged(before, 0);
}

/*
 * Runs the scenario; with a fault armed, stops at the first failing call
 * after checking it, tears down what was made and returns its status.
 * `expected` is the status a failure must have.
 */
static kvp_status run(scenario *s, size_t threads, kvp_status expected)
{
    memset(s, 0, sizeof *s);
    s->threads = threads;
    kvp_error err;
    kvpt_snapshot before;
    kvp_status status;

#define CREATE(type, out_field, call)                                            \
    do {                                                                         \
        watch(s, &before);                                                       \
        type *out_ = (type *)SENTINEL;                                           \
        memset(&err, 0x5A, sizeof err);                                          \
        status = (call);                                                         \
        if (status != KVP_OK) {                                                  \
            check_failure(status, &err, expected, (void *)out_, &before);        \
            teardown(s);                                                         \
            return status;                                                       \
        }                                                                        \
        assert_ptr_not_equal(out_, SENTINEL);                                    \
        (out_field) = out_;                                                      \
    } while (0)

    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = HEADS;
    config.head_width = HD;
    config.budget_bytes = PAGES * 2 * HEADS * BT * HD * sizeof(double);
    config.dtype = KVP_F64;
    CREATE(kvp_pool, s->pool, kvp_pool_create(&config, &out_, &err));
    CREATE(kvp_layer, s->layer, kvp_layer_create_random(D, HEADS, C, BASE, 77, &out_, &err));
    const kvp_layer *layers[LAYERS] = {s->layer, s->layer};
    CREATE(kvp_model, s->model, kvp_model_create(layers, LAYERS, &out_, &err));
    for (size_t i = 0; i < SEQS; i++) {
        CREATE(kvp_sequence, s->seqs[i], kvp_sequence_create(s->model, s->pool, B, C, &out_, &err));
    }
    CREATE(kvp_decoder, s->decoder, kvp_decoder_create(threads, &out_, &err));
#undef CREATE

    /* From here on nothing allocates: the armed fault can no longer fire. */
    uint64_t calls = kvpi_fault_calls();
    for (size_t i = 0; i < SEQS; i++) {
        double prompt[B * PROMPT * D];
        kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 100 + i);
        kvp_tensor view = kvp_tensor3(prompt, B, PROMPT, D);
        kvpt_assert_ok(kvp_sequence_prefill(s->seqs[i], &view, NULL, NULL, s->prefill_out[i],
                                            B * PROMPT * D, &err),
                       &err);
        kvpt_assert_pool_ok(s->pool);
    }
    double inputs[SEQS][B * D];
    for (size_t i = 0; i < SEQS; i++) {
        kvpt_fill_random(inputs[i], B * D, 200 + i);
    }
    for (size_t step = 0; step < STEPS; step++) {
        kvp_decode_job jobs[SEQS];
        memset(jobs, 0, sizeof jobs);
        for (size_t i = 0; i < SEQS; i++) {
            jobs[i].sequence = s->seqs[i];
            jobs[i].input = kvp_tensor3(inputs[i], B, 1, D);
            jobs[i].output = s->outputs[i][step];
            jobs[i].output_len = B * D;
        }
        kvpt_assert_ok(kvp_decoder_step(s->decoder, jobs, SEQS, NULL, NULL, &err), &err);
        for (size_t i = 0; i < SEQS; i++) {
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            /* The next input is this output, scaled back into range. */
            for (size_t k = 0; k < B * D; k++) {
                inputs[i][k] = 0.25 * s->outputs[i][step][k];
            }
        }
        kvpt_assert_pool_ok(s->pool);
    }
    for (size_t i = 0; i < SEQS; i++) {
        assert_int_equal(kvp_sequence_len(s->seqs[i]), PROMPT + STEPS);
        kvpt_assert_ok(kvp_sequence_reset(s->seqs[i], &err), &err);
        assert_int_equal(kvp_sequence_len(s->seqs[i]), 0);
    }
    kvp_pool_stats stats = kvpt_stats(s->pool);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.high_water_pages, SEQS * LAYERS * B * KVPT_CEIL_DIV(PROMPT + STEPS, BT));
    assert_int_equal(kvpi_fault_calls(), calls);
    teardown(s);
    return KVP_OK;
}

/* The same outputs, bit for bit, as the fault-free run. */
static void assert_same_outputs(const scenario *a, const scenario *b)
{
    assert_memory_equal(a->outputs, b->outputs, sizeof a->outputs);
    assert_memory_equal(a->prefill_out, b->prefill_out, sizeof a->prefill_out);
}

static void test_sweep_every_allocation_of_the_scenario(void **state)
{
    (void)state;
    scenario *clean = calloc(1, sizeof *clean);
    scenario *s = calloc(1, sizeof *s);
    assert_non_null(clean);
    assert_non_null(s);
    kvpi_fault_arm(0);
    kvpt_assert_ok(run(clean, THREADS, KVP_OK), NULL);
    uint64_t allocations = kvpi_fault_calls();
    uint64_t failures = 0;
    int sites_seen[KVPI_SITE_COUNT_] = {0};
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvpi_fault_arm(nth);
        kvp_status status = run(s, THREADS, KVP_ALLOCATION_FAILED);
        int fired = kvpi_fault_fired();
        kvpi_fault_site site = kvpi_fault_last_site();
        kvpi_fault_arm(0);
        if (!fired) {
            kvpt_assert_ok(status, NULL);
            assert_same_outputs(clean, s);
            break;
        }
        assert_int_equal(status, KVP_ALLOCATION_FAILED);
        assert_true((unsigned)site < (unsigned)KVPI_SITE_COUNT_);
        sites_seen[site] = 1;
        failures++;
    }
    /* Every allocation of the fault-free run failed once, and no other. */
    assert_int_equal(failures, allocations);
    const kvpi_fault_site expected_sites[] = {
        KVPI_SITE_POOL_STRUCT, KVPI_SITE_POOL_METADATA, KVPI_SITE_POOL_SLAB, KVPI_SITE_PARAM,
        KVPI_SITE_LAYER,       KVPI_SITE_MODEL,         KVPI_SITE_CACHE_STRUCT,
        KVPI_SITE_CACHE_TABLES, KVPI_SITE_SEQUENCE,     KVPI_SITE_TICKET, KVPI_SITE_SCRATCH,
    };
    for (size_t i = 0; i < KVPT_COUNT_OF(expected_sites); i++) {
        assert_true(sites_seen[expected_sites[i]]);
    }
    free(s);
    free(clean);
}

static void test_sweep_every_thread_start(void **state)
{
    (void)state;
    enum { MANY = 4 };
    scenario *clean = calloc(1, sizeof *clean);
    scenario *s = calloc(1, sizeof *s);
    assert_non_null(clean);
    assert_non_null(s);
    kvpt_assert_ok(run(clean, MANY, KVP_OK), NULL);

    /* The decoder alone: thread k fails, the k - 1 before it are joined. */
    for (uint64_t k = 1; k < MANY; k++) {
        kvp_decoder *decoder = SENTINEL;
        kvp_error err;
        memset(&err, 0x5A, sizeof err);
        kvpi_thread_fault_arm(k);
        kvp_status status = kvp_decoder_create(MANY, &decoder, &err);
        assert_true(kvpi_thread_fault_fired());
        assert_int_equal(kvpi_thread_fault_calls(), k);
        kvpi_thread_fault_arm(0);
        assert_int_equal(status, KVP_THREAD_FAILED);
        assert_int_equal(err.status, KVP_THREAD_FAILED);
        assert_int_equal(err.index, k - 1);
        assert_int_equal(err.limit, MANY - 1);
        assert_ptr_equal(decoder, SENTINEL);
        char text[96];
        snprintf(text, sizeof text, "cannot start decoder worker thread %u of %u",
                 (unsigned)(k - 1), (unsigned)(MANY - 1));
        kvpt_assert_error_text(&err, text);
    }
    /* Armed past the last start: nothing fires, all MANY - 1 workers start. */
    kvpi_thread_fault_arm(MANY);
    kvp_decoder *decoder = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_create(MANY, &decoder, &err), &err);
    assert_false(kvpi_thread_fault_fired());
    assert_int_equal(kvpi_thread_fault_calls(), MANY - 1);
    kvpi_thread_fault_arm(0);
    assert_int_equal(kvp_decoder_threads(decoder), MANY);
    kvpt_assert_ok(kvp_decoder_destroy(decoder, &err), &err);

    /* In the scenario: every k stops it at the decoder with the world unchanged. */
    for (uint64_t k = 1; k < MANY; k++) {
        kvpi_thread_fault_arm(k);
        assert_int_equal(run(s, MANY, KVP_THREAD_FAILED), KVP_THREAD_FAILED);
        assert_true(kvpi_thread_fault_fired());
        kvpi_thread_fault_arm(0);
    }
    /* The allocation injector never counted a thread start. */
    kvpi_fault_arm(0);
    kvpi_thread_fault_arm(0);
    kvpt_assert_ok(run(s, MANY, KVP_OK), NULL);
    assert_int_equal(kvpi_thread_fault_calls(), MANY - 1);
    assert_same_outputs(clean, s);
    free(s);
    free(clean);
}

static int disarm_both(void **state)
{
    kvpi_thread_fault_arm(0);
    return kvpt_disarm(state);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sweep_every_allocation_of_the_scenario, disarm_both),
        cmocka_unit_test_teardown(test_sweep_every_thread_start, disarm_both),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
