/*
 * test_prefill.c: the blocked prefill (src/attention/prefill.c, the blocks
 * of kvpi_sequence_prefill_on) against the token-by-token prefill.
 *
 * Every case runs the same history on two pools: once with blocks of
 * `want` tokens (kvpi_sequence_prefill_block_set), once token by token
 * (want 0), and asserts the same bits: outputs, logical K/V rows, physical
 * pages, cache digests and pool counters. Covered: f64, f32 and bf16 pages;
 * MHA, a group of 2 and MQA; page sizes 1, 7 and 16; prompts shorter than,
 * equal to and spanning several pages; into an empty cache and after steps;
 * blocks of 1, 5 and 64 tokens. Errors (a score overflow in a block, an
 * earlier token failing at a later layer than a later token, a NaN input,
 * POOL_EXHAUSTED) give the same status, err.token, err.layer and details,
 * and change nothing (the pool audit after every call, counters, caches,
 * length, pages held and promised); the next prefill takes the same pages.
 * The decoder's prefill jobs on 1 and 2 threads, with the assist forced
 * (held tasks), give the same bits.
 * Unit test: uses serve/sequence_internal.h, serve/decoder_internal.h and
 * attention/gather.h (test hooks).
 */
#include "support.h"

#include <math.h>
#include <string.h>

#include "attention/gather.h"
#include "serve/decoder_internal.h"
#include "serve/sequence_internal.h"

enum { LAYERS = 2, WIDTH = 16, HEADS = 4, HEAD_WIDTH = 4, BATCH = 2, CAPACITY = 48 };
enum { MAX_PAGES = LAYERS * BATCH * CAPACITY };

#define BASE 10000.0

static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};

static int restore_hooks(void **state)
{
    (void)state;
    kvpi_sequence_prefill_block_set(KVPI_PREFILL_BLOCK_DEFAULT);
    kvpi_gather_grain_set(NULL);
    return 0;
}

static kvp_model *make_model(size_t kv_heads, uint64_t seed)
{
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create_random_grouped(LAYERS, WIDTH, HEADS, kv_heads, CAPACITY, BASE,
                                                   seed, &model, &err),
                   &err);
    return model;
}

/* What a sequence and its pool show: compared between the two modes, or before/after. */
typedef struct seq_view {
    size_t len;
    size_t held;
    size_t promised;
    kvp_pool_stats stats;
    uint64_t digests[LAYERS];
    uint32_t pages[LAYERS][BATCH][CAPACITY];
} seq_view;

static void view_of(const kvp_sequence *seq, kvp_pool *pool, seq_view *v)
{
    memset(v, 0, sizeof *v);
    kvp_error err;
    kvpt_assert_pool_ok(pool);
    v->len = kvp_sequence_len(seq);
    v->held = kvp_sequence_held_pages(seq);
    v->promised = kvp_sequence_promised_pages(seq);
    v->stats = kvpt_stats(pool);
    for (size_t l = 0; l < LAYERS; l++) {
        const kvp_cache *cache = kvp_sequence_cache(seq, l);
        kvpt_assert_ok(kvp_cache_digest(cache, &v->digests[l], &err), &err);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
        size_t blocks = KVPT_CEIL_DIV(v->len, info.block_tokens);
        for (size_t b = 0; b < BATCH; b++) {
            for (size_t k = 0; k < blocks; k++) {
                kvpt_assert_ok(kvp_cache_page(cache, b, k, &v->pages[l][b][k], &err), &err);
            }
        }
    }
}

static void assert_same_view(const seq_view *a, const seq_view *b)
{
    assert_int_equal(a->len, b->len);
    assert_int_equal(a->held, b->held);
    assert_int_equal(a->promised, b->promised);
    kvp_pool_stats sa = a->stats;
    kvp_pool_stats sb = b->stats;
    sa.slab_address = sb.slab_address = 0; /* two pools, two slabs */
    assert_memory_equal(&sa, &sb, sizeof sa);
    assert_memory_equal(a->digests, b->digests, sizeof a->digests);
    assert_memory_equal(a->pages, b->pages, sizeof a->pages);
}

