/*
 * test_sequence_step.c: multi-layer steps and prefill — steps of 1 to 3
 * layers, 1 or 2 lanes and blocks of 1, 3 and 16 positions matched within
 * 1e-12 against a layer-by-layer full-prefix reference (the residual stream
 * and a custom next-input function), with exact page counts; all-or-nothing
 * steps (pool exhaustion, a prepare error in a later layer, input errors
 * naming layer 0) leaving every layer's rows and page tables and the pool
 * byte-identical; prefill equal to the reference and, bit for bit, to single
 * steps, reserving all its pages up front, its full and shape errors
 * changing nothing, and rolled back on a non-finite score with the free
 * list order restored. Shares helpers with the other test_sequence*.c
 * programs (sequence_support.h). Leaks of a failed step are caught by the
 * memcheck run of this program (ctest). Unit test: uses pager/alloc.h and
 * serve/sequence_internal.h.
 */
#include "sequence_support.h"

/* ---- steps against the reference --------------------------------------------- */

static void run_step_case(size_t layers, size_t batch, size_t block_tokens, int half)
{
    enum { T = 7 };
    const size_t d = MODEL_WIDTH;
    const size_t total = layers * batch * KVPT_CEIL_DIV(T, block_tokens);
    kvp_pool *pool = make_pool(block_tokens, total); /* exactly enough pages */
    kvp_model *model = make_model(layers, 100 + 10 * layers + batch);
    kvp_sequence *seq = kvpt_sequence(model, pool, batch, T);
    const size_t n = batch * T * d;
    double *inputs = kvpt_doubles(n);
    kvpt_fill_random(inputs, n, 1000 + 100 * layers + 10 * batch + block_tokens);
    double *expected = kvpt_doubles(n);
    double *keys = kvpt_doubles(layers * n);
    double *values = kvpt_doubles(layers * n);
    sequence_reference(model, inputs, batch, T, half, expected, keys, values);
    next_calls calls = {layers, batch * d, 0, 0};
    kvp_next_input_fn fn = half ? half_residual : NULL;
    double out[MAX_BATCH * MODEL_WIDTH + 1];
    kvp_error err;
    kvp_error untouched;
    for (size_t t = 0; t < T; t++) {
        memset(&err, 0x5A, sizeof err);
        memcpy(&untouched, &err, sizeof err);
        out[batch * d] = 42.0;
        kvpt_assert_ok(step_token(seq, inputs, batch, T, t, fn, &calls, out, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_memory_equal(&err, &untouched, sizeof err); /* success leaves err alone */
        assert_true(out[batch * d] == 42.0);                /* and writes only [B, 1, D] */
        for (size_t b = 0; b < batch; b++) {
            assert_close_rows(out + b * d, expected + (b * T + t) * d, d);
        }
        size_t len = t + 1;
        assert_int_equal(kvp_sequence_len(seq), len);
        for (size_t l = 0; l < layers; l++) {
            assert_int_equal(kvp_cache_len(kvp_sequence_cache(seq, l)), len);
        }
        size_t held = layers * batch * KVPT_CEIL_DIV(len, block_tokens);
        assert_int_equal(kvp_sequence_held_pages(seq), held);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, held);
        assert_int_equal(stats.free_pages, total - held);
        assert_int_equal(stats.acquires, held);
        assert_int_equal(stats.releases, 0);
        assert_int_equal(stats.attached_reservations, 0);
        assert_int_equal(stats.attached_caches, layers);
        if (half) {
            assert_int_equal(calls.calls, layers * len);
            assert_int_equal(calls.wrong, 0);
        }
    }
    /* Each layer's cache holds the reference's rotated keys and values of that layer's input. */
    double *snap = kvpt_doubles(n);
    for (size_t l = 0; l < layers; l++) {
        const kvp_cache *cache = kvp_sequence_cache(seq, l);
        kvpt_assert_ok(kvp_cache_keys(cache, snap, n, &err), &err);
        assert_close_rows(snap, keys + l * n, n);
        kvpt_assert_ok(kvp_cache_values(cache, snap, n, &err), &err);
        assert_close_rows(snap, values + l * n, n);
    }
    /* Full: layer 0 refuses the next step, and nothing changes. */
    seq_state before;
    seq_state_capture(seq, pool, &before);
    out[0] = 42.0;
    assert_int_equal(step_token(seq, inputs, batch, T, 0, fn, &calls, out, &err), KVP_FULL);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.layer, 0);
    assert_int_equal(err.capacity, T);
    kvpt_assert_error_text(&err, "KV cache is full at capacity 7");
    assert_true(out[0] == 42.0);
    if (half) {
        assert_int_equal(calls.calls, layers * T);
    }
    assert_seq_unchanged(&before, seq, pool, 0);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
    free(inputs);
    free(expected);
    free(keys);
    free(values);
    free(snap);
}

