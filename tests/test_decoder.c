/*
 * test_decoder.c: batched decoding across threads — decoders of 1, 2 and 4
 * threads (and 0: one per online core) stepping nine sequences of different
 * batch sizes, lengths and inputs give outputs and cache rows bit-identical
 * to stepping a twin set one by one with kvp_sequence_step, over several
 * batches, with the residual stream and a custom next-input function (and,
 * with one thread, the very same physical pages); each job reports its own
 * status (pool exhaustion, an input error, a small output buffer) while the
 * others succeed and the failed ones change nothing; two jobs naming one
 * sequence, or a NULL one, or an unknown job kind, are refused before
 * anything runs; an empty batch is fine; prefill jobs mixed with step jobs
 * match kvp_sequence_prefill / kvp_sequence_step run one by one (1 and 2
 * threads), and a failing prefill job (NaN at token 2) reports its error and
 * changes nothing while the others succeed; a second caller while a step
 * runs (another thread, or the step's own next_input callback) is refused
 * with DecoderBusy and changes nothing; an allocation fault sweep over
 * decoder creation. kvp_pool_check
 * runs after every batch. Unit test: public API plus the allocator-only
 * append (serve/sequence_internal.h) and the fault injector
 * (pager/alloc.h).
 */
#include "support.h"

#include <math.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

#include "serve/sequence_internal.h"
#include "pager/alloc.h"
#include "serve/decoder_internal.h"

#define MODEL_WIDTH 8
#define HEADS 2
#define HEAD_WIDTH 4
#define MAX_POSITIONS 32
#define ROPE_BASE 10000.0
#define LAYERS 2
#define BLOCK_TOKENS 3

/* Nine sequences: batch 1 + i % 2, i tokens already in, capacity CAPACITY. */
#define SEQUENCES 9
#define MAX_BATCH 2
#define CAPACITY 16
#define STEPS 5

/* Every sequence of the set at full capacity, and some to spare. */
#define POOL_PAGES (SEQUENCES * LAYERS * MAX_BATCH * KVPT_CEIL_DIV(CAPACITY, BLOCK_TOKENS) + 4)

/* Stops a fault sweep at a generous bound, so a broken injector cannot loop. */
#define SWEEP_LIMIT 16

static kvp_model *make_model(uint64_t seed)
{
    return kvpt_random_model(LAYERS, MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, seed);
}

/* A custom stream, pure so that worker threads may share it: next = 0.5 * input + output. */
static void half_residual(void *ctx, size_t layer, const double *input, const double *output,
                          size_t elements, double *next)
{
    (void)ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = 0.5 * input[i] + output[i];
    }
}

/* Every layer's cache digest of a sequence. */
static void digests_of(const kvp_sequence *seq, uint64_t *out)
{
    kvp_error err;
    for (size_t l = 0; l < LAYERS; l++) {
        kvpt_assert_ok(kvp_cache_digest(kvp_sequence_cache(seq, l), &out[l], &err), &err);
    }
}

/* Both sequences map the same physical page at every layer, lane and block. */
static void assert_same_pages(const kvp_sequence *a, const kvp_sequence *b)
{
    kvp_error err;
    for (size_t l = 0; l < LAYERS; l++) {
        const kvp_cache *ca = kvp_sequence_cache(a, l);
        const kvp_cache *cb = kvp_sequence_cache(b, l);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(ca, &info, &err), &err);
        for (size_t lane = 0; lane < info.batch_size; lane++) {
            for (size_t block = 0; block < KVPT_CEIL_DIV(info.len, BLOCK_TOKENS); block++) {
                uint32_t pa = 0;
                uint32_t pb = 1;
                kvpt_assert_ok(kvp_cache_page(ca, lane, block, &pa, &err), &err);
                kvpt_assert_ok(kvp_cache_page(cb, lane, block, &pb, &err), &err);
                assert_int_equal(pa, pb);
            }
        }
    }
}

/*
 * The end of a twin comparison: each sequence the decoder ran holds the same
 * rows as its twin run call by call (with one thread, which runs the jobs in
 * order, the very same physical pages), and both pools counted the same page
 * operations. Then everything is destroyed.
 */
static void finish_twins(kvp_decoder *decoder, kvp_model *model, kvp_pool *pool,
                         kvp_pool *twin_pool, kvp_sequence **seqs, kvp_sequence **twins,
                         size_t count, size_t threads)
{
    for (size_t i = 0; i < count; i++) {
        kvpt_assert_same_rows(seqs[i], twins[i]);
        if (threads == 1) {
            assert_same_pages(seqs[i], twins[i]);
        }
    }
    kvp_pool_stats stats = kvpt_stats(pool);
    kvp_pool_stats twin_stats = kvpt_stats(twin_pool);
    assert_int_equal(stats.held_pages, twin_stats.held_pages);
    assert_int_equal(stats.acquires, twin_stats.acquires);
    assert_int_equal(stats.releases, twin_stats.releases);

    kvpt_destroy_decoder(decoder);
    for (size_t i = 0; i < count; i++) {
        kvpt_destroy_sequence(seqs[i], pool);
        kvpt_destroy_sequence(twins[i], twin_pool);
    }
    kvpt_destroy_pool(pool);
    kvpt_destroy_pool(twin_pool);
    kvpt_destroy_model(model);
}