/* The fields of an error a caller reads. */
static void assert_same_error(const kvp_error *a, const kvp_error *b)
{
    assert_int_equal(a->status, b->status);
    assert_int_equal(a->token, b->token);
    assert_int_equal(a->layer, b->layer);
    assert_true((a->what == NULL) == (b->what == NULL));
    if (a->what != NULL) {
        assert_string_equal(a->what, b->what);
    }
    assert_int_equal(a->index, b->index);
    assert_memory_equal(&a->value, &b->value, sizeof a->value);
    assert_int_equal(a->tokens, b->tokens);
    assert_int_equal(a->available, b->available);
}

/* `steps` single steps, then nothing else: the history before a prefill. */
static void run_steps(kvp_sequence *seq, kvp_pool *pool, size_t steps, uint64_t seed)
{
    kvp_error err;
    for (size_t s = 0; s < steps; s++) {
        double x[BATCH * WIDTH];
        double out[BATCH * WIDTH];
        kvpt_fill_random(x, KVPT_COUNT_OF(x), seed + s);
        kvp_tensor view = kvp_tensor3(x, BATCH, 1, WIDTH);
        kvpt_assert_ok(kvp_sequence_step(seq, &view, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                       &err);
        kvpt_assert_pool_ok(pool);
    }
}

/* One history on a fresh pool and sequence: steps, then the prompt, with blocks of `want`. */
typedef struct run {
    kvp_pool *pool;
    kvp_sequence *seq;
    kvp_status status;
    kvp_error err;
    double out[BATCH * CAPACITY * WIDTH];
    seq_view view;
} run;

static void run_open(run *r, const kvp_model *model, kvp_dtype dtype, size_t bt, size_t kv_heads,
                     size_t pages, size_t steps)
{
    memset(r, 0, sizeof *r);
    r->pool = kvpt_dtype_pool(bt, kv_heads, HEAD_WIDTH, pages, dtype);
    r->seq = kvpt_sequence(model, r->pool, BATCH, CAPACITY);
    run_steps(r->seq, r->pool, steps, 500);
}

static void run_prefill(run *r, const double *prompt, size_t tokens, size_t want)
{
    kvpi_sequence_prefill_block_set(want);
    kvp_tensor view = kvp_tensor3((double *)prompt, BATCH, tokens, WIDTH);
    memset(&r->err, 0x5A, sizeof r->err);
    for (size_t i = 0; i < KVPT_COUNT_OF(r->out); i++) {
        r->out[i] = -7.0; /* untouched rows keep it */
    }
    r->status = kvp_sequence_prefill(r->seq, &view, NULL, NULL, r->out, KVPT_COUNT_OF(r->out),
                                     &r->err);
    kvpi_sequence_prefill_block_set(KVPI_PREFILL_BLOCK_DEFAULT);
    view_of(r->seq, r->pool, &r->view);
}

static void run_close(run *r)
{
    kvpt_destroy_sequence(r->seq, r->pool);
    kvpt_destroy_pool(r->pool);
}

/* Blocked (want) and token by token (0) on the same history: the same everything. */
static void assert_modes_agree(const kvp_model *model, kvp_dtype dtype, size_t bt,
                               size_t kv_heads, size_t steps, const double *prompt,
                               size_t tokens, size_t want, size_t pages)
{
    static run blocked;
    static run single;
    run_open(&blocked, model, dtype, bt, kv_heads, pages, steps);
    run_open(&single, model, dtype, bt, kv_heads, pages, steps);
    run_prefill(&single, prompt, tokens, 0);
    run_prefill(&blocked, prompt, tokens, want);
    assert_int_equal(blocked.status, single.status);
    if (single.status != KVP_OK) {
        assert_same_error(&blocked.err, &single.err);
    }
    assert_memory_equal(blocked.out, single.out, sizeof blocked.out);
    assert_same_view(&blocked.view, &single.view);
    kvpt_assert_same_rows(blocked.seq, single.seq);
    run_close(&blocked);
    run_close(&single);
}

static void test_prefill_blocks_equal_token_by_token(void **state)
{
    (void)state;
    static const size_t kv_heads[] = {HEADS, 2, 1};
    static const size_t page_sizes[] = {1, 7, 16};
    static const size_t lengths[] = {5, 7, 16, 37};
    static const size_t wants[] = {1, 5, 64};
    static const size_t histories[] = {0, 3};
    static double prompt[BATCH * CAPACITY * WIDTH];
    size_t cases = 0;
    for (size_t k = 0; k < KVPT_COUNT_OF(kv_heads); k++) {
        kvp_model *model = make_model(kv_heads[k], 70 + k);
        for (size_t t = 0; t < KVPT_COUNT_OF(dtypes); t++) {
            for (size_t p = 0; p < KVPT_COUNT_OF(page_sizes); p++) {
                for (size_t n = 0; n < KVPT_COUNT_OF(lengths); n++) {
                    for (size_t h = 0; h < KVPT_COUNT_OF(histories); h++) {
                        size_t tokens = lengths[n];
                        kvpt_fill_random(prompt, BATCH * tokens * WIDTH, 900 + n + 10 * t);
                        /* Every block size on one case in three (by index): all sizes
                         * meet every page size, dtype and grouping. */
                        for (size_t w = 0; w < KVPT_COUNT_OF(wants); w++) {
                            if ((k + t + p + n + h + w) % 3 != 0 && wants[w] != 64) {
                                continue;
                            }
                            assert_modes_agree(model, dtypes[t], page_sizes[p], kv_heads[k],
                                               histories[h], prompt, tokens, wants[w],
                                               MAX_PAGES);
                            cases++;
                        }
                    }
                }
            }
        }
        kvpt_destroy_model(model);
    }
    assert_true(cases >= 3 * 3 * 3 * 4 * 2);
}

/*
 * fp8 pages under K and V scales other than 1: blocked prefill applies them
 * as a step's gather does (scores times scale * k_scale, outputs times
 * v_scale), so both modes still agree bit for bit; and a model built from a
 * layer keeps its scales and its accumulation level.
 */
static kvp_model *fp8_model(kvp_accum accum)
{
    kvp_error err;
    kvp_layer *layer = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(WIDTH, HEADS, 2, CAPACITY, BASE, 71, &layer,
                                                   &err),
                   &err);
    kvpt_assert_ok(kvp_layer_set_kv_scales(layer, 0.375, 3.0, &err), &err);
    kvpt_assert_ok(kvp_layer_set_accum(layer, accum, &err), &err);
    kvp_model *model = kvpt_model_of_one_layer(layer, LAYERS);
    for (size_t l = 0; l < LAYERS; l++) {
        kvp_binding binding;
        kvpt_assert_ok(kvp_layer_binding_get(kvp_model_layer(model, l), &binding, &err), &err);
        assert_true(binding.k_scale == 0.375 && binding.v_scale == 3.0);
        kvp_layer_info info;
        kvp_layer_info_init(&info);
        kvpt_assert_ok(kvp_layer_info_get(kvp_model_layer(model, l), &info, &err), &err);
        assert_int_equal(info.accum, accum);
    }
    return model;
}

