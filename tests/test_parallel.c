/*
 * test_parallel.c: one long sequence on several threads, bit for bit.
 *
 * Proves:
 *   - the executor (attention/parallel.h) as the decoder implements it runs
 *     every part exactly once, with 1, 2 and 3 threads, and other threads
 *     run some of them (the assist), forced by the decoder's hold hook,
 *     never by timing; kvpi_decoder_run is refused while a step runs;
 *   - the partition of attention (attention/gather.h) is exact: the scores,
 *     softmax weights and head outputs of every phase on any executor (this
 *     thread, parts in reverse or shuffled order, a decoder of 2 or 3
 *     threads) equal the serial whole-lane loops bit for bit, for f64, f32
 *     and bf16 pages, block_tokens 1, 3 and 16, kv_heads = heads, a group
 *     of 2 and 1, at the finest grain (a block per scores part, a row per
 *     softmax part, one KV head per value part cut into slices of 8
 *     features) and the default;
 *   - the values phase over KV heads that parts do not divide evenly (5 over
 *     2 and 3 parts, 3 over 2; groups of 1 and 2): each part alone writes
 *     exactly its heads with the serial bits (no remainder head dropped or
 *     written twice), and decoders of 2 and 3 threads give the serial bits;
 *   - a decoder of 1, 2 and 3 threads prefilling and stepping one long
 *     sequence (B = 1), and two sequences on 3 threads, and three on 2,
 *     gives outputs, cached K/V and pool counters bit-identical to
 *     kvp_sequence_prefill / kvp_sequence_step run alone, with the very same
 *     pages, every dtype and kv_heads, while other threads ran parts;
 *   - a step refused for want of pages after an assisted attention changes
 *     nothing.
 * kvp_pool_check runs after every operation. Unit test: uses the internal
 * headers (gather, decoder hooks).
 */
#include "support.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention/gather.h"
#include "attention/kernels.h"
#include "pager/dtype.h"
#include "serve/decoder_internal.h"

static const kvp_dtype all_dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};

/* The finest partition: a block per scores part, a row per softmax part, slices of 8. */
static const kvpi_gather_grain finest = {
    .chunk_bytes = 1, .min_parallel_bytes = 0, .softmax_elements = 1, .value_units = 1024};

static int teardown_grain(void **state)
{
    (void)state;
    kvpi_gather_grain_set(NULL);
    return 0;
}

/* ---- the executor ------------------------------------------------------------ */

#define MAX_PARTS 100

typedef struct count_ctx {
    size_t parts;
    unsigned runs[MAX_PARTS]; /* part p writes runs[p] only */
} count_ctx;

static void count_part(void *ctx, size_t part)
{
    count_ctx *c = ctx;
    c->runs[part]++;
}

static void count_solo(void *ctx, const kvpi_parallel *par)
{
    count_ctx *c = ctx;
    kvpi_parallel_run(par, count_part, c, c->parts);
}

static void test_parallel_executor_runs_every_part_once(void **state)
{
    (void)state;
    static const size_t part_counts[] = {1, 2, 3, 17, MAX_PARTS};
    for (size_t threads = 1; threads <= 3; threads++) {
        kvp_decoder *decoder = kvpt_decoder(threads);
        for (size_t i = 0; i < KVPT_COUNT_OF(part_counts); i++) {
            count_ctx c;
            memset(&c, 0, sizeof c);
            c.parts = part_counts[i];
            uint64_t before = kvpi_decoder_assisted_parts(decoder);
            kvpi_decoder_hold_tasks(decoder, 1);
            kvp_error err;
            kvpt_assert_ok(kvpi_decoder_run(decoder, count_solo, &c, &err), &err);
            kvpi_decoder_hold_tasks(decoder, 0);
            for (size_t p = 0; p < MAX_PARTS; p++) {
                assert_int_equal(c.runs[p], p < c.parts ? 1 : 0);
            }
            uint64_t assisted = kvpi_decoder_assisted_parts(decoder) - before;
            if (threads > 1 && c.parts > 1) {
                /* Held: the poster ran nothing until another thread took a part. */
                assert_true(assisted >= 1);
                assert_true(assisted <= c.parts);
            } else {
                assert_int_equal(assisted, 0);
            }
        }
        /* The serial executor runs in order on this thread. */
        count_ctx c;
        memset(&c, 0, sizeof c);
        c.parts = 5;
        count_solo(&c, NULL);
        for (size_t p = 0; p < 5; p++) {
            assert_int_equal(c.runs[p], 1);
        }
        kvpt_destroy_decoder(decoder);
    }
}