static void test_decoder_create_threads_and_errors(void **state)
{
    (void)state;
    static const size_t counts[] = {1, 2, 4};
    for (size_t i = 0; i < KVPT_COUNT_OF(counts); i++) {
        kvp_decoder *decoder = kvpt_decoder(counts[i]);
        assert_int_equal(kvp_decoder_threads(decoder), counts[i]);
        kvpt_destroy_decoder(decoder);
    }
    /* 0: one thread per online core. */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    kvp_decoder *decoder = kvpt_decoder(0);
    assert_true(kvp_decoder_threads(decoder) >= 1);
    if (cores > 0) {
        assert_int_equal(kvp_decoder_threads(decoder), (size_t)cores);
    }
    kvpt_destroy_decoder(decoder);

    kvp_error err;
    kvp_decoder *out = (kvp_decoder *)0x1;
    assert_int_equal(kvp_decoder_create(1, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_decoder_create(4097, &out, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "threads");
    assert_ptr_equal(out, (kvp_decoder *)0x1);
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_decoder_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_decoder_threads(NULL), 0);
    kvp_decode_job job;
    memset(&job, 0, sizeof job);
    assert_int_equal(kvp_decoder_step(NULL, &job, 1, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "decoder");
}

/* The decoder, then its thread handles: each failure is typed, names the block, leaks nothing. */
static void test_decoder_create_fault_sweep(void **state)
{
    (void)state;
    enum { THREADS = 3 };
    static const char *const whats[] = {"decoder", "decoder threads"};
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_decoder *decoder = (kvp_decoder *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_decoder_create(THREADS, &decoder, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            assert_int_equal(kvp_decoder_threads(decoder), THREADS);
            kvpt_assert_ok(kvp_decoder_step(decoder, NULL, 0, NULL, NULL, &s.err), &s.err);
            kvpt_destroy_decoder(decoder);
            break;
        }
        failures++;
        assert_true(nth <= KVPT_COUNT_OF(whats));
        kvpt_assert_fault_failed(&s, nth);
        assert_int_equal(s.site, KVPI_SITE_SCRATCH);
        assert_string_equal(s.err.what, whats[nth - 1]);
        assert_ptr_equal(decoder, (kvp_decoder *)0x1);
    }
    assert_int_equal(failures, KVPT_COUNT_OF(whats));
}

/*
 * Nine sequences of batch 1 or 2 holding 0..8 tokens, in two identical sets
 * over two identical pools; STEPS batches through the decoder on one set and
 * one-by-one steps on the other.
 */
static void run_matches_sequential(size_t threads, kvp_next_input_fn next_input)
{
    kvp_model *model = make_model(7);
    kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, POOL_PAGES);
    kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, POOL_PAGES);
    kvp_sequence *seqs[SEQUENCES];
    kvp_sequence *twins[SEQUENCES];
    size_t batch[SEQUENCES];
    kvp_error err;
    for (size_t i = 0; i < SEQUENCES; i++) {
        batch[i] = 1 + i % 2;
        seqs[i] = kvpt_sequence(model, pool, batch[i], CAPACITY);
        twins[i] = kvpt_sequence(model, twin_pool, batch[i], CAPACITY);
        if (i > 0) {
            double prompt[MAX_BATCH * SEQUENCES * MODEL_WIDTH];
            kvpt_fill_random(prompt, batch[i] * i * MODEL_WIDTH, 100 + i);
            kvp_tensor view = kvp_tensor3(prompt, batch[i], i, MODEL_WIDTH);
            kvpt_assert_ok(kvp_sequence_prefill(seqs[i], &view, next_input, NULL, NULL, 0, &err),
                           &err);
            kvpt_assert_pool_ok(pool);
            kvpt_assert_ok(kvp_sequence_prefill(twins[i], &view, next_input, NULL, NULL, 0,
                                                &err),
                           &err);
            kvpt_assert_pool_ok(twin_pool);
        }
    }

    kvp_decoder *decoder = kvpt_decoder(threads);
    double inputs[SEQUENCES][MAX_BATCH * MODEL_WIDTH];
    double outputs[SEQUENCES][MAX_BATCH * MODEL_WIDTH + 1];
    double expected[MAX_BATCH * MODEL_WIDTH];
    kvp_decode_job jobs[SEQUENCES];
    for (size_t s = 0; s < STEPS; s++) {
        for (size_t i = 0; i < SEQUENCES; i++) {
            kvpt_fill_random(inputs[i], batch[i] * MODEL_WIDTH, 1000 * (s + 1) + i);
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].sequence = seqs[i];
            jobs[i].input = kvp_tensor3(inputs[i], batch[i], 1, MODEL_WIDTH);
            jobs[i].output = outputs[i];
            jobs[i].output_len = batch[i] * MODEL_WIDTH;
            jobs[i].status = KVP_STATUS_COUNT_;
            outputs[i][batch[i] * MODEL_WIDTH] = 42.0;
        }
        memset(&err, 0x5A, sizeof err);
        kvp_error untouched = err;
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, SEQUENCES, next_input, NULL, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_memory_equal(&err, &untouched, sizeof err);
        for (size_t i = 0; i < SEQUENCES; i++) {
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            assert_true(outputs[i][batch[i] * MODEL_WIDTH] == 42.0);
            kvpt_assert_ok(kvp_sequence_step(twins[i], &jobs[i].input, next_input, NULL,
                                             expected, batch[i] * MODEL_WIDTH, &err),
                           &err);
            kvpt_assert_pool_ok(twin_pool);
            assert_memory_equal(outputs[i], expected, batch[i] * MODEL_WIDTH * sizeof(double));
            assert_int_equal(kvp_sequence_len(seqs[i]), i + s + 1);
        }
    }
    finish_twins(decoder, model, pool, twin_pool, seqs, twins, SEQUENCES, threads);
}

static void test_decoder_step_matches_sequential_steps(void **state)
{
    (void)state;
    static const size_t counts[] = {1, 2, 4};
    for (size_t i = 0; i < KVPT_COUNT_OF(counts); i++) {
        run_matches_sequential(counts[i], NULL);
    }
    run_matches_sequential(0, NULL);
}

static void test_decoder_step_custom_next_input_matches_sequential_steps(void **state)
{
    (void)state;
    static const size_t counts[] = {1, 2, 4};
    for (size_t i = 0; i < KVPT_COUNT_OF(counts); i++) {
        run_matches_sequential(counts[i], half_residual);
    }
}