static void test_prefill_fp8_scales_equal_token_by_token(void **state)
{
    (void)state;
    static double prompt[BATCH * CAPACITY * WIDTH];
    static const size_t lengths[] = {7, 37};
    /* The blocked prefill is exact at both levels; token by token a fast layer is fast. */
    kvpt_destroy_model(fp8_model(KVP_ACCUM_FAST));
    kvp_model *model = fp8_model(KVP_ACCUM_EXACT);
    for (size_t n = 0; n < KVPT_COUNT_OF(lengths); n++) {
        kvpt_fill_random(prompt, BATCH * lengths[n] * WIDTH, 950 + n);
        assert_modes_agree(model, KVP_FP8_E4M3, 4, 2, 3, prompt, lengths[n], 64, MAX_PAGES);
        assert_modes_agree(model, KVP_FP8_E4M3, 16, 2, 0, prompt, lengths[n], 5, MAX_PAGES);
    }
    kvpt_destroy_model(model);
}

/*
 * The bits do not depend on the block size either: blocks of 1, 2, 5, 16 and
 * 64 tokens give the outputs of blocks of 3, for every dtype.
 */
static void test_prefill_bits_do_not_depend_on_block_size(void **state)
{
    (void)state;
    static const size_t wants[] = {1, 2, 5, 16, 64};
    static double prompt[BATCH * CAPACITY * WIDTH];
    enum { T = 40, STEPS = 2, BT = 7 };
    kvp_model *model = make_model(2, 91);
    kvpt_fill_random(prompt, BATCH * T * WIDTH, 92);
    for (size_t t = 0; t < KVPT_COUNT_OF(dtypes); t++) {
        static run base;
        static run other;
        run_open(&base, model, dtypes[t], BT, 2, MAX_PAGES, STEPS);
        run_prefill(&base, prompt, T, 3);
        kvpt_assert_ok(base.status, &base.err);
        for (size_t w = 0; w < KVPT_COUNT_OF(wants); w++) {
            run_open(&other, model, dtypes[t], BT, 2, MAX_PAGES, STEPS);
            run_prefill(&other, prompt, T, wants[w]);
            kvpt_assert_ok(other.status, &other.err);
            assert_memory_equal(other.out, base.out, sizeof base.out);
            assert_same_view(&other.view, &base.view);
            kvpt_assert_same_rows(other.seq, base.seq);
            run_close(&other);
        }
        run_close(&base);
    }
    kvpt_destroy_model(model);
}

