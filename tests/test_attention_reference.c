/*
 * test_attention_reference.c: RoPE and the full-prefix reference — RoPE
 * against values computed by hand; the reference's own errors writing
 * nothing (allocation failures included); the reference reporting the
 * incremental path's non-finite errors the same way; each part of the RoPE
 * comparison and of the ticket's fit checked on its own. Invariant: a
 * refusal leaves the cache, the pool and the caller's buffers as they were.
 * Shares the seed's fixture with the other test_attention*.c programs
 * (attention_support.h). Unit test (ctest test_attention_reference,
 * memcheck.test_attention_reference in release): uses internal headers
 * (pager/alloc.h, pager/cache_internal.h).
 */
#include "attention_support.h"

/* ---- RoPE against values computed by hand ---------------------------------------- */

/*
 * One head of d_h = 4 with identity W_q, W_k, W_v, W_o and base 100, so
 * theta_0 = 1 and theta_1 = 100^(-2/4) = 0.1: at position p the pair
 * (x0, x1) turns by p radians and (x2, x3) by p / 10. The stored keys, the
 * weights and the outputs of three tokens are literals computed in closed
 * form outside the library (k_p = R(p) x_p pair by pair; score_j = k_t . k_j
 * / 2; softmax; output = sum_j w_j x_j), so a pairing or rotation mistake
 * that reference and incremental attention share cannot hide here.
 */
static void test_attention_rope_by_hand(void **state)
{
    (void)state;
    enum { W = 4, TOKENS = 3 };
    static const double identity[W * W] = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1};
    const double *const w[KVP_PARAM_COUNT] = {identity, identity, identity, identity};
    kvp_layer *layer = kvpt_layer_from_matrices(W, w, 1, 8, 100.0);
    kvp_pool *pool = kvpt_pool(2, 1, W, 4);
    kvp_cache *cache = cache_for(pool, layer, 1, 4);
    kvp_ticket *ticket = kvpt_ticket(cache);
    static const double x[TOKENS][W] = {{1, 0.5, -1, 2}, {0.5, 1, 2, -1}, {-1, 1, 0.5, 0.25}};
    /* R(p) x_p: x1 turned by (1, 0.1), x2 by (2, 0.2). */
    static const double keys[TOKENS][W] = {
        {1, 0.5, -1, 2},
        {-0.57131983187382662, 0.96103779827208802, 2.0898417472028799, -0.79533733198436951},
        {-0.4931505902785393, -1.3254442633728241, 0.44036595622185548, 0.34435130985784101},
    };
    static const double weights[TOKENS][TOKENS] = {
        {1},
        {0.0066223627631103593, 0.99337763723688954},
        {0.13647612182974675, 0.18074729372030277, 0.68277658444995049},
    };
    static const double outputs[TOKENS][W] = {
        {1, 0.5, -1, 2},
        {0.50331118138155517, 0.99668881861844472, 1.9801329117106687, -0.98013291171066885},
        {-0.45592681576005234, 0.93176193908512661, 0.56640675783583405, 0.26289909605167838},
    };
    /* The closed form of one literal, spelled out: token 1's first key element. */
    kvpt_assert_close(keys[1][0], 0.5 * cos(1.0) - 1.0 * sin(1.0), 1e-15);
    kvpt_assert_close(keys[1][3], 2.0 * sin(0.1) - 1.0 * cos(0.1), 1e-15);
    for (size_t t = 0; t < TOKENS; t++) {
        kvp_tensor input = kvp_tensor3((double *)x[t], 1, 1, W);
        forward_ok(layer, &input, cache, pool, ticket);
        kvp_attention_result result = result_of(ticket);
        assert_int_equal(result.keys, t + 1);
        for (size_t j = 0; j <= t; j++) {
            kvpt_assert_close(result.weights[j], weights[t][j], 1e-12);
        }
        for (size_t f = 0; f < W; f++) {
            kvpt_assert_close(result.output[f], outputs[t][f], 1e-12);
        }
    }
    double stored[TOKENS * W];
    kvp_error err;
    kvpt_assert_ok(kvp_cache_keys(cache, stored, KVPT_COUNT_OF(stored), &err), &err);
    for (size_t t = 0; t < TOKENS; t++) {
        for (size_t f = 0; f < W; f++) {
            kvpt_assert_close(stored[t * W + f], keys[t][f], 1e-12);
        }
    }
    /* The full-prefix reference agrees with the same literals. */
    double all[TOKENS * W];
    double out[TOKENS * W];
    memcpy(all, x, sizeof all);
    kvp_tensor prompt = kvp_tensor3(all, 1, TOKENS, W);
    kvpt_assert_ok(kvp_attention_reference(layer, &prompt, out, KVPT_COUNT_OF(out), stored, NULL,
                                           KVPT_COUNT_OF(stored), &err),
                   &err);
    for (size_t t = 0; t < TOKENS; t++) {
        for (size_t f = 0; f < W; f++) {
            kvpt_assert_close(out[t * W + f], outputs[t][f], 1e-12);
            kvpt_assert_close(stored[t * W + f], keys[t][f], 1e-12);
        }
    }
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}
/* ---- the reference's own errors -------------------------------------------------------- */