/*
 * Jobs 0..3 are good; job 4's sequence lives in a full pool and reaches a
 * block boundary (POOL_EXHAUSTED); job 5 has the wrong input width; job 6
 * has too small an output buffer. Each reports its own status; the failed
 * ones change nothing; the good ones match a twin stepped alone.
 */
static void test_decoder_step_reports_each_jobs_status(void **state)
{
    (void)state;
    enum { GOOD = 4, JOBS = 7, B = 2 };
    static const size_t threads[] = {1, 4};
    for (size_t k = 0; k < KVPT_COUNT_OF(threads); k++) {
        kvp_model *model = make_model(17);
        kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 64);
        kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 64);
        kvp_pool *full = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, LAYERS * B + 1);
        kvp_sequence *seqs[JOBS];
        kvp_sequence *twins[GOOD];
        kvp_error err;
        for (size_t i = 0; i < JOBS; i++) {
            seqs[i] = kvpt_sequence(model, i == 4 ? full : pool, B, CAPACITY);
            if (i < GOOD) {
                twins[i] = kvpt_sequence(model, twin_pool, B, CAPACITY);
                kvpt_assert_ok(kvpi_sequence_append_uncomputed(seqs[i], i, &err), &err);
                kvpt_assert_pool_ok(pool);
                kvpt_assert_ok(kvpi_sequence_append_uncomputed(twins[i], i, &err), &err);
                kvpt_assert_pool_ok(twin_pool);
            }
        }
        /* Job 4: len 3 in a pool with one page left; its step opens block 1. */
        kvpt_assert_ok(kvpi_sequence_append_uncomputed(seqs[4], BLOCK_TOKENS, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_pool_ok(full);
        assert_int_equal(kvpt_stats(full).free_pages, 1);

        double inputs[JOBS][B * (MODEL_WIDTH + 1)];
        double outputs[JOBS][B * MODEL_WIDTH];
        kvp_decode_job jobs[JOBS];
        for (size_t i = 0; i < JOBS; i++) {
            kvpt_fill_random(inputs[i], KVPT_COUNT_OF(inputs[i]), 50 + i);
            kvpt_fill(outputs[i], KVPT_COUNT_OF(outputs[i]), 7.0);
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].sequence = seqs[i];
            jobs[i].input = kvp_tensor3(inputs[i], B, 1, i == 5 ? MODEL_WIDTH + 1 : MODEL_WIDTH);
            jobs[i].output = outputs[i];
            jobs[i].output_len = i == 6 ? B * MODEL_WIDTH - 1 : B * MODEL_WIDTH;
            jobs[i].status = KVP_STATUS_COUNT_;
        }
        uint64_t before[JOBS][LAYERS];
        for (size_t i = GOOD; i < JOBS; i++) {
            digests_of(seqs[i], before[i]);
        }
        kvp_pool_stats full_before = kvpt_stats(full);

        kvp_decoder *decoder = kvpt_decoder(threads[k]);
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_pool_ok(full);

        double expected[B * MODEL_WIDTH];
        for (size_t i = 0; i < GOOD; i++) {
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            kvpt_assert_ok(kvp_sequence_step(twins[i], &jobs[i].input, NULL, NULL, expected,
                                             KVPT_COUNT_OF(expected), &err),
                           &err);
            kvpt_assert_pool_ok(twin_pool);
            assert_memory_equal(outputs[i], expected, sizeof expected);
            assert_int_equal(kvp_sequence_len(seqs[i]), i + 1);
            kvpt_assert_same_rows(seqs[i], twins[i]);
        }
        assert_int_equal(jobs[4].status, KVP_POOL_EXHAUSTED);
        assert_int_equal(jobs[4].error.status, KVP_POOL_EXHAUSTED);
        assert_int_equal(jobs[4].error.needed, LAYERS * B);
        assert_int_equal(jobs[4].error.available, 1);
        assert_int_equal(jobs[4].error.layer, SIZE_MAX);
        assert_int_equal(jobs[5].status, KVP_INPUT_WIDTH_MISMATCH);
        assert_int_equal(jobs[5].error.layer, 0);
        assert_int_equal(jobs[5].error.expected_size, MODEL_WIDTH);
        assert_int_equal(jobs[5].error.actual_size, MODEL_WIDTH + 1);
        assert_int_equal(jobs[6].status, KVP_BUFFER_TOO_SMALL);
        assert_int_equal(jobs[6].error.needed, B * MODEL_WIDTH);
        for (size_t i = GOOD; i < JOBS; i++) {
            uint64_t after[LAYERS];
            digests_of(seqs[i], after);
            assert_memory_equal(after, before[i], sizeof after);
            kvpt_assert_filled(outputs[i], KVPT_COUNT_OF(outputs[i]), 7.0);
        }
        assert_int_equal(kvp_sequence_len(seqs[4]), BLOCK_TOKENS);
        kvp_pool_stats full_after = kvpt_stats(full);
        assert_int_equal(full_after.exhaustions, full_before.exhaustions + 1);
        full_after.exhaustions = full_before.exhaustions;
        assert_memory_equal(&full_before, &full_after, sizeof full_before);

        kvpt_destroy_decoder(decoder);
        for (size_t i = 0; i < JOBS; i++) {
            kvpt_destroy_sequence(seqs[i], i == 4 ? full : pool);
        }
        for (size_t i = 0; i < GOOD; i++) {
            kvpt_destroy_sequence(twins[i], twin_pool);
        }
        kvpt_destroy_pool(pool);
        kvpt_destroy_pool(twin_pool);
        kvpt_destroy_pool(full);
        kvpt_destroy_model(model);
    }
}