/*
 * A failed prefill in both modes: the same error, nothing changed (against
 * the view before the call, and the pool audit), output rows before the
 * failing token equal, and a good prefill afterwards takes the same pages.
 */
static void assert_failure_agrees(const kvp_model *model, kvp_dtype dtype, size_t kv_heads,
                                  size_t pages, size_t steps, const double *prompt,
                                  size_t tokens, kvp_status expected, const kvp_error *want_err)
{
    static run blocked;
    static run single;
    run_open(&blocked, model, dtype, 4, kv_heads, pages, steps);
    run_open(&single, model, dtype, 4, kv_heads, pages, steps);
    seq_view before;
    view_of(blocked.seq, blocked.pool, &before);
    run_prefill(&single, prompt, tokens, 0);
    run_prefill(&blocked, prompt, tokens, 64);
    assert_int_equal(single.status, expected);
    assert_int_equal(blocked.status, expected);
    assert_same_error(&blocked.err, &single.err);
    if (want_err != NULL) {
        assert_int_equal(blocked.err.token, want_err->token);
        assert_int_equal(blocked.err.layer, want_err->layer);
    }
    assert_memory_equal(blocked.out, single.out, sizeof blocked.out);
    assert_same_view(&blocked.view, &single.view);
    /* Nothing changed: the exhaustion counter is the one that counts refusals. */
    seq_view after = blocked.view;
    if (expected == KVP_POOL_EXHAUSTED) {
        after.stats.exhaustions = before.stats.exhaustions;
    }
    assert_same_view(&after, &before);
    /* The next prefill (a good prompt) takes the same pages in both. */
    double good[BATCH * 9 * WIDTH];
    kvpt_fill_random(good, KVPT_COUNT_OF(good), 777);
    if (expected != KVP_POOL_EXHAUSTED) {
        run_prefill(&single, good, 9, 0);
        run_prefill(&blocked, good, 9, 64);
        kvpt_assert_ok(blocked.status, &blocked.err);
        kvpt_assert_ok(single.status, &single.err);
        assert_memory_equal(blocked.out, single.out, sizeof blocked.out);
        assert_same_view(&blocked.view, &single.view);
    }
    run_close(&blocked);
    run_close(&single);
}