typedef struct busy_ctx {
    kvp_decoder *decoder;
    kvp_status inner;
    kvp_error err;
} busy_ctx;

static void busy_solo(void *ctx, const kvpi_parallel *par)
{
    (void)par;
    busy_ctx *b = ctx;
    count_ctx c;
    memset(&c, 0, sizeof c);
    b->inner = kvpi_decoder_run(b->decoder, count_solo, &c, &b->err);
}

static void test_parallel_run_refused_while_stepping(void **state)
{
    (void)state;
    kvp_decoder *decoder = kvpt_decoder(2);
    busy_ctx b = {.decoder = decoder};
    kvp_error err;
    kvpt_assert_ok(kvpi_decoder_run(decoder, busy_solo, &b, &err), &err);
    assert_int_equal(b.inner, KVP_DECODER_BUSY);
    assert_int_equal(b.err.status, KVP_DECODER_BUSY);
    assert_int_equal(kvpi_decoder_run(NULL, count_solo, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "decoder");
    assert_int_equal(kvpi_decoder_run(decoder, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "fn");
    kvpt_destroy_decoder(decoder);
}

/* ---- the partition ------------------------------------------------------------ */

/* An executor on this thread running the parts in reverse order, or in a shuffled one. */
static void run_reverse(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx, size_t parts)
{
    (void)self;
    for (size_t p = parts; p-- > 0;) {
        fn(ctx, p);
    }
}

static void run_shuffled(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx, size_t parts)
{
    uint64_t *seed = self->impl;
    size_t *order = malloc(parts * sizeof *order);
    assert_non_null(order);
    for (size_t p = 0; p < parts; p++) {
        order[p] = p;
    }
    for (size_t p = parts; p > 1; p--) {
        size_t j = (size_t)(kvpt_rand_next(seed) % p);
        size_t t = order[p - 1];
        order[p - 1] = order[j];
        order[j] = t;
    }
    for (size_t p = 0; p < parts; p++) {
        fn(ctx, order[p]);
    }
    free(order);
}

/* The context of a solo run of one gather job's phase (attend_solo, values_solo). */
typedef struct job_ctx {
    const kvpi_gather_job *job;
} job_ctx;

static void attend_solo(void *ctx, const kvpi_parallel *par)
{
    const job_ctx *a = ctx;
    kvpi_gather_attend_on(a->job, par);
}

#define P_BATCH 2
#define P_HEADS 4
#define P_WIDTH 32
#define P_LEN 37

static int same_bytes(const double *a, const double *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

/*
 * One cache of P_LEN random rows; every executor's weights and outputs equal
 * the serial whole-lane loops' bits.
 */
static void check_partition(kvp_dtype dtype, size_t bt, size_t kv_heads, kvp_decoder **decoders)
{
    size_t d = P_HEADS * P_WIDTH;
    size_t capacity = P_LEN + 1;
    size_t pages = P_BATCH * KVPT_CEIL_DIV(capacity, bt);
    kvp_pool *pool = kvpt_dtype_pool(bt, kv_heads, P_WIDTH, pages, dtype);
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(d, P_HEADS, kv_heads, capacity, 10000.0,
                                                   7 + bt, &layer, &err),
                   &err);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, P_BATCH, capacity);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *x = kvpt_doubles(P_BATCH * d);
    for (size_t t = 0; t < P_LEN; t++) {
        kvpt_fill_random(x, P_BATCH * d, 100 + t);
        kvp_tensor input = kvp_tensor3(x, P_BATCH, 1, d);
        kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
    }

    size_t kv_width = kv_heads * P_WIDTH;
    size_t nweights = P_BATCH * P_HEADS * (P_LEN + 1);
    double *queries = kvpt_doubles(P_BATCH * d);
    double *keys = kvpt_doubles(P_BATCH * kv_width);
    double *values = kvpt_doubles(P_BATCH * kv_width);
    kvpt_fill_random(queries, P_BATCH * d, 1);
    kvpt_fill_random(keys, P_BATCH * kv_width, 2);
    kvpt_fill_random(values, P_BATCH * kv_width, 3);
    /* The candidate rows as a ticket holds them: rounded to the dtype. */
    kvpi_dtype_round_rows(dtype, keys, P_BATCH * kv_width);
    kvpi_dtype_round_rows(dtype, values, P_BATCH * kv_width);
    double scale = 1.0 / sqrt((double)P_WIDTH);

    /* The reference: the whole-lane loops and one softmax per row, in order. */
    double *want_weights = kvpt_doubles(nweights);
    double *want_outputs = kvpt_doubles(P_BATCH * d);
    for (size_t lane = 0; lane < P_BATCH; lane++) {
        double *w = want_weights + lane * P_HEADS * (P_LEN + 1);
        kvpi_gather_scores(cache, queries + lane * d, keys + lane * kv_width, lane, scale, w);
        for (size_t h = 0; h < P_HEADS; h++) {
            kvpi_softmax(w + h * (P_LEN + 1), P_LEN + 1);
        }
        kvpi_gather_values(cache, w, values + lane * kv_width, lane, want_outputs + lane * d);
    }
    for (size_t i = 0; i < P_BATCH * d; i++) {
        assert_true(isfinite(want_outputs[i]));
    }

    double *weights = kvpt_doubles(nweights);
    double *outputs = kvpt_doubles(P_BATCH * d);
    kvpi_gather_job job = {.cache = cache, .queries = queries, .keys = keys, .values = values,
                           .scale = scale, .weights = weights, .outputs = outputs};
    uint64_t seed = 99;
    kvpi_parallel reverse = {run_reverse, NULL};
    kvpi_parallel shuffled = {run_shuffled, &seed};
    const kvpi_gather_grain *grains[2] = {&finest, NULL};
    for (size_t g = 0; g < 2; g++) {
        kvpi_gather_grain_set(grains[g]);
        if (g == 0) {
            /* The finest grain: a part per block and lane, a row, a slice of 8 features. */
            assert_int_equal(kvpi_gather_score_parts(cache), P_BATCH * KVPT_CEIL_DIV(P_LEN, bt));
            assert_int_equal(kvpi_gather_softmax_parts(cache), P_BATCH * P_HEADS);
            assert_int_equal(kvpi_gather_value_parts(cache), P_BATCH * kv_heads * P_WIDTH / 8);
        } else {
            assert_int_equal(kvpi_gather_score_parts(cache), P_BATCH);
        }
        for (size_t e = 0; e < 5; e++) {
            kvpt_fill(weights, nweights, NAN);
            kvpt_fill(outputs, P_BATCH * d, NAN);
            if (e < 3) {
                const kvpi_parallel *pars[3] = {NULL, &reverse, &shuffled};
                kvpi_gather_attend_on(&job, pars[e]);
            } else {
                kvp_decoder *decoder = decoders[e - 3];
                uint64_t before = kvpi_decoder_assisted_parts(decoder);
                job_ctx a = {&job};
                kvpi_decoder_hold_tasks(decoder, SIZE_MAX);
                kvpt_assert_ok(kvpi_decoder_run(decoder, attend_solo, &a, &err), &err);
                kvpi_decoder_hold_tasks(decoder, 0);
                /* At the finest grain every phase is posted and held: helped each time. */
                if (g == 0) {
                    assert_true(kvpi_decoder_assisted_parts(decoder) - before >= 3);
                }
            }
            assert_true(same_bytes(weights, want_weights, nweights));
            assert_true(same_bytes(outputs, want_outputs, P_BATCH * d));
        }
    }
    kvpi_gather_grain_set(NULL);

    free(weights);
    free(outputs);
    free(want_weights);
    free(want_outputs);
    free(queries);
    free(keys);
    free(values);
    free(x);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

static void test_parallel_partition_is_exact(void **state)
{
    (void)state;
    static const size_t block_sizes[] = {1, 3, 16};
    static const size_t kv_heads[] = {P_HEADS, 2, 1};
    kvp_decoder *decoders[2] = {kvpt_decoder(2), kvpt_decoder(3)};
    for (size_t t = 0; t < KVPT_COUNT_OF(all_dtypes); t++) {
        for (size_t b = 0; b < KVPT_COUNT_OF(block_sizes); b++) {
            for (size_t k = 0; k < KVPT_COUNT_OF(kv_heads); k++) {
                check_partition(all_dtypes[t], block_sizes[b], kv_heads[k], decoders);
            }
        }
    }
    kvpt_destroy_decoder(decoders[0]);
    kvpt_destroy_decoder(decoders[1]);
}

/* ---- the values phase over KV heads that do not divide evenly ---------------------- */

/*
 * An executor on this thread that runs each part alone on outputs filled
 * with NaN and records which output elements it wrote: owner[i] is the
 * part that wrote element i, and writes[i] how many parts did. The serial
 * bits are compared element by element as each part writes them.
 */
typedef struct coverage {
    kvpi_gather_job *job;
    size_t n;             /* output elements */
    const double *want;   /* the serial loop's outputs */
    unsigned *writes;     /* [n] */
    size_t mismatches;    /* elements written with other bits than the serial loop's */
} coverage;

static void run_covering(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx, size_t parts)
{
    coverage *c = self->impl;
    for (size_t p = 0; p < parts; p++) {
        kvpt_fill(c->job->outputs, c->n, NAN);
        fn(ctx, p);
        for (size_t i = 0; i < c->n; i++) {
            if (!isnan(c->job->outputs[i])) {
                c->writes[i]++;
                c->mismatches += !same_bytes(&c->job->outputs[i], &c->want[i], 1);
            }
        }
    }
}

static void values_solo(void *ctx, const kvpi_parallel *par)
{
    const job_ctx *v = ctx;
    kvpi_gather_values_on(v->job, par);
}

#define U_WIDTH 8 /* d_h: no feature slices (a slice needs 16 features), runs of heads only */
#define U_LEN 29

/*
 * One lane of `kv_heads` KV heads (groups of `group` query heads) whose
 * values phase is cut into `parts` runs of KV heads, `kv_heads` not a
 * multiple of `parts`: 5 over 2 (2 + 3 heads), 5 over 3 (1 + 2 + 2), 3 over
 * 2 (1 + 2). Every part alone writes its own heads (each output element
 * written by exactly one part, a dropped or duplicated remainder head
 * fails), with the serial loop's bits, and on decoders of 2 and 3 threads
 * (held, so other threads run parts) and in reverse order the whole
 * outputs equal kvpi_gather_values's bit for bit.
 */
static void check_uneven_values(size_t kv_heads, size_t group, size_t parts,
                                kvp_decoder **decoders)
{
    size_t heads = kv_heads * group;
    size_t d = heads * U_WIDTH;
    size_t kv_width = kv_heads * U_WIDTH;
    size_t capacity = U_LEN + 1;
    size_t bt = 4;
    kvp_pool *pool = kvpt_dtype_pool(bt, kv_heads, U_WIDTH, KVPT_CEIL_DIV(capacity, bt), KVP_F64);
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(d, heads, kv_heads, capacity, 10000.0,
                                                   31 + kv_heads, &layer, &err),
                   &err);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, capacity);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *x = kvpt_doubles(d);
    for (size_t t = 0; t < U_LEN; t++) {
        kvpt_fill_random(x, d, 500 + t);
        kvp_tensor input = kvp_tensor3(x, 1, 1, d);
        kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
    }
    kvpt_assert_pool_ok(pool);
    double *queries = kvpt_doubles(d);
    double *keys = kvpt_doubles(kv_width);
    double *values = kvpt_doubles(kv_width);
    kvpt_fill_random(queries, d, 4);
    kvpt_fill_random(keys, kv_width, 5);
    kvpt_fill_random(values, kv_width, 6);
    double scale = 1.0 / sqrt((double)U_WIDTH);
    double *weights = kvpt_doubles(heads * (U_LEN + 1));
    kvpi_gather_scores(cache, queries, keys, 0, scale, weights);
    for (size_t h = 0; h < heads; h++) {
        kvpi_softmax(weights + h * (U_LEN + 1), U_LEN + 1);
    }
    double *want = kvpt_doubles(d);
    kvpi_gather_values(cache, weights, values, 0, want);
    for (size_t i = 0; i < d; i++) {
        assert_true(isfinite(want[i]));
    }

    kvpi_gather_grain grain = {.chunk_bytes = 1, .min_parallel_bytes = 0,
                               .softmax_elements = 1, .value_units = parts};
    kvpi_gather_grain_set(&grain);
    assert_int_equal(kvpi_gather_value_parts(cache), parts);
    double *outputs = kvpt_doubles(d);
    kvpi_gather_job job = {.cache = cache, .queries = queries, .keys = keys, .values = values,
                           .scale = scale, .weights = weights, .outputs = outputs};

    unsigned *writes = calloc(d, sizeof *writes);
    assert_non_null(writes);
    coverage c = {&job, d, want, writes, 0};
    kvpi_parallel covering = {run_covering, &c};
    kvpi_gather_values_on(&job, &covering);
    for (size_t i = 0; i < d; i++) {
        assert_int_equal(writes[i], 1); /* head i / U_WIDTH: one part, not none, not two */
    }
    assert_int_equal(c.mismatches, 0);

    kvpi_parallel reverse = {run_reverse, NULL};
    for (size_t e = 0; e < 3; e++) {
        kvpt_fill(outputs, d, NAN);
        if (e == 0) {
            kvpi_gather_values_on(&job, &reverse);
        } else {
            kvp_decoder *decoder = decoders[e - 1];
            uint64_t before = kvpi_decoder_assisted_parts(decoder);
            job_ctx v = {&job};
            kvpi_decoder_hold_tasks(decoder, SIZE_MAX);
            kvpt_assert_ok(kvpi_decoder_run(decoder, values_solo, &v, &err), &err);
            kvpi_decoder_hold_tasks(decoder, 0);
            assert_true(kvpi_decoder_assisted_parts(decoder) - before >= 1);
        }
        assert_true(same_bytes(outputs, want, d));
    }
    kvpi_gather_grain_set(NULL);

    free(writes);
    free(outputs);
    free(want);
    free(weights);
    free(queries);
    free(keys);
    free(values);
    free(x);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

static void test_parallel_uneven_kv_heads_split_exactly(void **state)
{
    (void)state;
    static const size_t cases[][2] = {{5, 2}, {5, 3}, {3, 2}}; /* KV heads, value parts */
    kvp_decoder *decoders[2] = {kvpt_decoder(2), kvpt_decoder(3)};
    for (size_t k = 0; k < KVPT_COUNT_OF(cases); k++) {
        for (size_t group = 1; group <= 2; group++) {
            check_uneven_values(cases[k][0], group, cases[k][1], decoders);
        }
    }
    kvpt_destroy_decoder(decoders[0]);
    kvpt_destroy_decoder(decoders[1]);
}

/* ---- the decoder: one long sequence ---------------------------------------------- */

#define S_LAYERS 2
#define S_WIDTH 64
#define S_HEADS 4
#define S_HEAD_WIDTH (S_WIDTH / S_HEADS)
#define S_PROMPT 21
#define S_STEPS 6
#define S_CAPACITY (S_PROMPT + S_STEPS)
#define S_MAX_SEQS 3

typedef struct run_result {
    double prompt_out[S_MAX_SEQS][S_PROMPT * S_WIDTH];
    double step_out[S_MAX_SEQS][S_STEPS][S_WIDTH];
    uint64_t digests[S_MAX_SEQS][S_LAYERS]; /* kvp_cache_digest: rows and page tables */
    double keys[S_MAX_SEQS][S_LAYERS][S_HEADS * S_CAPACITY * S_HEAD_WIDTH];
    double values[S_MAX_SEQS][S_LAYERS][S_HEADS * S_CAPACITY * S_HEAD_WIDTH];
    uint32_t pages[S_MAX_SEQS][S_LAYERS][S_CAPACITY];
    kvp_pool_stats stats;
    uint64_t assisted;
} run_result;

static void input_row(size_t seq, size_t t, double *out, size_t n)
{
    kvpt_fill_random(out, n, 1000 * (seq + 1) + t);
}

/*
 * Prefills `count` sequences of batch 1 with S_PROMPT tokens, then steps
 * them S_STEPS times, on `threads` threads (0: kvp_sequence_prefill and
 * kvp_sequence_step, one sequence after another, on this thread).
 */
static void run_sequences(kvp_model *model, kvp_dtype dtype, size_t bt, size_t kv_heads,
                          size_t count, size_t threads, run_result *r)
{
    size_t pages = S_LAYERS * count * KVPT_CEIL_DIV(S_CAPACITY, bt);
    kvp_pool *pool = kvpt_dtype_pool(bt, kv_heads, S_HEAD_WIDTH, pages, dtype);
    kvp_sequence *seqs[S_MAX_SEQS];
    for (size_t i = 0; i < count; i++) {
        seqs[i] = kvpt_sequence(model, pool, 1, S_CAPACITY);
    }
    kvp_decoder *decoder = threads > 0 ? kvpt_decoder(threads) : NULL;
    if (decoder != NULL) {
        kvpi_decoder_hold_tasks(decoder, SIZE_MAX);
    }
    static double prompts[S_MAX_SEQS][S_PROMPT * S_WIDTH];
    static double rows[S_MAX_SEQS][S_WIDTH];
    kvp_decode_job jobs[S_MAX_SEQS];
    kvp_error err;
    for (size_t i = 0; i < count; i++) {
        for (size_t t = 0; t < S_PROMPT; t++) {
            input_row(i, t, prompts[i] + t * S_WIDTH, S_WIDTH);
        }
        jobs[i] = (kvp_decode_job){.sequence = seqs[i],
                                   .input = kvp_tensor3(prompts[i], 1, S_PROMPT, S_WIDTH),
                                   .output = r->prompt_out[i],
                                   .output_len = S_PROMPT * S_WIDTH,
                                   .kind = KVP_JOB_PREFILL};
        if (decoder == NULL) {
            kvpt_assert_ok(kvp_sequence_prefill(seqs[i], &jobs[i].input, NULL, NULL,
                                                r->prompt_out[i], S_PROMPT * S_WIDTH, &err),
                           &err);
        }
    }
    if (decoder != NULL) {
        kvpt_assert_ok(kvp_decoder_step(decoder, jobs, count, NULL, NULL, &err), &err);
        for (size_t i = 0; i < count; i++) {
            kvpt_assert_ok(jobs[i].status, &jobs[i].error);
        }
    }
    kvpt_assert_pool_ok(pool);
    for (size_t s = 0; s < S_STEPS; s++) {
        for (size_t i = 0; i < count; i++) {
            input_row(i, S_PROMPT + s, rows[i], S_WIDTH);
            jobs[i] = (kvp_decode_job){.sequence = seqs[i],
                                       .input = kvp_tensor3(rows[i], 1, 1, S_WIDTH),
                                       .output = r->step_out[i][s],
                                       .output_len = S_WIDTH,
                                       .kind = KVP_JOB_STEP};
            if (decoder == NULL) {
                kvpt_assert_ok(kvp_sequence_step(seqs[i], &jobs[i].input, NULL, NULL,
                                                 r->step_out[i][s], S_WIDTH, &err),
                               &err);
            }
        }
        if (decoder != NULL) {
            kvpt_assert_ok(kvp_decoder_step(decoder, jobs, count, NULL, NULL, &err), &err);
            for (size_t i = 0; i < count; i++) {
                kvpt_assert_ok(jobs[i].status, &jobs[i].error);
            }
        }
        kvpt_assert_pool_ok(pool);
    }
    for (size_t i = 0; i < count; i++) {
        for (size_t l = 0; l < S_LAYERS; l++) {
            const kvp_cache *cache = kvp_sequence_cache(seqs[i], l);
            kvpt_assert_ok(kvp_cache_digest(cache, &r->digests[i][l], &err), &err);
            size_t n = KVPT_COUNT_OF(r->keys[i][l]);
            kvpt_assert_ok(kvp_cache_keys(cache, r->keys[i][l], n, &err), &err);
            kvpt_assert_ok(kvp_cache_values(cache, r->values[i][l], n, &err), &err);
            for (size_t b = 0; b < KVPT_CEIL_DIV(S_CAPACITY, bt); b++) {
                kvpt_assert_ok(kvp_cache_page(cache, 0, b, &r->pages[i][l][b], &err), &err);
            }
        }
    }
    r->stats = kvpt_stats(pool);
    r->assisted = decoder != NULL ? kvpi_decoder_assisted_parts(decoder) : 0;
    if (decoder != NULL) {
        kvpt_destroy_decoder(decoder);
    }
    for (size_t i = 0; i < count; i++) {
        kvpt_destroy_sequence(seqs[i], pool);
    }
    kvpt_destroy_pool(pool);
}

/*
 * Outputs, logical K/V rows and pool counters agree bit for bit; with one
 * sequence (jobs take pages in job order only when they run one at a time)
 * also the physical pages and the cache digests over them.
 */
static void assert_same_run(const run_result *a, const run_result *b, size_t count, size_t bt)
{
    for (size_t i = 0; i < count; i++) {
        assert_memory_equal(a->prompt_out[i], b->prompt_out[i], sizeof a->prompt_out[i]);
        assert_memory_equal(a->step_out[i], b->step_out[i], sizeof a->step_out[i]);
        assert_memory_equal(a->keys[i], b->keys[i], sizeof a->keys[i]);
        assert_memory_equal(a->values[i], b->values[i], sizeof a->values[i]);
        if (count > 1) {
            continue;
        }
        assert_memory_equal(a->digests[i], b->digests[i], sizeof a->digests[i]);
        for (size_t l = 0; l < S_LAYERS; l++) {
            assert_memory_equal(a->pages[i][l], b->pages[i][l],
                                KVPT_CEIL_DIV(S_CAPACITY, bt) * sizeof(uint32_t));
        }
    }
    assert_int_equal(a->stats.total_pages, b->stats.total_pages);
    assert_int_equal(a->stats.free_pages, b->stats.free_pages);
    assert_int_equal(a->stats.held_pages, b->stats.held_pages);
    assert_int_equal(a->stats.high_water_pages, b->stats.high_water_pages);
    assert_int_equal(a->stats.acquires, b->stats.acquires);
    assert_int_equal(a->stats.releases, b->stats.releases);
}

static void test_parallel_decoder_is_bit_identical(void **state)
{
    (void)state;
    static const size_t block_sizes[] = {1, 5, 16};
    static const size_t kv_heads[] = {S_HEADS, 2, 1};
    /* (sequences, threads): one long sequence on 1, 2, 3 threads; 2 on 3; 3 on 2. */
    static const size_t runs[][2] = {{1, 1}, {1, 2}, {1, 3}, {2, 3}, {3, 2}};
    static run_result serial;
    static run_result threaded;
    kvpi_gather_grain_set(&finest);
    for (size_t t = 0; t < KVPT_COUNT_OF(all_dtypes); t++) {
        for (size_t k = 0; k < KVPT_COUNT_OF(kv_heads); k++) {
            size_t bt = block_sizes[(t + k) % KVPT_COUNT_OF(block_sizes)];
            kvp_model *model = NULL;
            kvp_error err;
            kvpt_assert_ok(kvp_model_create_random_grouped(S_LAYERS, S_WIDTH, S_HEADS,
                                                           kv_heads[k], S_CAPACITY, 10000.0,
                                                           40 + t, &model, &err),
                           &err);
            for (size_t r = 0; r < KVPT_COUNT_OF(runs); r++) {
                size_t count = runs[r][0];
                size_t threads = runs[r][1];
                memset(&serial, 0, sizeof serial);
                memset(&threaded, 0, sizeof threaded);
                run_sequences(model, all_dtypes[t], bt, kv_heads[k], count, 0, &serial);
                run_sequences(model, all_dtypes[t], bt, kv_heads[k], count, threads, &threaded);
                assert_same_run(&serial, &threaded, count, bt);
                if (threads > 1 && count < threads) {
                    /*
                     * Every posted phase was held until another thread took a
                     * part; per layer, the softmax (S_HEADS rows) of each step
                     * and of the prompt's token 0, and the two phases of the
                     * prompt's one block (tokens 1..S_PROMPT-1), at least.
                     */
                    assert_true(threaded.assisted >= count * S_LAYERS * (1 + 2 + S_STEPS));
                } else if (threads == 1) {
                    assert_int_equal(threaded.assisted, 0);
                }
            }
            kvpt_destroy_model(model);
        }
    }
    kvpi_gather_grain_set(NULL);
}

/* A step refused for want of pages after its attention ran assisted changes nothing. */
static void test_parallel_refused_step_changes_nothing(void **state)
{
    (void)state;
    enum { BT = 4, PROMPT = 8 };
    kvpi_gather_grain_set(&finest);
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create_random_grouped(S_LAYERS, S_WIDTH, S_HEADS, 2, 16, 10000.0, 5,
                                                   &model, &err),
                   &err);
    /* Exactly the prompt's pages: the next token needs a new block in every layer. */
    kvp_pool *pool = kvpt_dtype_pool(BT, 2, S_HEAD_WIDTH, S_LAYERS * PROMPT / BT, KVP_F32);
    kvp_sequence *seq = kvpt_sequence(model, pool, 1, 16);
    double prompt[PROMPT * S_WIDTH];
    kvpt_fill_random(prompt, PROMPT * S_WIDTH, 3);
    kvp_decoder *decoder = kvpt_decoder(2);
    kvpi_decoder_hold_tasks(decoder, SIZE_MAX);
    kvp_decode_job job = {.sequence = seq,
                          .input = kvp_tensor3(prompt, 1, PROMPT, S_WIDTH),
                          .kind = KVP_JOB_PREFILL};
    kvpt_assert_ok(kvp_decoder_step(decoder, &job, 1, NULL, NULL, &err), &err);
    kvpt_assert_ok(job.status, &job.error);
    kvpt_assert_pool_ok(pool);

    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, seq);
    kvpt_snapshot_take(&before);
    uint64_t assisted = kvpi_decoder_assisted_parts(decoder);
    double row[S_WIDTH];
    double out[S_WIDTH];
    kvpt_fill_random(row, S_WIDTH, 4);
    kvpt_fill(out, S_WIDTH, 7.0);
    job = (kvp_decode_job){.sequence = seq,
                           .input = kvp_tensor3(row, 1, 1, S_WIDTH),
                           .output = out,
                           .output_len = S_WIDTH,
                           .kind = KVP_JOB_STEP};
    kvpt_assert_ok(kvp_decoder_step(decoder, &job, 1, NULL, NULL, &err), &err);
    assert_int_equal(job.status, KVP_POOL_EXHAUSTED);
    assert_int_equal(job.error.status, KVP_POOL_EXHAUSTED);
    /* The attention of both layers ran, helped, before the pages were refused. */
    assert_true(kvpi_decoder_assisted_parts(decoder) - assisted >= S_LAYERS);
    kvpt_assert_unchanged(&before, 1);
    kvpt_assert_filled(out, S_WIDTH, 7.0);

    kvpt_destroy_decoder(decoder);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
    kvpi_gather_grain_set(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parallel_executor_runs_every_part_once),
        cmocka_unit_test(test_parallel_run_refused_while_stepping),
        cmocka_unit_test_teardown(test_parallel_partition_is_exact, teardown_grain),
        cmocka_unit_test_teardown(test_parallel_uneven_kv_heads_split_exactly, teardown_grain),
        cmocka_unit_test_teardown(test_parallel_decoder_is_bit_identical, teardown_grain),
        cmocka_unit_test_teardown(test_parallel_refused_step_changes_nothing, teardown_grain),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