static void test_attention_reference_errors_write_nothing(void **state)
{
    (void)state;
    kvp_layer *layer = fixture_layer();
    double input[9 * D] = {0};
    double out[9 * D];
    double keys[9 * D];
    double sentinel[9 * D];
    memset(sentinel, 0xA5, sizeof sentinel);
    memcpy(out, sentinel, sizeof out);
    memcpy(keys, sentinel, sizeof keys);
    kvp_error err;

    kvp_tensor good = kvp_tensor3(input, 1, 3, D);
    assert_int_equal(kvp_attention_reference(NULL, &good, out, 12, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layer");
    assert_int_equal(kvp_attention_reference(layer, NULL, out, 12, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "input");
    kvp_tensor no_data = kvp_tensor3(NULL, 1, 3, D);
    assert_int_equal(kvp_attention_reference(layer, &no_data, out, 12, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "input");
    assert_int_equal(kvp_attention_reference(layer, &good, NULL, 12, NULL, NULL, 0, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "output");

    static const struct {
        size_t rank;
        size_t dims[3];
        const char *text;
    } shapes[] = {
        {3, {1, 1, 3},
         "full-prefix attention input must have shape [batch, tokens, 4] with nonzero batch "
         "and tokens, got [1, 1, 3]"},
        {3, {0, 2, 4},
         "full-prefix attention input must have shape [batch, tokens, 4] with nonzero batch "
         "and tokens, got [0, 2, 4]"},
        {3, {1, 0, 4},
         "full-prefix attention input must have shape [batch, tokens, 4] with nonzero batch "
         "and tokens, got [1, 0, 4]"},
        {2, {3, 4, 0},
         "full-prefix attention input must have shape [batch, tokens, 4] with nonzero batch "
         "and tokens, got [3, 4]"},
    };
    for (size_t i = 0; i < KVPT_COUNT_OF(shapes); i++) {
        kvp_tensor bad = {input, {shapes[i].rank, {shapes[i].dims[0], shapes[i].dims[1],
                                                   shapes[i].dims[2]}}};
        assert_int_equal(kvp_attention_reference(layer, &bad, out, KVPT_COUNT_OF(out), NULL, NULL,
                                                 0, &err),
                         KVP_REFERENCE_INPUT_SHAPE);
        kvpt_assert_error_text(&err, shapes[i].text);
        assert_int_equal(err.model_width, D);
        assert_int_equal(err.actual.rank, shapes[i].rank);
    }

    /* More tokens than RoPE positions: the last position is out of range. */
    kvp_tensor too_long = kvp_tensor3(input, 1, 9, D);
    assert_int_equal(kvp_attention_reference(layer, &too_long, out, KVPT_COUNT_OF(out), NULL, NULL,
                                             0, &err),
                     KVP_ROPE_POSITION_OUT_OF_RANGE);
    kvpt_assert_error_text(&err, "RoPE position 8 is out of range for 8 positions");
    assert_int_equal(err.position, 8);

    /* Buffers. */
    assert_int_equal(kvp_attention_reference(layer, &good, out, 11, NULL, NULL, 0, &err),
                     KVP_BUFFER_TOO_SMALL);
    kvpt_assert_error_text(&err, "buffer `output` holds 11 values but 12 are needed");
    assert_int_equal(kvp_attention_reference(layer, &good, out, 12, keys, NULL, 10, &err),
                     KVP_BUFFER_TOO_SMALL);
    kvpt_assert_error_text(&err, "buffer `keys` holds 10 values but 12 are needed");
    assert_int_equal(kvp_attention_reference(layer, &good, out, 12, NULL, keys, 0, &err),
                     KVP_BUFFER_TOO_SMALL);
    kvpt_assert_error_text(&err, "buffer `values` holds 0 values but 12 are needed");

    /* An allocation failure, through the injector. */
    kvpt_fault_step s;
    kvpt_fault_step_arm(&s, 1);
    kvpt_fault_step_finish(&s,
                           kvp_attention_reference(layer, &good, out, 12, NULL, NULL, 0, &s.err));
    assert_true(s.fired);
    kvpt_assert_fault_failed(&s, 1);
    char text[128];
    snprintf(text, sizeof text, "cannot allocate full-prefix attention scratch (%zu bytes)",
             /* q, k, v and outputs; one token's rows; [B, H, T] scores; one merged row */
             (4 * 12 + D + H * 3 + D) * sizeof(double));
    kvpt_assert_error_text(&s.err, text);

    assert_memory_equal(out, sentinel, sizeof out);
    assert_memory_equal(keys, sentinel, sizeof keys);

    /* Exactly max_positions tokens are fine. */
    kvp_tensor eight = kvp_tensor3(input, 1, 8, D);
    kvpt_assert_ok(kvp_attention_reference(layer, &eight, out, 8 * D, NULL, NULL, 0, &err), &err);
    kvpt_destroy_layer(layer);
}

/* ---- the reference reports the incremental path's non-finite errors ---------- */

/* The same double, NaN for NaN. */
static int same_value(double a, double b)
{
    return (isnan(a) && isnan(b)) || a == b;
}

/*
 * Runs input [batch, tokens, width] through `layer` both ways: the reference
 * at once, and token by token with prepare and commit on a fresh cache. Both
 * must succeed with the same outputs, or fail with the same status, what,
 * index and value at the same token (err.token for the reference). Returns
 * the status.
 */
static kvp_status compare_paths(const kvp_layer *layer, const double *input, size_t batch,
                                size_t tokens)
{
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    size_t d = info.model_width;
    kvp_pool *pool = kvpt_pool(2, info.heads, info.head_width, batch * tokens);
    kvp_cache *cache = kvpt_cache(pool, &binding, batch, tokens);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *reference = kvpt_doubles(batch * tokens * d);
    kvpt_fill(reference, batch * tokens * d, 7.0);
    kvp_tensor all = kvp_tensor3(input, batch, tokens, d);
    kvp_error ref_err;
    memset(&ref_err, 0, sizeof ref_err);
    kvp_status ref_status = kvp_attention_reference(layer, &all, reference, batch * tokens * d,
                                                    NULL, NULL, 0, &ref_err);
    double *row = kvpt_doubles(batch * d);
    kvp_status inc_status = KVP_OK;
    kvp_error inc_err;
    memset(&inc_err, 0, sizeof inc_err);
    size_t failed_token = tokens;
    for (size_t t = 0; t < tokens && inc_status == KVP_OK; t++) {
        for (size_t b = 0; b < batch; b++) {
            memcpy(row + b * d, input + (b * tokens + t) * d, d * sizeof *row);
        }
        kvp_tensor one = kvp_tensor3(row, batch, 1, d);
        inc_status = kvp_attention_forward(layer, &one, cache, ticket, &inc_err);
        if (inc_status != KVP_OK) {
            failed_token = t;
            break;
        }
        kvp_attention_result result;
        kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
        if (ref_status == KVP_OK) {
            for (size_t b = 0; b < batch; b++) {
                assert_memory_equal(result.output + b * d, reference + (b * tokens + t) * d,
                                    d * sizeof(double));
            }
        }
    }
    assert_int_equal(ref_status, inc_status);
    if (ref_status != KVP_OK) {
        assert_int_equal(ref_err.status, inc_err.status);
        assert_int_equal(ref_err.token, failed_token);
        assert_int_equal(ref_err.index, inc_err.index);
        assert_true(same_value(ref_err.value, inc_err.value));
        assert_true((ref_err.what == NULL) == (inc_err.what == NULL));
        if (ref_err.what != NULL) {
            assert_string_equal(ref_err.what, inc_err.what);
        }
        char ref_text[256];
        char inc_text[256];
        kvp_error_format(&ref_err, ref_text, sizeof ref_text);
        kvp_error_format(&inc_err, inc_text, sizeof inc_text);
        assert_string_equal(ref_text, inc_text);
        /* Nothing written on error. */
        kvpt_assert_filled(reference, batch * tokens * d, 7.0);
    }
    free(row);
    free(reference);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    return ref_status;
}

static void test_attention_reference_nonfinite_errors_match_incremental(void **state)
{
    (void)state;
    enum { W = 8, HEADS = 2, BATCH = 2, TOKENS = 5 };
    kvp_layer *layer = kvpt_random_layer(W, HEADS, 16, 10000.0, 91);
    double input[BATCH * TOKENS * W];
    /* Each case plants values at (lane, token) and expects this status. */
    typedef struct planted {
        size_t lane, token, column;
        double value;
        int whole_row;
        kvp_status expected;
    } planted;
    const planted cases[] = {
        {1, 2, 3, NAN, 0, KVP_NONFINITE_PROJECTION},
        {0, 0, 0, INFINITY, 0, KVP_NONFINITE_PROJECTION},
        {1, 4, 7, -INFINITY, 0, KVP_NONFINITE_PROJECTION},
        {0, 1, 0, 1e308, 1, KVP_OK},  /* status found below: both paths must agree */
        {1, 3, 0, 1e156, 1, KVP_NONFINITE_SCORE},
        {0, 0, 0, 0.5, 0, KVP_OK},
    };
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        const planted *p = &cases[c];
        kvpt_fill_random(input, KVPT_COUNT_OF(input), 92 + c);
        double *at = input + (p->lane * TOKENS + p->token) * W;
        for (size_t j = 0; j < W; j++) {
            if (p->whole_row || j == p->column) {
                at[j] = (j % 3 == 1) ? -p->value : p->value;
            }
        }
        kvp_status status = compare_paths(layer, input, BATCH, TOKENS);
        if (p->value == 1e308) {
            /* 1e308 rows overflow: a typed non-finite error either way, never OK. */
            assert_true(status == KVP_NONFINITE_PROJECTION || status == KVP_NONFINITE_SCORE ||
                        status == KVP_NONFINITE_OUTPUT);
        } else {
            assert_int_equal(status, p->expected);
        }
    }
    kvpt_destroy_layer(layer);

    /* An output that overflows while scores stay finite: W_q = 0, W_o = 1e300 I. */
    double zero[W * W] = {0};
    double identity[W * W] = {0};
    double big[W * W] = {0};
    for (size_t i = 0; i < W; i++) {
        identity[i * W + i] = 1.0;
        big[i * W + i] = 1e300;
    }
    const double *const w[KVP_PARAM_COUNT] = {zero, identity, identity, big};
    kvp_layer *loud = kvpt_layer_from_matrices(W, w, HEADS, 16, 10000.0);
    kvpt_fill_random(input, KVPT_COUNT_OF(input), 99);
    for (size_t j = 0; j < W; j++) {
        input[(1 * TOKENS + 2) * W + j] = 1e10; /* lane 1, token 2 */
    }
    assert_int_equal(compare_paths(loud, input, BATCH, TOKENS), KVP_NONFINITE_OUTPUT);
    /* The reference says where: token 2, lane 1's first output column. */
    double out[BATCH * TOKENS * W];
    kvp_tensor view = kvp_tensor3(input, BATCH, TOKENS, W);
    kvp_error err;
    assert_int_equal(kvp_attention_reference(loud, &view, out, KVPT_COUNT_OF(out), NULL, NULL, 0,
                                             &err),
                     KVP_NONFINITE_OUTPUT);
    assert_int_equal(err.token, 2);
    assert_int_equal(err.index, 1 * W);
    assert_true(isinf(err.value));
    kvpt_destroy_layer(loud);
}

/*
 * Each part of the RoPE comparison and of the ticket's fit is checked on its
 * own; each refusal leaves the cache, the pool and the fresh ticket as they were.
 */
static void test_attention_rope_and_ticket_fit_each_part(void **state)
{
    (void)state;
    kvp_layer *layer = fixture_layer();
    kvp_binding good;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &good, &err), &err);
    kvp_pool *pool = kvpt_pool(BT, H, HD, 8);
    double x[2 * D] = {0.5, -0.25, 1.0, 0.75, 0.1, 0.2, 0.3, 0.4};
    kvp_tensor one = kvp_tensor3(x, 1, 1, D);

    /* RoPE: feature width, max positions and base bits, one at a time. */
    kvpi_layer_record record = kvpt_record(&good);
    record.rope_feature_width = HD + 2;
    kvp_binding widths = kvpt_rebind(&good, &record);
    record = kvpt_record(&good);
    record.rope_max_positions = MAX_POSITIONS + 1;
    kvp_binding positions = kvpt_rebind(&good, &record);
    record = kvpt_record(&good);
    record.rope_base_bits ^= 1; /* the next double after 10000 */
    kvp_binding base = kvpt_rebind(&good, &record);
    const kvp_binding *ropes[] = {&widths, &positions, &base};
    for (size_t i = 0; i < KVPT_COUNT_OF(ropes); i++) {
        kvp_cache *cache = kvpt_cache(pool, ropes[i], 1, 4);
        kvp_ticket *ticket = kvpt_ticket(cache);
        kvpt_state before;
        kvpt_state_capture(cache, pool, &before);
        assert_int_equal(kvp_attention_forward(layer, &one, cache, ticket, &err),
                         KVP_CACHE_ROPE_MISMATCH);
        assert_int_equal(err.cache_rope.feature_width, kvpt_record(ropes[i]).rope_feature_width);
        assert_int_equal(err.cache_rope.max_positions, kvpt_record(ropes[i]).rope_max_positions);
        assert_int_equal(err.layer_rope.feature_width, HD);
        assert_true(err.layer_rope.base == ROPE_BASE);
        assert_true((err.cache_rope.base == ROPE_BASE) == (i != 2));
        kvpt_assert_state_unchanged(&before, cache, pool, 0);
        kvpt_state_free(&before);
        kvpt_destroy_ticket(ticket, pool);
        kvpt_destroy_cache(cache, pool);
    }

    /* Ticket fit: batch, heads, head width and capacity, one at a time. */
    kvp_cache *cache = kvpt_cache(pool, &good, 1, 4);
    kvp_pool *pool_heads = kvpt_pool(BT, 1, D, 2);  /* 1 head of width 4 */
    kvp_pool *pool_width = kvpt_pool(BT, H, 3, 2);  /* 2 heads of width 3 */
    kvp_binding b_heads = kvpt_binding(1, D, MAX_POSITIONS);
    kvp_binding b_width = kvpt_binding(H, 3, MAX_POSITIONS);
    kvp_cache *wide_batch = kvpt_cache(pool, &good, 2, 4);
    kvp_cache *other_heads = kvpt_cache(pool_heads, &b_heads, 1, 4);
    kvp_cache *other_width = kvpt_cache(pool_width, &b_width, 1, 4);
    kvp_cache *shorter = kvpt_cache(pool, &good, 1, 3);
    kvp_cache *sources[] = {wide_batch, other_heads, other_width, shorter};
    const size_t expect[][4] = {{2, H, HD, 4}, {1, 1, D, 4}, {1, H, 3, 4}, {1, H, HD, 3}};
    for (size_t i = 0; i < KVPT_COUNT_OF(sources); i++) {
        kvp_ticket *ticket = kvpt_ticket(sources[i]);
        kvpt_state before;
        kvpt_state_capture(cache, pool, &before);
        assert_int_equal(kvp_attention_prepare(layer, &one, cache, ticket, &err),
                         KVP_TICKET_GEOMETRY_MISMATCH);
        assert_int_equal(err.batch_size, expect[i][0]);
        assert_int_equal(err.heads, expect[i][1]);
        assert_int_equal(err.head_width, expect[i][2]);
        assert_int_equal(err.capacity, expect[i][3]);
        kvpt_assert_state_unchanged(&before, cache, pool, 0);
        kvpt_state_free(&before);
        kvp_attention_result result;
        assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);
        kvpt_destroy_ticket(ticket, pool);
    }
    kvpt_destroy_cache(shorter, pool);
    kvpt_destroy_cache(other_width, pool_width);
    kvpt_destroy_cache(other_heads, pool_heads);
    kvpt_destroy_cache(wide_batch, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool_width);
    kvpt_destroy_pool(pool_heads);
    kvpt_destroy_pool(pool);

    /* The reference refuses element counts it could not allocate, before reading input. */
    double out[1];
    kvp_tensor overflowing = kvp_tensor3(x, SIZE_MAX / 2, 1, D);
    assert_int_equal(kvp_attention_reference(layer, &overflowing, out, 1, NULL, NULL, 0, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `input` is invalid: element count overflows");
    kvp_tensor huge = kvp_tensor3(x, (size_t)1 << 58, 1, D); /* 2^60 elements: no overflow */
    assert_int_equal(kvp_attention_reference(layer, &huge, out, 1, NULL, NULL, 0, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "input");
    kvpt_destroy_layer(layer);
}

/* ---- grouped-query and multi-query heads ------------------------------------ */

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_rope_and_ticket_fit_each_part),
        cmocka_unit_test(test_attention_reference_nonfinite_errors_match_incremental),
        cmocka_unit_test(test_attention_rope_by_hand),
        cmocka_unit_test_teardown(test_attention_reference_errors_write_nothing, kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