/* Token-by-token's error for `prompt`, on a fresh history (the reference). */
static kvp_error reference_error(const kvp_model *model, kvp_dtype dtype, size_t kv_heads,
                                 size_t steps, const double *prompt, size_t tokens)
{
    static run r;
    run_open(&r, model, dtype, 4, kv_heads, MAX_PAGES, steps);
    run_prefill(&r, prompt, tokens, 0);
    kvp_error e = r.err;
    e.status = r.status;
    run_close(&r);
    return e;
}

static void scale_token(double *prompt, size_t tokens, size_t lane, size_t t, double scale)
{
    for (size_t j = 0; j < WIDTH; j++) {
        prompt[(lane * tokens + t) * WIDTH + j] *= scale;
    }
}

static void test_prefill_errors_match_token_by_token(void **state)
{
    (void)state;
    enum { T = 20, STEPS = 3 };
    static double prompt[BATCH * T * WIDTH];
    kvp_model *model = make_model(2, 33);
    kvp_error want = {0};

    /* Lane 1's token 9 overflows its scores in layer 0: (9, 0), in the first block. */
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 34);
    for (size_t j = 0; j < WIDTH; j++) {
        prompt[(1 * T + 9) * WIDTH + j] = (j % 2) ? -1e156 : 1e156;
    }
    want.token = 9;
    want.layer = 0;
    for (size_t t = 0; t < KVPT_COUNT_OF(dtypes); t++) {
        kvp_status expected = dtypes[t] == KVP_F64 ? KVP_NONFINITE_SCORE : KVP_NONFINITE_KEY;
        assert_failure_agrees(model, dtypes[t], 2, MAX_PAGES, STEPS, prompt, T, expected, &want);
    }

    /*
     * An earlier token failing at a later layer: scale lane 0's token 4 (over
     * a few random fills) until token by token fails it at layer 1 (an f32
     * key out of range; its layer 0 passes), then make token 12 fail at
     * layer 0. The blocked layer 0 meets token 12 first; the
     * reported error must still be (4, 1), the first in token-major order.
     */
    int found = 0;
    for (uint64_t seed = 35; seed < 75 && !found; seed++) {
        for (double scale = 1e38; scale < 2e39 && !found; scale *= 1.05) {
            kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), seed);
            scale_token(prompt, T, 0, 4, scale);
            kvp_error e = reference_error(model, KVP_F32, 2, STEPS, prompt, T);
            if (e.status != KVP_OK && e.token == 4 && e.layer == 1) {
                found = 1;
            }
        }
    }
    assert_true(found);
    for (size_t j = 0; j < WIDTH; j++) {
        prompt[(1 * T + 12) * WIDTH + j] = 1e39; /* f32 cannot hold its key */
    }
    kvp_error late = reference_error(model, KVP_F32, 2, STEPS, prompt, T);
    want.token = 4;
    want.layer = 1;
    assert_failure_agrees(model, KVP_F32, 2, MAX_PAGES, STEPS, prompt, T, late.status, &want);

    /* A NaN at a middle token: layer 0's query projection of token 11, before any page. */
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 36);
    prompt[(0 * T + 11) * WIDTH + 3] = NAN;
    want.token = 11;
    want.layer = 0;
    assert_failure_agrees(model, KVP_F64, 2, MAX_PAGES, STEPS, prompt, T,
                          KVP_NONFINITE_PROJECTION, &want);

    /* Too few pages for the prompt: POOL_EXHAUSTED (err.layer SIZE_MAX), nothing taken. */
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 37);
    size_t steps_pages = LAYERS * BATCH * KVPT_CEIL_DIV(STEPS, 4);
    want.token = 0;
    want.layer = SIZE_MAX;
    assert_failure_agrees(model, KVP_F64, 2, steps_pages + 2, STEPS, prompt, T,
                          KVP_POOL_EXHAUSTED, NULL);
    kvpt_destroy_model(model);
}