static void test_decoder_step_refuses_shared_sequence_and_runs_nothing(void **state)
{
    (void)state;
    enum { JOBS = 3, B = 1 };
    kvp_model *model = make_model(27);
    kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 16);
    kvp_sequence *a = kvpt_sequence(model, pool, B, CAPACITY);
    kvp_sequence *b = kvpt_sequence(model, pool, B, CAPACITY);
    kvp_decoder *decoder = kvpt_decoder(2);
    double inputs[JOBS][MODEL_WIDTH];
    double outputs[JOBS][MODEL_WIDTH];
    kvp_decode_job jobs[JOBS];
    kvp_sequence *order[JOBS] = {a, b, a};
    for (size_t i = 0; i < JOBS; i++) {
        kvpt_fill_random(inputs[i], MODEL_WIDTH, 60 + i);
        kvpt_fill(outputs[i], MODEL_WIDTH, 7.0);
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].sequence = order[i];
        jobs[i].input = kvp_tensor3(inputs[i], B, 1, MODEL_WIDTH);
        jobs[i].output = outputs[i];
        jobs[i].output_len = MODEL_WIDTH;
        jobs[i].status = KVP_STATUS_COUNT_;
    }
    kvp_pool_stats before = kvpt_stats(pool);
    kvp_error err;
    assert_int_equal(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_pool_ok(pool);
    assert_string_equal(err.argument, "jobs");
    char text[256];
    kvp_error_format(&err, text, sizeof text);
    assert_string_equal(text, "argument `jobs` is invalid: two jobs name the same sequence");
    /* A NULL sequence is refused the same way. */
    jobs[2].sequence = NULL;
    assert_int_equal(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    kvpt_assert_pool_ok(pool);
    assert_string_equal(err.argument, "jobs[i].sequence");
    assert_int_equal(kvp_decoder_step(decoder, NULL, 1, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "jobs");
    /* Adjacent duplicates too: the last two jobs, and a batch of two. */
    jobs[2].sequence = b;
    assert_int_equal(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "jobs");
    jobs[1].sequence = a;
    assert_int_equal(kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "jobs");
    kvp_error_format(&err, text, sizeof text);
    assert_string_equal(text, "argument `jobs` is invalid: two jobs name the same sequence");
    jobs[1].sequence = b;
    jobs[2].sequence = NULL;
    /* Nothing ran: no status written, no output, no token. */
    for (size_t i = 0; i < JOBS; i++) {
        assert_int_equal(jobs[i].status, KVP_STATUS_COUNT_);
        kvpt_assert_filled(outputs[i], MODEL_WIDTH, 7.0);
    }
    assert_int_equal(kvp_sequence_len(a), 0);
    assert_int_equal(kvp_sequence_len(b), 0);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);

    /* An empty batch is fine (jobs may be NULL) and leaves err alone. */
    memset(&err, 0x5A, sizeof err);
    kvp_error untouched = err;
    kvpt_assert_ok(kvp_decoder_step(decoder, NULL, 0, NULL, NULL, &err), &err);
    kvpt_assert_ok(kvp_decoder_step(decoder, jobs, 0, NULL, NULL, &err), &err);
    assert_memory_equal(&err, &untouched, sizeof err);
    kvpt_assert_pool_ok(pool);

    /* The decoder still works: the two distinct jobs run. */
    kvpt_assert_ok(kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(jobs[0].status, &jobs[0].error);
    kvpt_assert_ok(jobs[1].status, &jobs[1].error);
    assert_int_equal(jobs[2].status, KVP_STATUS_COUNT_);
    assert_int_equal(kvp_sequence_len(a), 1);
    assert_int_equal(kvp_sequence_len(b), 1);

    kvpt_destroy_decoder(decoder);
    kvpt_destroy_sequence(a, pool);
    kvpt_destroy_sequence(b, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * Six sequences of batch 1 or 2, run through two batches that mix prefill
 * and step jobs (prefills of 1..5 tokens, into empty and into non-empty
 * sequences, with an output buffer and with NULL), against twins driven one
 * by one with kvp_sequence_prefill / kvp_sequence_step in job order: same
 * outputs, same cache rows, same pool counts (and with one thread the very
 * same pages).
 */
static void run_mixed_prefill_and_steps(size_t threads)
{
    enum { JOBS = 6, ROUNDS = 2, T_MAX = 5 };
    kvp_model *model = make_model(23);
    kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, POOL_PAGES);
    kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, POOL_PAGES);
    kvp_sequence *seqs[JOBS];
    kvp_sequence *twins[JOBS];
    size_t batch[JOBS];
    kvp_error err;
    for (size_t i = 0; i < JOBS; i++) {
        batch[i] = 1 + i % 2;
        seqs[i] = kvpt_sequence(model, pool, batch[i], CAPACITY);
        twins[i] = kvpt_sequence(model, twin_pool, batch[i], CAPACITY);
    }
    kvp_decoder *decoder = kvpt_decoder(threads);
    double inputs[JOBS][MAX_BATCH * T_MAX * MODEL_WIDTH];
    double outputs[JOBS][MAX_BATCH * T_MAX * MODEL_WIDTH + 1];
    double expected[MAX_BATCH * T_MAX * MODEL_WIDTH];
    kvp_decode_job jobs[JOBS];
    for (size_t round = 0; round < ROUNDS; round++) {
        size_t before[JOBS];
        for (size_t i = 0; i < JOBS; i++) {
            /* Round 0: even jobs prefill, odd jobs step; round 1 the other way round. */
            int is_prefill = (i + round) % 2 == 0;
            size_t tokens = is_prefill ? 1 + (i + round) % T_MAX : 1;
            size_t elements = batch[i] * tokens * MODEL_WIDTH;
            before[i] = kvp_sequence_len(seqs[i]);
            kvpt_fill_random(inputs[i], elements, 500 * (round + 1) + i);
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].sequence = seqs[i];
            jobs[i].input = kvp_tensor3(inputs[i], batch[i], tokens, MODEL_WIDTH);
            jobs[i].status = KVP_STATUS_COUNT_;
            if (is_prefill) {
                jobs[i].kind = KVP_JOB_PREFILL;
            }
            /* Prefill job 4 of round 0 writes no output (NULL); every other job does. */
            if (!(is_prefill && i == 4 && round == 0)) {
                jobs[i].output = outputs[i];
                jobs[i].output_len = elements;
            }
            kvpt_fill(outputs[i], elements + 1, 42.0);
        }
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err), &err);
        kvpt_assert_pool_ok(pool);
        for (size_t i = 0; i < JOBS; i++) {
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            size_t tokens = jobs[i].input.shape.dims[1];
            size_t elements = batch[i] * tokens * MODEL_WIDTH;
            if (jobs[i].kind == KVP_JOB_PREFILL) {
                kvpt_assert_ok(kvp_sequence_prefill(twins[i], &jobs[i].input, NULL, NULL,
                                                    expected, elements, &err),
                               &err);
            } else {
                kvpt_assert_ok(kvp_sequence_step(twins[i], &jobs[i].input, NULL, NULL, expected,
                                                 elements, &err),
                               &err);
            }
            kvpt_assert_pool_ok(twin_pool);
            if (jobs[i].output != NULL) {
                assert_memory_equal(outputs[i], expected, elements * sizeof(double));
                assert_true(outputs[i][elements] == 42.0);
            } else {
                kvpt_assert_filled(outputs[i], elements + 1, 42.0);
            }
            assert_int_equal(kvp_sequence_len(seqs[i]), before[i] + tokens);
        }
    }
    finish_twins(decoder, model, pool, twin_pool, seqs, twins, JOBS, threads);
}