/* run_step_case for 1 to 3 layers, batch 1 and 2, and blocks of 1, 3 and 16 positions. */
static void run_step_cases(int half)
{
    static const size_t blocks[] = {1, 3, 16};
    for (size_t layers = 1; layers <= 3; layers++) {
        for (size_t batch = 1; batch <= 2; batch++) {
            for (size_t i = 0; i < KVPT_COUNT_OF(blocks); i++) {
                run_step_case(layers, batch, blocks[i], half);
            }
        }
    }
}

static void test_sequence_step_matches_layer_by_layer_reference(void **state)
{
    (void)state;
    run_step_cases(0);
}

static void test_sequence_step_custom_next_input_matches_reference(void **state)
{
    (void)state;
    run_step_cases(1);
}

/* ---- all-or-nothing steps -------------------------------------------------------- */

static void test_sequence_step_pool_exhausted_changes_nothing(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 8 };
    const size_t d = MODEL_WIDTH;
    /* seq's first block, other's first block, and one page short of seq's second. */
    kvp_pool *pool = make_pool(BT, L * B + L * 1 + (L * B - 1));
    kvp_model *model = make_model(L, 31);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    kvp_sequence *other = kvpt_sequence(model, pool, 1, C);
    double inputs[B * C * MODEL_WIDTH];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 32);
    double other_row[MODEL_WIDTH];
    kvpt_fill_random(other_row, d, 33);
    double expected[B * C * MODEL_WIDTH];
    sequence_reference(model, inputs, B, C, 0, expected, NULL, NULL);
    double out[B * MODEL_WIDTH];
    kvp_error err;
    for (size_t t = 0; t < 2; t++) {
        kvpt_assert_ok(step_token(seq, inputs, B, C, t, NULL, NULL, out, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    kvpt_assert_ok(step_token(other, other_row, 1, 1, 0, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).free_pages, L * B - 1);
    promise(seq, pool, 2);

    seq_state before;
    seq_state other_before;
    seq_state_capture(seq, pool, &before);
    seq_state_capture(other, pool, &other_before);
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    assert_int_equal(step_token(seq, inputs, B, C, 2, NULL, NULL, out, &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.status, KVP_POOL_EXHAUSTED);
    assert_int_equal(err.needed, L * B);
    assert_int_equal(err.available, L * B - 1);
    assert_int_equal(err.layer, SIZE_MAX);
    kvpt_assert_error_text(&err, "page pool exhausted: 4 pages needed, 3 free");
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    assert_int_equal(kvpt_stats(pool).attached_reservations, 0);
    assert_seq_unchanged(&before, seq, pool, 1);
    assert_seq_unchanged(&other_before, other, pool, 1);

    /* Once `other` gives its pages back the same step succeeds, and matches the reference. */
    kvpt_destroy_sequence(other, pool);
    kvpt_assert_ok(step_token(seq, inputs, B, C, 2, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    for (size_t b = 0; b < B; b++) {
        assert_close_rows(out + b * d, expected + (b * C + 2) * d, d);
    }
    assert_int_equal(kvp_sequence_len(seq), 3);
    assert_int_equal(kvp_sequence_held_pages(seq), 2 * L * B);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0); /* 4 taken, 2 promised */
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static void test_sequence_step_prepare_error_in_later_layer_changes_nothing(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 6 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 12);
    kvp_model *model = make_model(L, 41);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double inputs[B * C * MODEL_WIDTH];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 42);
    double out[B * MODEL_WIDTH];
    kvp_error err;
    for (size_t t = 0; t < 2; t++) { /* len 2: the next step opens a block */
        kvpt_assert_ok(step_token(seq, inputs, B, C, t, NULL, NULL, out, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    promise(seq, pool, 3);

    /* An in-place update of layer 1's W_v (same values, newer revision). */
    kvp_param *param = kvp_model_param_mut(model, 1, KVP_PARAM_VALUE);
    assert_int_equal(kvp_param_revision(param), 0);
    kvpt_assert_ok(kvp_param_update_with(param, keep_values, NULL, &err), &err);
    assert_int_equal(kvp_param_revision(param), 1);

    /* Twice: layer 0's ticket was discarded, so the retry fails the same way, at layer 1. */
    for (int attempt = 0; attempt < 2; attempt++) {
        seq_state before;
        seq_state_capture(seq, pool, &before);
        kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
        memset(&err, 0, sizeof err);
        assert_int_equal(step_token(seq, inputs, B, C, 2, NULL, NULL, out, &err),
                         KVP_CACHE_LAYER_REVISION_MISMATCH);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(err.layer, 1);
        assert_int_equal(err.parameter, KVP_PARAM_VALUE);
        assert_int_equal(err.cache_revision, 0);
        assert_int_equal(err.layer_revision, 1);
        kvpt_assert_error_text(&err,
                               "KV cache parameter revision 0 at stable index 2 does not match "
                               "layer revision 1");
        kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
        assert_int_equal(kvpt_stats(pool).attached_reservations, 0);
        assert_seq_unchanged(&before, seq, pool, 0);
    }

    /* Prefill fails on its first token at layer 1, before it takes any page. */
    {
        enum { T = 3 };
        double prompt[B * T * MODEL_WIDTH];
        slice_tokens(inputs, B, C, 2, T, prompt);
        kvp_tensor view = kvp_tensor3(prompt, B, T, d);
        size_t reserved = kvp_sequence_pages_for(seq, 2 + T);
        assert_int_equal(reserved, L * B * (KVPT_CEIL_DIV(2 + T, BT) - 1));
        seq_state before;
        double prefill_out[B * T * MODEL_WIDTH];
        kvpt_fill(prefill_out, KVPT_COUNT_OF(prefill_out), 7.0);
        seq_state_capture(seq, pool, &before);
        assert_int_equal(kvp_sequence_prefill(seq, &view, NULL, NULL, prefill_out,
                                              KVPT_COUNT_OF(prefill_out), &err),
                         KVP_CACHE_LAYER_REVISION_MISMATCH);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(err.layer, 1);
        assert_int_equal(err.token, 0);
        kvpt_assert_filled(prefill_out, KVPT_COUNT_OF(prefill_out), 7.0);
        assert_seq_unchanged(&before, seq, pool, 0);
        assert_int_equal(kvpt_stats(pool).promised_pages, 3);
    }

    /* Layer 0 is validated first: its own revision error names layer 0. */
    kvp_param *query0 = kvp_model_param_mut(model, 0, KVP_PARAM_QUERY);
    kvpt_assert_ok(kvp_param_update_with(query0, keep_values, NULL, &err), &err);
    seq_state before;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(step_token(seq, inputs, B, C, 2, NULL, NULL, out, &err),
                     KVP_CACHE_LAYER_REVISION_MISMATCH);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.layer, 0);
    assert_int_equal(err.parameter, KVP_PARAM_QUERY);
    assert_seq_unchanged(&before, seq, pool, 0);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * One refused step, or prefill, writing to an output buffer of `output_len`
 * values: the status, output untouched, nothing changed.
 */
static void expect_refused(kvp_sequence *seq, kvp_pool *pool, int prefill, const kvp_tensor *input,
                           size_t output_len, kvp_status status, kvp_error *err)
{
    double out[2 * 4 * (MODEL_WIDTH + 1)];
    assert_true(output_len <= KVPT_COUNT_OF(out));
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    seq_state before;
    seq_state_capture(seq, pool, &before);
    memset(err, 0x5A, sizeof *err);
    kvp_status got = prefill ? kvp_sequence_prefill(seq, input, NULL, NULL, out, output_len, err)
                             : kvp_sequence_step(seq, input, NULL, NULL, out, output_len, err);
    assert_int_equal(got, status);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err->status, status);
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    assert_seq_unchanged(&before, seq, pool, 0);
}

/* A refused step of a batch-2 sequence (expect_refused), naming layer 0. */
static void expect_step_refused(kvp_sequence *seq, kvp_pool *pool, const kvp_tensor *input,
                                kvp_status status, kvp_error *err)
{
    expect_refused(seq, pool, 0, input, 2 * MODEL_WIDTH, status, err);
    assert_int_equal(err->layer, 0);
}

static void test_sequence_step_input_errors_name_layer_zero(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 3, C = 4 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 8);
    kvp_model *model = make_model(L, 51);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double data[(B + 1) * 2 * (MODEL_WIDTH + 1)];
    kvpt_fill_random(data, KVPT_COUNT_OF(data), 52);
    double out[B * MODEL_WIDTH];
    kvp_error err;
    kvpt_assert_ok(step_token(seq, data, B, 1, 0, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);

    kvp_tensor rank2 = kvp_tensor3(data, B, 1, d);
    rank2.shape.rank = 2;
    rank2.shape.dims[1] = d;
    expect_step_refused(seq, pool, &rank2, KVP_INPUT_RANK, &err);
    assert_int_equal(err.rank, 2);
    kvp_tensor two_tokens = kvp_tensor3(data, B, 2, d);
    expect_step_refused(seq, pool, &two_tokens, KVP_SINGLE_TOKEN_REQUIRED, &err);
    assert_int_equal(err.tokens, 2);
    kvp_tensor wide_batch = kvp_tensor3(data, B + 1, 1, d);
    expect_step_refused(seq, pool, &wide_batch, KVP_INPUT_BATCH_MISMATCH, &err);
    assert_int_equal(err.expected_size, B);
    assert_int_equal(err.actual_size, B + 1);
    kvp_tensor wide = kvp_tensor3(data, B, 1, d + 1);
    expect_step_refused(seq, pool, &wide, KVP_INPUT_WIDTH_MISMATCH, &err);
    assert_int_equal(err.expected_size, d);
    assert_int_equal(err.actual_size, d + 1);
    /* A NaN in lane 1 makes that lane's query non-finite. */
    double bad[B * MODEL_WIDTH];
    memcpy(bad, data, sizeof bad);
    bad[d] = NAN;
    kvp_tensor nan_row = kvp_tensor3(bad, B, 1, d);
    expect_step_refused(seq, pool, &nan_row, KVP_NONFINITE_PROJECTION, &err);
    assert_string_equal(err.what, "query");
    assert_int_equal(err.index, d);

    /* The step's own argument errors. */
    kvp_tensor good = kvp_tensor3(data, B, 1, d);
    seq_state before;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_step(NULL, &good, NULL, NULL, out, B * d, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "sequence");
    assert_int_equal(kvp_sequence_step(seq, NULL, NULL, NULL, out, B * d, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "input");
    kvp_tensor no_data = kvp_tensor3(NULL, B, 1, d);
    assert_int_equal(kvp_sequence_step(seq, &no_data, NULL, NULL, out, B * d, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "input");
    assert_int_equal(kvp_sequence_step(seq, &good, NULL, NULL, NULL, B * d, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "output");
    assert_int_equal(kvp_sequence_step(seq, &good, NULL, NULL, out, B * d - 1, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_string_equal(err.argument, "output");
    assert_int_equal(err.needed, B * d);
    assert_int_equal(err.available, B * d - 1);
    kvpt_assert_pool_ok(pool);
    assert_seq_unchanged(&before, seq, pool, 0);

    /* The sequence still steps. */
    kvpt_assert_ok(kvp_sequence_step(seq, &good, NULL, NULL, out, B * d, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 2);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- prefill ------------------------------------------------------------------ */

/*
 * kv_heads < HEADS runs a grouped (MQA) model: its pools store kv_heads heads
 * per page, and everything below holds the same way.
 */
static void run_prefill_case(size_t layers, size_t batch, size_t block_tokens, int half,
                             size_t kv_heads)
{
    enum { T = 7, FIRST = 3 };
    const size_t d = MODEL_WIDTH;
    const size_t pages = layers * batch * KVPT_CEIL_DIV(T, block_tokens);
    kvp_pool *pool_a = kvpt_pool(block_tokens, kv_heads, HEAD_WIDTH, pages);
    kvp_pool *pool_b = kvpt_pool(block_tokens, kv_heads, HEAD_WIDTH, pages);
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create_random_grouped(layers, MODEL_WIDTH, HEADS, kv_heads,
                                                   MAX_POSITIONS, ROPE_BASE,
                                                   300 + 10 * layers + batch, &model, &err),
                   &err);
    kvp_model_info info;
    kvp_model_info_init(&info);
    kvpt_assert_ok(kvp_model_info_get(model, &info, &err), &err);
    assert_int_equal(info.heads, HEADS);
    assert_int_equal(info.kv_heads, kv_heads);
    kvp_sequence *a = kvpt_sequence(model, pool_a, batch, T);
    kvp_sequence *b = kvpt_sequence(model, pool_b, batch, T);
    const size_t n = batch * T * d;
    double *inputs = kvpt_doubles(n);
    kvpt_fill_random(inputs, n, 3000 + 100 * layers + 10 * batch + block_tokens);
    double *expected = kvpt_doubles(n);
    sequence_reference(model, inputs, batch, T, half, expected, NULL, NULL);
    kvp_next_input_fn fn = half ? half_residual : NULL;
    next_calls calls = {layers, batch * d, 0, 0};

    /* The whole prompt at once. */
    double *out_a = kvpt_doubles(n);
    out_a[n] = 42.0;
    kvp_tensor prompt = kvp_tensor3(inputs, batch, T, d);
    assert_int_equal(kvp_sequence_pages_for(a, T), pages);
    kvpt_assert_ok(kvp_sequence_prefill(a, &prompt, fn, &calls, out_a, n, &err), &err);
    kvpt_assert_pool_ok(pool_a);
    assert_true(out_a[n] == 42.0);
    assert_close_rows(out_a, expected, n);
    assert_int_equal(kvp_sequence_len(a), T);
    assert_int_equal(kvp_sequence_held_pages(a), pages);
    kvp_pool_stats stats = kvpt_stats(pool_a);
    assert_int_equal(stats.held_pages, pages);
    assert_int_equal(stats.acquires, pages);
    assert_int_equal(stats.releases, 0);
    assert_int_equal(stats.attached_reservations, 0);
    if (half) {
        assert_int_equal(calls.calls, layers * T);
        assert_int_equal(calls.wrong, 0);
    }

    /* T single steps on a twin pool: the same outputs, rows and physical pages, bit for bit. */
    double out_b[MAX_BATCH * MODEL_WIDTH];
    calls.calls = 0;
    for (size_t t = 0; t < T; t++) {
        kvpt_assert_ok(step_token(b, inputs, batch, T, t, fn, &calls, out_b, &err), &err);
        kvpt_assert_pool_ok(pool_b);
        for (size_t lane = 0; lane < batch; lane++) {
            assert_memory_equal(out_b + lane * d, out_a + (lane * T + t) * d, d * sizeof(double));
        }
    }
    kvpt_assert_same_rows(a, b);
    uint32_t pages_a[MAX_LAYERS * 2 * T];
    uint32_t pages_b[MAX_LAYERS * 2 * T];
    size_t count = sequence_pages(a, pages_a, KVPT_COUNT_OF(pages_a));
    assert_int_equal(count, pages);
    assert_int_equal(sequence_pages(b, pages_b, KVPT_COUNT_OF(pages_b)), count);
    assert_memory_equal(pages_a, pages_b, count * sizeof *pages_a);

    /* In two pieces, the second starting mid-block, the first with no output buffer. */
    kvpt_assert_ok(kvp_sequence_reset(a, &err), &err);
    kvpt_assert_pool_ok(pool_a);
    double *piece = kvpt_doubles(n);
    slice_tokens(inputs, batch, T, 0, FIRST, piece);
    kvp_tensor head = kvp_tensor3(piece, batch, FIRST, d);
    kvpt_assert_ok(kvp_sequence_prefill(a, &head, fn, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool_a);
    assert_int_equal(kvp_sequence_len(a), FIRST);
    slice_tokens(inputs, batch, T, FIRST, T - FIRST, piece);
    kvp_tensor tail = kvp_tensor3(piece, batch, T - FIRST, d);
    double *out_tail = kvpt_doubles(n);
    kvpt_assert_ok(kvp_sequence_prefill(a, &tail, fn, NULL, out_tail, batch * (T - FIRST) * d,
                                        &err),
                   &err);
    kvpt_assert_pool_ok(pool_a);
    for (size_t lane = 0; lane < batch; lane++) {
        assert_memory_equal(out_tail + lane * (T - FIRST) * d, out_a + (lane * T + FIRST) * d,
                            (T - FIRST) * d * sizeof(double));
    }
    kvpt_assert_same_rows(a, b);
    assert_int_equal(sequence_pages(a, pages_a, KVPT_COUNT_OF(pages_a)), count);
    assert_memory_equal(pages_a, pages_b, count * sizeof *pages_a);

    kvpt_destroy_sequence(a, pool_a);
    kvpt_destroy_sequence(b, pool_b);
    kvpt_destroy_pool(pool_a);
    kvpt_destroy_pool(pool_b);
    kvpt_destroy_model(model);
    free(inputs);
    free(expected);
    free(out_a);
    free(piece);
    free(out_tail);
}

static void test_sequence_prefill_matches_reference_and_single_steps(void **state)
{
    (void)state;
    run_prefill_case(1, 2, 16, 0, HEADS);
    run_prefill_case(2, 2, 3, 0, HEADS);
    run_prefill_case(3, 1, 1, 0, HEADS);
    run_prefill_case(2, 2, 3, 1, HEADS);
    run_prefill_case(3, 2, 1, 1, HEADS);
    /* Multi-query: one KV head per page serves both query heads. */
    run_prefill_case(2, 2, 3, 0, 1);
    run_prefill_case(3, 2, 1, 1, 1);
}

static void test_sequence_prefill_pool_exhausted_reserves_up_front(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 8 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 7);
    kvp_model *model = make_model(L, 61);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double inputs[B * C * MODEL_WIDTH];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 62);
    double prompt[B * C * MODEL_WIDTH];
    double out[B * C * MODEL_WIDTH];
    kvp_error err;
    promise(seq, pool, 1);

    /* 3 tokens need 8 pages; 7 are free. Its first two tokens would fit, but none runs. */
    slice_tokens(inputs, B, C, 0, 3, prompt);
    kvp_tensor three = kvp_tensor3(prompt, B, 3, d);
    seq_state before;
    seq_state_capture(seq, pool, &before);
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    assert_int_equal(kvp_sequence_prefill(seq, &three, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.needed, 8);
    assert_int_equal(err.available, 7);
    assert_int_equal(err.layer, SIZE_MAX);
    kvpt_assert_error_text(&err, "page pool exhausted: 8 pages needed, 7 free");
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    assert_seq_unchanged(&before, seq, pool, 1);

    /* Two tokens fit: 4 pages, the first drawn from the promise. */
    slice_tokens(inputs, B, C, 0, 2, prompt);
    kvp_tensor two = kvp_tensor3(prompt, B, 2, d);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &two, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_held_pages(seq), 4);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);

    /* At a block boundary with 3 free, one more token (4 pages) fails, by prefill or step. */
    slice_tokens(inputs, B, C, 2, 1, prompt);
    kvp_tensor one = kvp_tensor3(prompt, B, 1, d);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_prefill(seq, &one, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                     KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.needed, 4);
    assert_int_equal(err.available, 3);
    assert_seq_unchanged(&before, seq, pool, 1);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(step_token(seq, inputs, B, C, 2, NULL, NULL, out, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.needed, 4);
    assert_seq_unchanged(&before, seq, pool, 1);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static void expect_prefill_refused(kvp_sequence *seq, kvp_pool *pool, const kvp_tensor *prompt,
                                   size_t output_len, kvp_status status, kvp_error *err)
{
    expect_refused(seq, pool, 1, prompt, output_len, status, err);
}

static void test_sequence_prefill_full_and_shape_errors_change_nothing(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 5 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 12);
    kvp_model *model = make_model(L, 71);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double data[(B + 1) * 4 * (MODEL_WIDTH + 1)];
    kvpt_fill_random(data, KVPT_COUNT_OF(data), 72);
    kvp_error err;
    kvp_tensor three = kvp_tensor3(data, B, 3, d);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &three, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 3);

    /* len 3 + 3 > 5. */
    expect_prefill_refused(seq, pool, &three, B * 3 * d, KVP_FULL, &err);
    assert_int_equal(err.capacity, C);
    assert_int_equal(err.layer, SIZE_MAX);
    assert_int_equal(err.tokens, 3);
    assert_int_equal(err.available, 2);
    assert_string_equal(err.what, "prompt");
    kvpt_assert_error_text(&err, "prompt of 3 tokens does not fit: 2 of capacity 5 left");
    kvp_tensor none = kvp_tensor3(data, B, 0, d);
    expect_prefill_refused(seq, pool, &none, 0, KVP_INVALID_ARGUMENT, &err);
    assert_string_equal(err.argument, "prompt");
    kvp_tensor rank2 = kvp_tensor3(data, B, 1, d);
    rank2.shape.rank = 2;
    expect_prefill_refused(seq, pool, &rank2, B * d, KVP_INPUT_RANK, &err);
    assert_int_equal(err.rank, 2);
    assert_int_equal(err.layer, SIZE_MAX);
    kvpt_assert_error_text(&err, "prefill prompt must have rank three "
                                 "[batch, tokens, model_width], got rank 2");
    kvp_tensor wide_batch = kvp_tensor3(data, B + 1, 1, d);
    expect_prefill_refused(seq, pool, &wide_batch, (B + 1) * d, KVP_INPUT_BATCH_MISMATCH, &err);
    assert_int_equal(err.expected_size, B);
    assert_int_equal(err.actual_size, B + 1);
    kvp_tensor wide = kvp_tensor3(data, B, 1, d + 1);
    expect_prefill_refused(seq, pool, &wide, B * (d + 1), KVP_INPUT_WIDTH_MISMATCH, &err);
    assert_int_equal(err.expected_size, d);
    assert_int_equal(err.actual_size, d + 1);
    kvp_tensor two = kvp_tensor3(data, B, 2, d);
    expect_prefill_refused(seq, pool, &two, B * 2 * d - 1, KVP_BUFFER_TOO_SMALL, &err);
    assert_string_equal(err.argument, "output");
    assert_int_equal(err.needed, B * 2 * d);
    assert_int_equal(err.available, B * 2 * d - 1);
    seq_state before;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_prefill(NULL, &two, NULL, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "sequence");
    assert_int_equal(kvp_sequence_prefill(seq, NULL, NULL, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "prompt");
    kvp_tensor no_data = kvp_tensor3(NULL, B, 2, d);
    assert_int_equal(kvp_sequence_prefill(seq, &no_data, NULL, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    kvpt_assert_pool_ok(pool);
    assert_seq_unchanged(&before, seq, pool, 0);

    /* Exactly the room left fits; then even one token is FULL. */
    kvpt_assert_ok(kvp_sequence_prefill(seq, &two, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), C);
    kvp_tensor one = kvp_tensor3(data, B, 1, d);
    expect_prefill_refused(seq, pool, &one, B * d, KVP_FULL, &err);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/*
 * A prefill whose token BAD overflows a score (DBL_MAX rows through identity
 * weights) is undone: every layer back to its starting length with its rows
 * and page tables, the reserved and the already used pages back, the promise
 * back, and the free list back in its order, so the next prefill receives the
 * pages the failed one did (checked against a twin pool that never failed).
 */
static void test_sequence_prefill_nonfinite_score_rolls_back_everything(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 3, C = 12, START = 2, T = 7, BAD = 4 };
    const size_t d = MODEL_WIDTH;
    const size_t pages = L * B * KVPT_CEIL_DIV(C, BT) + 2;
    kvp_pool *pool_a = make_pool(BT, pages);
    kvp_pool *pool_b = make_pool(BT, pages);
    kvp_model *model = identity_model(L);
    kvp_sequence *a = kvpt_sequence(model, pool_a, B, C);
    kvp_sequence *b = kvpt_sequence(model, pool_b, B, C);
    double start[B * START * MODEL_WIDTH];
    kvpt_fill_random(start, KVPT_COUNT_OF(start), 81);
    double prompt[B * T * MODEL_WIDTH];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 82);
    double bad[B * T * MODEL_WIDTH];
    memcpy(bad, prompt, sizeof bad);
    for (size_t j = 0; j < d; j++) {
        bad[(1 * T + BAD) * d + j] = DBL_MAX; /* lane 1, token BAD */
    }
    kvp_error err;
    kvp_tensor start_view = kvp_tensor3(start, B, START, d);
    kvpt_assert_ok(kvp_sequence_prefill(a, &start_view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool_a);
    kvpt_assert_ok(kvp_sequence_prefill(b, &start_view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool_b);
    promise(a, pool_a, 5);
    promise(b, pool_b, 5);

    /* Tokens 0..3 commit (block 1 is mapped), block 2 is still reserved at the failure. */
    size_t reserved = kvp_sequence_pages_for(a, START + T);
    assert_int_equal(reserved, L * B * (KVPT_CEIL_DIV(START + T, BT) - 1));
    double out[B * T * MODEL_WIDTH];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    seq_state before;
    seq_state_capture(a, pool_a, &before);
    kvp_tensor bad_view = kvp_tensor3(bad, B, T, d);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(a, &bad_view, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                     KVP_NONFINITE_SCORE);
    kvpt_assert_pool_ok(pool_a);
    assert_int_equal(err.status, KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, BAD);
    assert_int_equal(err.layer, 0);
    /* Lane 1, head 0, the first of START + BAD + 1 keys. */
    assert_int_equal(err.index, 1 * HEADS * (START + BAD + 1));
    assert_false(isfinite(err.value));
    /* The documented exception: tokens before BAD wrote their rows, the rest is untouched. */
    double failed[B * T * MODEL_WIDTH];
    memcpy(failed, out, sizeof failed);
    for (size_t lane = 0; lane < B; lane++) {
        kvpt_assert_filled(failed + (lane * T + BAD) * d, (T - BAD) * d, 7.0);
        assert_true(failed[lane * T * d] != 7.0);
    }
    assert_seq_unchanged(&before, a, pool_a, 0);
    assert_int_equal(kvp_sequence_len(a), START);
    assert_int_equal(kvp_sequence_promised_pages(a), 5);
    assert_int_equal(kvpt_stats(pool_a).promised_pages, 5);
    assert_int_equal(kvpt_stats(pool_a).attached_reservations, 0);
    assert_int_equal(kvpt_stats(pool_a).free_pages, kvpt_stats(pool_b).free_pages);

    /* The good prompt: same outputs, rows and physical pages as on the pool that never failed. */
    kvp_tensor good = kvp_tensor3(prompt, B, T, d);
    double out_b[B * T * MODEL_WIDTH];
    kvpt_assert_ok(kvp_sequence_prefill(a, &good, NULL, NULL, out, KVPT_COUNT_OF(out), &err), &err);
    kvpt_assert_pool_ok(pool_a);
    kvpt_assert_ok(kvp_sequence_prefill(b, &good, NULL, NULL, out_b, KVPT_COUNT_OF(out_b), &err),
                   &err);
    kvpt_assert_pool_ok(pool_b);
    assert_memory_equal(out, out_b, sizeof out);
    for (size_t lane = 0; lane < B; lane++) { /* the same tokens on the same state */
        assert_memory_equal(failed + lane * T * d, out + lane * T * d, BAD * d * sizeof(double));
    }
    kvpt_assert_same_rows(a, b);
    uint32_t pages_a[L * B * KVPT_CEIL_DIV(C, BT)];
    uint32_t pages_b[L * B * KVPT_CEIL_DIV(C, BT)];
    size_t count = sequence_pages(a, pages_a, KVPT_COUNT_OF(pages_a));
    assert_int_equal(count, L * B * KVPT_CEIL_DIV(START + T, BT));
    assert_int_equal(sequence_pages(b, pages_b, KVPT_COUNT_OF(pages_b)), count);
    assert_memory_equal(pages_a, pages_b, count * sizeof *pages_a);
    assert_int_equal(kvp_sequence_promised_pages(a), 0);

    kvpt_destroy_sequence(a, pool_a);
    kvpt_destroy_sequence(b, pool_b);
    kvpt_destroy_pool(pool_a);
    kvpt_destroy_pool(pool_b);
    kvpt_destroy_model(model);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequence_step_matches_layer_by_layer_reference),
        cmocka_unit_test(test_sequence_step_custom_next_input_matches_reference),
        cmocka_unit_test(test_sequence_step_pool_exhausted_changes_nothing),
        cmocka_unit_test(test_sequence_step_prepare_error_in_later_layer_changes_nothing),
        cmocka_unit_test(test_sequence_step_input_errors_name_layer_zero),
        cmocka_unit_test(test_sequence_prefill_matches_reference_and_single_steps),
        cmocka_unit_test(test_sequence_prefill_pool_exhausted_reserves_up_front),
        cmocka_unit_test(test_sequence_prefill_full_and_shape_errors_change_nothing),
        cmocka_unit_test(test_sequence_prefill_nonfinite_score_rolls_back_everything),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