/*
 * Prefill jobs on a decoder of 1 and 2 threads, at the finest gather grain
 * (every block's phases are posted) with the assist forced (held tasks: a
 * posted phase waits until the other thread took a part): the bits of
 * kvp_sequence_prefill on this thread.
 */
static void test_prefill_on_decoder_threads(void **state)
{
    (void)state;
    enum { T = 30, BT = 4 };
    static double prompt[BATCH * T * WIDTH];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 55);
    kvpi_gather_grain g = kvpi_gather_grain_get();
    g.min_parallel_bytes = 0;
    for (size_t t = 0; t < KVPT_COUNT_OF(dtypes); t++) {
        kvp_model *model = make_model(1, 56 + t);
        static run serial;
        run_open(&serial, model, dtypes[t], BT, 1, MAX_PAGES, 2);
        run_prefill(&serial, prompt, T, 64);
        kvpt_assert_ok(serial.status, &serial.err);
        for (size_t threads = 1; threads <= 2; threads++) {
            static run threaded;
            run_open(&threaded, model, dtypes[t], BT, 1, MAX_PAGES, 2);
            kvp_decoder *decoder = kvpt_decoder(threads);
            kvpi_decoder_hold_tasks(decoder, SIZE_MAX);
            kvpi_gather_grain_set(&g);
            kvp_decode_job job;
            memset(&job, 0, sizeof job);
            job.sequence = threaded.seq;
            job.kind = KVP_JOB_PREFILL;
            job.input = kvp_tensor3(prompt, BATCH, T, WIDTH);
            job.output = threaded.out;
            job.output_len = KVPT_COUNT_OF(threaded.out);
            kvp_error err;
            kvpt_assert_ok(kvp_decoder_step(decoder, &job, 1, NULL, NULL, &err), &err);
            kvpt_assert_ok(job.status, &job.error);
            kvpi_gather_grain_set(NULL);
            uint64_t assisted = kvpi_decoder_assisted_parts(decoder);
            kvpi_decoder_hold_tasks(decoder, 0);
            kvpt_destroy_decoder(decoder);
            if (threads == 1) {
                assert_int_equal(assisted, 0);
            } else {
                /* Per layer, the block's two phases (4 parts each) were posted and helped. */
                assert_true(assisted >= LAYERS * 2);
            }
            for (size_t i = BATCH * T * WIDTH; i < KVPT_COUNT_OF(threaded.out); i++) {
                threaded.out[i] = -7.0; /* run_prefill's fill beyond the prompt */
            }
            view_of(threaded.seq, threaded.pool, &threaded.view);
            assert_memory_equal(threaded.out, serial.out, sizeof serial.out);
            assert_same_view(&threaded.view, &serial.view);
            kvpt_assert_same_rows(threaded.seq, serial.seq);
            run_close(&threaded);
        }
        run_close(&serial);
        kvpt_destroy_model(model);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_prefill_blocks_equal_token_by_token, restore_hooks),
        cmocka_unit_test_teardown(test_prefill_bits_do_not_depend_on_block_size, restore_hooks),
        cmocka_unit_test_teardown(test_prefill_fp8_scales_equal_token_by_token, restore_hooks),
        cmocka_unit_test_teardown(test_prefill_errors_match_token_by_token, restore_hooks),
        cmocka_unit_test_teardown(test_prefill_on_decoder_threads, restore_hooks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