static void test_decoder_prefill_and_step_jobs_match_sequential_calls(void **state)
{
    (void)state;
    static const size_t counts[] = {1, 2};
    for (size_t i = 0; i < KVPT_COUNT_OF(counts); i++) {
        run_mixed_prefill_and_steps(counts[i]);
    }
}

/*
 * Four jobs: a step, a prefill of 4 tokens whose token 2 holds a NaN, a good
 * prefill and a step. The bad prefill reports NONFINITE_PROJECTION (layer 0,
 * token 2) in its own job and changes nothing (length, cache digests, held
 * pages, output buffer); the others match twins run alone, with 1 and 2
 * threads.
 */
static void test_decoder_failing_prefill_job_changes_nothing(void **state)
{
    (void)state;
    enum { JOBS = 4, B = 2, T = 4, BAD = 1 };
    static const size_t threads[] = {1, 2};
    for (size_t k = 0; k < KVPT_COUNT_OF(threads); k++) {
        kvp_model *model = make_model(29);
        kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 64);
        kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 64);
        kvp_sequence *seqs[JOBS];
        kvp_sequence *twins[JOBS];
        kvp_error err;
        for (size_t i = 0; i < JOBS; i++) {
            seqs[i] = kvpt_sequence(model, pool, B, CAPACITY);
            twins[i] = kvpt_sequence(model, twin_pool, B, CAPACITY);
            /* Every sequence starts with i + 1 computed tokens. */
            double prompt[B * JOBS * MODEL_WIDTH];
            kvpt_fill_random(prompt, B * (i + 1) * MODEL_WIDTH, 300 + i);
            kvp_tensor view = kvp_tensor3(prompt, B, i + 1, MODEL_WIDTH);
            kvpt_assert_ok(kvp_sequence_prefill(seqs[i], &view, NULL, NULL, NULL, 0, &err), &err);
            kvpt_assert_ok(kvp_sequence_prefill(twins[i], &view, NULL, NULL, NULL, 0, &err),
                           &err);
        }
        kvpt_assert_pool_ok(pool);
        uint64_t bad_digests[LAYERS];
        digests_of(seqs[BAD], bad_digests);
        size_t bad_len = kvp_sequence_len(seqs[BAD]);
        size_t bad_pages = kvp_sequence_held_pages(seqs[BAD]);

        double inputs[JOBS][B * T * MODEL_WIDTH];
        double outputs[JOBS][B * T * MODEL_WIDTH];
        double expected[B * T * MODEL_WIDTH];
        kvp_decode_job jobs[JOBS];
        for (size_t i = 0; i < JOBS; i++) {
            int is_prefill = i == BAD || i == 2;
            size_t tokens = is_prefill ? T : 1;
            kvpt_fill_random(inputs[i], B * tokens * MODEL_WIDTH, 700 + i);
            kvpt_fill(outputs[i], B * T * MODEL_WIDTH, 42.0);
            memset(&jobs[i], 0, sizeof jobs[i]);
            jobs[i].kind = is_prefill ? KVP_JOB_PREFILL : KVP_JOB_STEP;
            jobs[i].sequence = seqs[i];
            jobs[i].input = kvp_tensor3(inputs[i], B, tokens, MODEL_WIDTH);
            jobs[i].output = outputs[i];
            jobs[i].output_len = B * tokens * MODEL_WIDTH;
            jobs[i].status = KVP_STATUS_COUNT_;
        }
        /* Lane 1, token 2 of the bad prompt. */
        inputs[BAD][(1 * T + 2) * MODEL_WIDTH + 3] = NAN;

        kvp_decoder *decoder = kvpt_decoder(threads[k]);
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, JOBS, NULL, NULL, &err), &err);
        kvpt_destroy_decoder(decoder);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(jobs[BAD].status, KVP_NONFINITE_PROJECTION);
        assert_int_equal(jobs[BAD].error.status, KVP_NONFINITE_PROJECTION);
        assert_int_equal(jobs[BAD].error.layer, 0);
        assert_int_equal(jobs[BAD].error.token, 2);
        assert_int_equal(kvp_sequence_len(seqs[BAD]), bad_len);
        assert_int_equal(kvp_sequence_held_pages(seqs[BAD]), bad_pages);
        uint64_t after[LAYERS];
        digests_of(seqs[BAD], after);
        assert_memory_equal(after, bad_digests, sizeof after);
        kvpt_assert_filled(outputs[BAD], B * T * MODEL_WIDTH, 42.0);

        for (size_t i = 0; i < JOBS; i++) {
            if (i == BAD) {
                continue;
            }
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            size_t elements = jobs[i].output_len;
            if (jobs[i].kind == KVP_JOB_PREFILL) {
                kvpt_assert_ok(kvp_sequence_prefill(twins[i], &jobs[i].input, NULL, NULL,
                                                    expected, elements, &err),
                               &err);
            } else {
                kvpt_assert_ok(kvp_sequence_step(twins[i], &jobs[i].input, NULL, NULL, expected,
                                                 elements, &err),
                               &err);
            }
            assert_memory_equal(outputs[i], expected, elements * sizeof(double));
            kvpt_assert_same_rows(seqs[i], twins[i]);
        }
        kvpt_assert_same_rows(seqs[BAD], twins[BAD]);
        kvp_pool_stats stats = kvpt_stats(pool);
        kvp_pool_stats twin_stats = kvpt_stats(twin_pool);
        assert_int_equal(stats.held_pages, twin_stats.held_pages);
        assert_int_equal(stats.acquires, twin_stats.acquires);
        assert_int_equal(stats.releases, twin_stats.releases);

        for (size_t i = 0; i < JOBS; i++) {
            kvpt_destroy_sequence(seqs[i], pool);
            kvpt_destroy_sequence(twins[i], twin_pool);
        }
        kvpt_destroy_pool(pool);
        kvpt_destroy_pool(twin_pool);
        kvpt_destroy_model(model);
    }
}

/* An unknown job kind is refused before anything runs. */
/* The page ids of every layer's lanes, layer-major then lane; returns how many. */
static size_t pages_of(const kvp_sequence *seq, size_t batch, uint32_t *out, size_t room)
{
    size_t n = 0;
    kvp_error err;
    for (size_t l = 0; l < LAYERS; l++) {
        for (size_t lane = 0; lane < batch; lane++) {
            const uint32_t *table = NULL;
            size_t blocks = 0;
            kvpt_assert_ok(kvp_cache_block_table(kvp_sequence_cache(seq, l), lane, &table,
                                                 &blocks, &err),
                           &err);
            assert_true(n + blocks <= room);
            memcpy(out + n, table, blocks * sizeof *out);
            n += blocks;
        }
    }
    return n;
}

/*
 * The prefill rollback, checked apart from test_sequence: a prefill job whose
 * token 1 (the first token after the pages are taken) overflows its scores,
 * run alone by a two-thread decoder. Every counter of the pool
 * (acquires, releases, high water, tentative, promised), the sequence's
 * length, pages and promise are as before, and the next prefill gets the same
 * physical pages, in the same order, as a twin that never failed.
 */
static void test_decoder_prefill_rollback_at_token_one(void **state)
{
    (void)state;
    enum { B = 2, START = 2, T = 5, PROMISE = 3 };
    const size_t d = MODEL_WIDTH;
    kvp_model *model = make_model(41);
    kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 40);
    kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 40);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, CAPACITY);
    kvp_sequence *twin = kvpt_sequence(model, twin_pool, B, CAPACITY);
    kvp_error err;
    double start[B * START * MODEL_WIDTH];
    kvpt_fill_random(start, KVPT_COUNT_OF(start), 410);
    kvp_tensor start_view = kvp_tensor3(start, B, START, d);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &start_view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_ok(kvp_sequence_prefill(twin, &start_view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_ok(kvp_sequence_promise(seq, PROMISE, &err), &err);
    kvpt_assert_ok(kvp_sequence_promise(twin, PROMISE, &err), &err);

    double prompt[B * T * MODEL_WIDTH];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 411);
    double bad[B * T * MODEL_WIDTH];
    memcpy(bad, prompt, sizeof bad);
    for (size_t j = 0; j < d; j++) { /* lane 0, token 1: |q . k| far past DBL_MAX */
        bad[(0 * T + 1) * d + j] = (j % 2) ? -1e156 : 1e156;
    }
    kvp_decode_job jobs[1];
    memset(jobs, 0, sizeof jobs);
    jobs[0].kind = KVP_JOB_PREFILL;
    jobs[0].sequence = seq;
    jobs[0].input = kvp_tensor3(bad, B, T, d);

    kvp_pool_stats before = kvpt_stats(pool);
    uint32_t held_before[LAYERS * B * CAPACITY];
    size_t count_before = pages_of(seq, B, held_before, KVPT_COUNT_OF(held_before));
    kvp_decoder *decoder = kvpt_decoder(2);
    kvpt_assert_ok(kvp_decoder_step(decoder, jobs, 1, NULL, NULL, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(jobs[0].status, KVP_NONFINITE_SCORE);
    assert_int_equal(jobs[0].error.token, 1);
    assert_int_equal(jobs[0].error.layer, 0);
    assert_int_equal(kvp_sequence_len(seq), START);
    assert_int_equal(kvp_sequence_held_pages(seq), LAYERS * B * KVPT_CEIL_DIV(START, BLOCK_TOKENS));
    assert_int_equal(kvp_sequence_promised_pages(seq), PROMISE);
    uint32_t held_after[LAYERS * B * CAPACITY];
    assert_int_equal(pages_of(seq, B, held_after, KVPT_COUNT_OF(held_after)), count_before);
    assert_memory_equal(held_after, held_before, count_before * sizeof *held_after);
    /* No counter remembers the failed prefill: the stats are as before, every field. */
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.tentative_pages, 0);
    assert_int_equal(after.promised_pages, PROMISE);
    assert_int_equal(after.attached_reservations, 0);
    assert_memory_equal(&after, &before, sizeof after);

    /* The good prompt now: the same rows and physical pages as the twin's. */
    jobs[0].input = kvp_tensor3(prompt, B, T, d);
    jobs[0].status = KVP_STATUS_COUNT_;
    kvpt_assert_ok(kvp_decoder_step(decoder, jobs, 1, NULL, NULL, &err), &err);
    kvpt_assert_ok(jobs[0].status, &jobs[0].error);
    kvp_tensor good = kvp_tensor3(prompt, B, T, d);
    kvpt_assert_ok(kvp_sequence_prefill(twin, &good, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_pool_ok(twin_pool);
    kvpt_assert_same_rows(seq, twin);
    uint32_t pages_seq[LAYERS * B * CAPACITY];
    uint32_t pages_twin[LAYERS * B * CAPACITY];
    size_t n = pages_of(seq, B, pages_seq, KVPT_COUNT_OF(pages_seq));
    assert_int_equal(n, LAYERS * B * KVPT_CEIL_DIV(START + T, BLOCK_TOKENS));
    assert_int_equal(pages_of(twin, B, pages_twin, KVPT_COUNT_OF(pages_twin)), n);
    assert_memory_equal(pages_seq, pages_twin, n * sizeof *pages_seq);

    kvpt_destroy_decoder(decoder);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_sequence(twin, twin_pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_pool(twin_pool);
    kvpt_destroy_model(model);
}

static void test_decoder_step_refuses_unknown_kind(void **state)
{
    (void)state;
    kvp_model *model = make_model(31);
    kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 16);
    kvp_sequence *a = kvpt_sequence(model, pool, 1, CAPACITY);
    kvp_sequence *b = kvpt_sequence(model, pool, 1, CAPACITY);
    kvp_decoder *decoder = kvpt_decoder(2);
    double input[2][MODEL_WIDTH];
    double output[2][MODEL_WIDTH];
    kvpt_fill_random(input[0], MODEL_WIDTH, 1);
    kvpt_fill_random(input[1], MODEL_WIDTH, 2);
    kvp_decode_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    kvp_sequence *seqs[2] = {a, b};
    for (size_t i = 0; i < 2; i++) {
        jobs[i].sequence = seqs[i];
        jobs[i].input = kvp_tensor3(input[i], 1, 1, MODEL_WIDTH);
        jobs[i].output = output[i];
        jobs[i].output_len = MODEL_WIDTH;
        jobs[i].status = KVP_STATUS_COUNT_;
    }
    jobs[1].kind = (kvp_job_kind)2;
    kvp_error err;
    assert_int_equal(kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "jobs[i].kind");
    assert_int_equal(jobs[0].status, KVP_STATUS_COUNT_);
    assert_int_equal(jobs[1].status, KVP_STATUS_COUNT_);
    assert_int_equal(kvp_sequence_len(a), 0);
    assert_int_equal(kvp_sequence_len(b), 0);
    assert_int_equal(kvpt_stats(pool).held_pages, 0);

    kvpt_destroy_decoder(decoder);
    kvpt_destroy_sequence(a, pool);
    kvpt_destroy_sequence(b, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * The overlap the DECODER_BUSY test forces: the running step's first
 * next_input call (on whichever decoder thread runs the job) first calls the
 * decoder back itself, then announces that it is inside the step and blocks
 * until the second thread has made its call. So the second call lands while
 * the first step is running, under any scheduling.
 */
typedef struct busy_overlap {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int inside;                 /* the first step is blocked in next_input */
    int second_done;            /* the second thread's call has returned */
    kvp_decoder *decoder;
    kvp_decode_job *other_jobs; /* what the intruding calls try to run */
    kvp_status nested;          /* the callback's own call back into the decoder */
    kvp_error nested_err;
    kvp_status second;          /* the second thread's call */
    kvp_error second_err;
} busy_overlap;

static void busy_next_input(void *ctx, size_t layer, const double *input, const double *output,
                            size_t elements, double *next)
{
    busy_overlap *o = ctx;
    pthread_mutex_lock(&o->lock);
    int first = !o->inside;
    o->inside = 1;
    pthread_mutex_unlock(&o->lock);
    if (first) {
        o->nested = kvp_decoder_step(o->decoder, o->other_jobs, 1, NULL, NULL, &o->nested_err);
        pthread_mutex_lock(&o->lock);
        pthread_cond_broadcast(&o->changed);
        while (!o->second_done) {
            pthread_cond_wait(&o->changed, &o->lock);
        }
        pthread_mutex_unlock(&o->lock);
    }
    half_residual(NULL, layer, input, output, elements, next);
}

static void *busy_second_caller(void *arg)
{
    busy_overlap *o = arg;
    pthread_mutex_lock(&o->lock);
    while (!o->inside) {
        pthread_cond_wait(&o->changed, &o->lock);
    }
    pthread_mutex_unlock(&o->lock);
    o->second = kvp_decoder_step(o->decoder, o->other_jobs, 1, NULL, NULL, &o->second_err);
    pthread_mutex_lock(&o->lock);
    o->second_done = 1;
    pthread_cond_broadcast(&o->changed);
    pthread_mutex_unlock(&o->lock);
    return NULL;
}

/*
 * One caller at a time: while a step runs, a second thread's step and a step
 * called from the running step's own next_input callback are refused with
 * DECODER_BUSY and change nothing (no job status written, no token, pool
 * counters as they were); the running step completes exactly as a lone
 * kvp_sequence_step would, and the decoder then serves the refused batch.
 */
static void test_decoder_step_refuses_a_concurrent_caller(void **state)
{
    (void)state;
    for (size_t threads = 1; threads <= 2; threads++) {
        kvp_model *model = make_model(33);
        kvp_pool *pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 16);
        kvp_pool *twin_pool = kvpt_pool(BLOCK_TOKENS, HEADS, HEAD_WIDTH, 16);
        kvp_sequence *running = kvpt_sequence(model, pool, 1, CAPACITY);
        kvp_sequence *refused = kvpt_sequence(model, pool, 1, CAPACITY);
        kvp_sequence *twin = kvpt_sequence(model, twin_pool, 1, CAPACITY);
        kvp_decoder *decoder = kvpt_decoder(threads);
        double input[2][MODEL_WIDTH];
        double output[2][MODEL_WIDTH];
        double twin_output[MODEL_WIDTH];
        kvpt_fill_random(input[0], MODEL_WIDTH, 70);
        kvpt_fill_random(input[1], MODEL_WIDTH, 71);
        kvpt_fill(output[1], MODEL_WIDTH, 7.0);
        kvp_decode_job jobs[2];
        memset(jobs, 0, sizeof jobs);
        kvp_sequence *seqs[2] = {running, refused};
        for (size_t i = 0; i < 2; i++) {
            jobs[i].sequence = seqs[i];
            jobs[i].input = kvp_tensor3(input[i], 1, 1, MODEL_WIDTH);
            jobs[i].output = output[i];
            jobs[i].output_len = MODEL_WIDTH;
            jobs[i].status = KVP_STATUS_COUNT_;
        }

        busy_overlap o;
        memset(&o, 0, sizeof o);
        pthread_mutex_init(&o.lock, NULL);
        pthread_cond_init(&o.changed, NULL);
        o.decoder = decoder;
        o.other_jobs = &jobs[1];
        o.nested = KVP_STATUS_COUNT_;
        o.second = KVP_STATUS_COUNT_;
        pthread_t second;
        assert_int_equal(pthread_create(&second, NULL, busy_second_caller, &o), 0);
        kvp_pool_stats before = kvpt_stats(pool);
        kvp_error err;
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, 1, busy_next_input, &o, &err), &err);
        assert_int_equal(pthread_join(second, NULL), 0);
        pthread_cond_destroy(&o.changed);
        pthread_mutex_destroy(&o.lock);

        /* Both intruders were refused, with the typed status and its text. */
        assert_int_equal(o.nested, KVP_DECODER_BUSY);
        assert_int_equal(o.nested_err.status, KVP_DECODER_BUSY);
        assert_int_equal(o.second, KVP_DECODER_BUSY);
        assert_int_equal(o.second_err.status, KVP_DECODER_BUSY);
        kvpt_assert_error_text(&o.second_err, "decoder is busy: another kvp_decoder_step is "
                                              "running on it (one caller at a time)");
        /* ... and changed nothing: the refused job never ran. */
        assert_int_equal(jobs[1].status, KVP_STATUS_COUNT_);
        kvpt_assert_filled(output[1], MODEL_WIDTH, 7.0);
        assert_int_equal(kvp_sequence_len(refused), 0);
        /* The running step is a lone step: one token, its pages, twin's output. */
        kvpt_assert_ok(jobs[0].status, &jobs[0].error);
        assert_int_equal(kvp_sequence_len(running), 1);
        kvp_tensor twin_input = kvp_tensor3(input[0], 1, 1, MODEL_WIDTH);
        kvpt_assert_ok(kvp_sequence_step(twin, &twin_input, half_residual, NULL, twin_output,
                                         MODEL_WIDTH, &err),
                       &err);
        assert_memory_equal(output[0], twin_output, sizeof twin_output);
        kvpt_assert_same_rows(running, twin);
        kvp_pool_stats after = kvpt_stats(pool);
        assert_int_equal(after.held_pages, before.held_pages + LAYERS);
        assert_int_equal(after.acquires, before.acquires + LAYERS);
        kvpt_assert_pool_ok(pool);

        /* The decoder is free again and runs the batch it refused. */
        kvpt_assert_ok(kvp_decoder_step(decoder, &jobs[1], 1, NULL, NULL, &err), &err);
        kvpt_assert_ok(jobs[1].status, &jobs[1].error);
        assert_int_equal(kvp_sequence_len(refused), 1);
        kvpt_assert_pool_ok(pool);

        kvpt_destroy_decoder(decoder);
        kvpt_destroy_sequence(running, pool);
        kvpt_destroy_sequence(refused, pool);
        kvpt_destroy_sequence(twin, twin_pool);
        kvpt_destroy_pool(pool);
        kvpt_destroy_pool(twin_pool);
        kvpt_destroy_model(model);
    }
}

/* threads == 0 means one per online core, within [1, 4096]. */
static void test_decoder_default_thread_count(void **state)
{
    (void)state;
    assert_int_equal(kvpi_decoder_default_threads(-1), 1);
    assert_int_equal(kvpi_decoder_default_threads(0), 1);
    assert_int_equal(kvpi_decoder_default_threads(1), 1);
    assert_int_equal(kvpi_decoder_default_threads(12), 12);
    assert_int_equal(kvpi_decoder_default_threads(4096), 4096);
    assert_int_equal(kvpi_decoder_default_threads(100000), 4096);
    kvp_decoder *decoder = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_create(0, &decoder, &err), &err);
    assert_int_equal(kvp_decoder_threads(decoder),
                     kvpi_decoder_default_threads(sysconf(_SC_NPROCESSORS_ONLN)));
    kvpt_assert_ok(kvp_decoder_destroy(decoder, &err), &err);
    assert_int_equal(kvp_decoder_threads(NULL), 0);
}

int main(void)
{
    /* A decoder that never hands back (a lost wake-up, a refused refusal) hangs, not fails. */
    kvpt_watchdog("test_decoder", 120);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decoder_default_thread_count),
        cmocka_unit_test(test_decoder_create_threads_and_errors),
        cmocka_unit_test_teardown(test_decoder_create_fault_sweep, kvpt_disarm),
        cmocka_unit_test(test_decoder_step_matches_sequential_steps),
        cmocka_unit_test(test_decoder_step_custom_next_input_matches_sequential_steps),
        cmocka_unit_test(test_decoder_step_reports_each_jobs_status),
        cmocka_unit_test(test_decoder_step_refuses_shared_sequence_and_runs_nothing),
        cmocka_unit_test(test_decoder_prefill_and_step_jobs_match_sequential_calls),
        cmocka_unit_test(test_decoder_failing_prefill_job_changes_nothing),
        cmocka_unit_test(test_decoder_prefill_rollback_at_token_one),
        cmocka_unit_test(test_decoder_step_refuses_unknown_kind),
        cmocka_unit_test(test_decoder_step_refuses_a_concurrent_caller),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
