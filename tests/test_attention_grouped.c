/*
 * test_attention_grouped.c: grouped-query heads (kv_heads 1, heads / 4,
 * heads) — exact against the reference and across block sizes,
 * bit-identical to a multi-head layer with repeated K/V columns, and their
 * validation (each refusal changing nothing). Shares the seed's fixture and
 * checks with the other test_attention*.c programs (attention_support.h).
 * Unit test (ctest test_attention_grouped, memcheck.test_attention_grouped in
 * release): uses internal headers (pager/alloc.h, pager/cache_internal.h).
 */
#include "attention_support.h"

/* H = 8 query heads of width 4: kv_heads 1 (MQA), 2 (groups of 4) and 8 (MHA). */
#define GQ_HEADS 8
#define GQ_HD 4
#define GQ_D (GQ_HEADS * GQ_HD)
#define GQ_BATCH 2
#define GQ_CAPACITY 20

static const size_t gq_kv_heads[] = {1, GQ_HEADS / 4, GQ_HEADS};
static const size_t gq_blocks[] = {1, 3, 16};

/* Everything one run of a layer over GQ_CAPACITY tokens produced. */
typedef struct grouped_run {
    double *outputs;  /* [C][B * D], step by step */
    double *weights;  /* [C][B * H * C]: step t's [B, H, t + 1] weights, zero padded */
    double *keys;     /* [B, H_kv, C, d_h] at the end */
    double *values;
    size_t kv_elements;
} grouped_run;

static void grouped_run_free(grouped_run *r)
{
    free(r->outputs);
    free(r->weights);
    free(r->keys);
    free(r->values);
}

/* The test sequence [B, C, D], the same for every layer and block size. */
static double *grouped_sequence(void)
{
    double *sequence = kvpt_doubles(GQ_BATCH * GQ_CAPACITY * GQ_D);
    kvpt_fill_random(sequence, GQ_BATCH * GQ_CAPACITY * GQ_D, 4242);
    return sequence;
}

/*
 * Decodes the whole sequence through a cache of `layer` on a fresh pool of
 * `block_tokens` pages (KV heads per page), alternating prepare + commit and
 * forward, and checks each step against the full-prefix reference (1e-12)
 * and the retained rows against its K/V bit for bit.
 */
static grouped_run grouped_decode(const kvp_layer *layer, size_t block_tokens)
{
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_error err;
    kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
    size_t b_count = GQ_BATCH;
    size_t c = GQ_CAPACITY;
    size_t d = info.model_width;
    size_t heads = info.heads;
    size_t pages = b_count * KVPT_CEIL_DIV(c, block_tokens);
    kvp_pool *pool = kvpt_pool(block_tokens, info.kv_heads, info.head_width, pages);
    kvp_cache *cache = cache_for(pool, layer, b_count, c);
    kvp_ticket *ticket = kvpt_ticket(cache);

    double *sequence = grouped_sequence();
    size_t rows = b_count * c * d;
    grouped_run run;
    run.kv_elements = b_count * info.kv_heads * c * info.head_width;
    run.outputs = kvpt_doubles(rows);
    run.weights = kvpt_doubles(c * b_count * heads * c);
    run.keys = kvpt_doubles(run.kv_elements);
    run.values = kvpt_doubles(run.kv_elements);
    memset(run.weights, 0, c * b_count * heads * c * sizeof(double));
    double *ref_out = kvpt_doubles(rows);
    double *ref_keys = kvpt_doubles(run.kv_elements);
    double *ref_values = kvpt_doubles(run.kv_elements);
    double *step = kvpt_doubles(b_count * d);
    double *expected = kvpt_doubles(b_count * d);
    kvp_tensor whole = kvp_tensor3(sequence, b_count, c, d);
    kvpt_assert_ok(kvp_attention_reference(layer, &whole, ref_out, rows, ref_keys, ref_values,
                                           run.kv_elements, &err),
                   &err);
    for (size_t t = 0; t < c; t++) {
        for (size_t lane = 0; lane < b_count; lane++) {
            memcpy(step + lane * d, sequence + (lane * c + t) * d, d * sizeof(double));
            memcpy(expected + lane * d, ref_out + (lane * c + t) * d, d * sizeof(double));
        }
        kvp_tensor input = kvp_tensor3(step, b_count, 1, d);
        if (t % 2 == 0) {
            kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, ticket, &err), &err);
            kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
        } else {
            kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
        }
        kvpt_assert_pool_ok(pool);
        kvp_attention_result result = result_of(ticket);
        assert_int_equal(result.heads, heads);
        assert_int_equal(result.keys, t + 1);
        memcpy(run.outputs + t * b_count * d, result.output, b_count * d * sizeof(double));
        memcpy(run.weights + t * b_count * heads * c, result.weights,
               b_count * heads * (t + 1) * sizeof(double));
        double diff = kvpt_max_abs_diff(result.output, expected, b_count * d);
        if (!(diff <= 1e-12)) {
            print_error("kv_heads=%zu block=%zu: step %zu differs from the reference by %g\n",
                        info.kv_heads, block_tokens, t, diff);
            fail();
        }
        /* Pages hold the KV heads only: one per lane per started block. */
        assert_int_equal(kvpt_stats(pool).held_pages,
                         b_count * KVPT_CEIL_DIV(t + 1, block_tokens));
    }
    kvpt_assert_ok(kvp_cache_keys(cache, run.keys, run.kv_elements, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, run.values, run.kv_elements, &err), &err);
    assert_memory_equal(run.keys, ref_keys, run.kv_elements * sizeof(double));
    assert_memory_equal(run.values, ref_values, run.kv_elements * sizeof(double));
    /* The snapshot is exactly [B, H_kv, C, d_h]: one double fewer is refused. */
    assert_int_equal(kvp_cache_keys(cache, run.keys, run.kv_elements - 1, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_int_equal(err.needed, run.kv_elements);

    free(sequence);
    free(ref_out);
    free(ref_keys);
    free(ref_values);
    free(step);
    free(expected);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    return run;
}

static kvp_layer *grouped_random_layer(size_t kv_heads, uint64_t seed)
{
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(GQ_D, GQ_HEADS, kv_heads, GQ_CAPACITY, 500.0,
                                                   seed, &layer, &err),
                   &err);
    kvpt_assert_layer_info(layer, GQ_D, GQ_HEADS, GQ_HD, GQ_CAPACITY, 500.0);
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
    assert_int_equal(info.kv_heads, kv_heads);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    assert_int_equal(kvpt_record(&binding).heads, GQ_HEADS);
    assert_int_equal(binding.kv_heads, kv_heads);
    assert_int_equal(kvp_param_cols(kvp_layer_param(layer, KVP_PARAM_KEY)), kv_heads * GQ_HD);
    assert_int_equal(kvp_param_cols(kvp_layer_param(layer, KVP_PARAM_VALUE)), kv_heads * GQ_HD);
    assert_int_equal(kvp_param_rows(kvp_layer_param(layer, KVP_PARAM_VALUE)), GQ_D);
    assert_int_equal(kvp_param_cols(kvp_layer_param(layer, KVP_PARAM_QUERY)), GQ_D);
    assert_int_equal(kvp_param_cols(kvp_layer_param(layer, KVP_PARAM_OUTPUT)), GQ_D);
    return layer;
}

/*
 * kv_heads 1, 2 (groups of 4) and 8: every step equals the full-prefix
 * reference to 1e-12, the retained K/V are the reference's bit for bit, and
 * outputs, weights and K/V are bit-identical across block sizes 1, 3, 16.
 */
static void test_attention_grouped_match_reference_across_blocks(void **state)
{
    (void)state;
    for (size_t k = 0; k < KVPT_COUNT_OF(gq_kv_heads); k++) {
        kvp_layer *layer = grouped_random_layer(gq_kv_heads[k], 900 + k);
        grouped_run first = grouped_decode(layer, gq_blocks[0]);
        for (size_t b = 1; b < KVPT_COUNT_OF(gq_blocks); b++) {
            grouped_run other = grouped_decode(layer, gq_blocks[b]);
            size_t rows = GQ_CAPACITY * GQ_BATCH * GQ_D;
            size_t weights = GQ_CAPACITY * GQ_BATCH * GQ_HEADS * GQ_CAPACITY;
            assert_memory_equal(other.outputs, first.outputs, rows * sizeof(double));
            assert_memory_equal(other.weights, first.weights, weights * sizeof(double));
            assert_memory_equal(other.keys, first.keys, first.kv_elements * sizeof(double));
            assert_memory_equal(other.values, first.values, first.kv_elements * sizeof(double));
            grouped_run_free(&other);
        }
        grouped_run_free(&first);
        kvpt_destroy_layer(layer);
    }
}

/* W [D x kv_heads*d_h] with each KV head's d_h columns repeated for its `group` query heads. */
static double *repeat_columns(const double *w, size_t kv_heads, size_t group)
{
    size_t kv_width = kv_heads * GQ_HD;
    double *out = kvpt_doubles(GQ_D * GQ_D);
    for (size_t row = 0; row < GQ_D; row++) {
        for (size_t h = 0; h < GQ_HEADS; h++) {
            memcpy(out + row * GQ_D + h * GQ_HD, w + row * kv_width + (h / group) * GQ_HD,
                   GQ_HD * sizeof(double));
        }
    }
    return out;
}

/*
 * The strongest check: a grouped layer computes exactly what a multi-head
 * layer computes when its W_k and W_v repeat each KV head's columns for every
 * query head of the group (the same products, summed in the same order), so
 * outputs and weights agree bit for bit, step by step and in the reference,
 * and the MHA cache's head h holds the grouped cache's KV head h / group.
 */
static void test_attention_grouped_equals_mha_with_repeated_heads(void **state)
{
    (void)state;
    for (size_t k = 0; k < KVPT_COUNT_OF(gq_kv_heads); k++) {
        size_t kv_heads = gq_kv_heads[k];
        size_t group = GQ_HEADS / kv_heads;
        kvp_layer *grouped = grouped_random_layer(kv_heads, 700 + k);
        double *w_key = repeat_columns(kvp_param_values(kvp_layer_param(grouped, KVP_PARAM_KEY)),
                                       kv_heads, group);
        double *w_value = repeat_columns(
            kvp_param_values(kvp_layer_param(grouped, KVP_PARAM_VALUE)), kv_heads, group);
        const double *const w[KVP_PARAM_COUNT] = {
            kvp_param_values(kvp_layer_param(grouped, KVP_PARAM_QUERY)), w_key, w_value,
            kvp_param_values(kvp_layer_param(grouped, KVP_PARAM_OUTPUT))};
        kvp_layer *mha = kvpt_layer_from_matrices(GQ_D, w, GQ_HEADS, GQ_CAPACITY, 500.0);

        grouped_run g = grouped_decode(grouped, 3);
        grouped_run m = grouped_decode(mha, 3);
        size_t rows = GQ_CAPACITY * GQ_BATCH * GQ_D;
        size_t weights = GQ_CAPACITY * GQ_BATCH * GQ_HEADS * GQ_CAPACITY;
        assert_memory_equal(g.outputs, m.outputs, rows * sizeof(double));
        assert_memory_equal(g.weights, m.weights, weights * sizeof(double));
        assert_int_equal(m.kv_elements, g.kv_elements * group);
        for (size_t lane = 0; lane < GQ_BATCH; lane++) {
            for (size_t h = 0; h < GQ_HEADS; h++) {
                size_t run = GQ_CAPACITY * GQ_HD;
                size_t at_m = (lane * GQ_HEADS + h) * run;
                size_t at_g = (lane * kv_heads + h / group) * run;
                assert_memory_equal(m.keys + at_m, g.keys + at_g, run * sizeof(double));
                assert_memory_equal(m.values + at_m, g.values + at_g, run * sizeof(double));
            }
        }
        /* The reference agrees with itself the same way. */
        double *sequence = grouped_sequence();
        double *ref_g = kvpt_doubles(rows);
        double *ref_m = kvpt_doubles(rows);
        kvp_tensor whole = kvp_tensor3(sequence, GQ_BATCH, GQ_CAPACITY, GQ_D);
        kvp_error err;
        kvpt_assert_ok(kvp_attention_reference(grouped, &whole, ref_g, rows, NULL, NULL, 0, &err),
                       &err);
        kvpt_assert_ok(kvp_attention_reference(mha, &whole, ref_m, rows, NULL, NULL, 0, &err),
                       &err);
        assert_memory_equal(ref_g, ref_m, rows * sizeof(double));

        free(sequence);
        free(ref_g);
        free(ref_m);
        grouped_run_free(&g);
        grouped_run_free(&m);
        free(w_key);
        free(w_value);
        kvpt_destroy_layer(mha);
        kvpt_destroy_layer(grouped);
    }
}

/*
 * Validation with grouped heads, each refusal changing nothing: a cache of an
 * MHA layer with the same width and heads is refused by a grouped layer with
 * CacheKvHeadCountMismatch, after the head count and before the head width
 * and the identities; a ticket of another KV head count does not fit; the
 * reference wants [B, H_kv, T, d_h] K/V buffers; cache creation wants
 * kv_heads dividing heads and a pool of kv_heads heads per page.
 */
static void test_attention_grouped_validation(void **state)
{
    (void)state;
    kvp_error err;
    kvp_layer *grouped = grouped_random_layer(2, 31);
    kvp_layer *mha = grouped_random_layer(GQ_HEADS, 32);
    kvp_pool *mha_pool = kvpt_pool(4, GQ_HEADS, GQ_HD, 4);
    kvp_pool *grouped_pool = kvpt_pool(4, 2, GQ_HD, 4);
    kvp_cache *mha_cache = cache_for(mha_pool, mha, 1, 8);
    kvp_cache *grouped_cache = cache_for(grouped_pool, grouped, 1, 8);
    kvp_ticket *mha_ticket = kvpt_ticket(mha_cache);
    kvp_ticket *grouped_ticket = kvpt_ticket(grouped_cache);
    double x[GQ_D];
    kvpt_fill_random(x, GQ_D, 5);
    kvp_tensor input = kvp_tensor3(x, 1, 1, GQ_D);
    /* One committed row each, so the refusals below have rows to keep. */
    forward_ok(mha, &input, mha_cache, mha_pool, mha_ticket);
    forward_ok(grouped, &input, grouped_cache, grouped_pool, grouped_ticket);

    expect_failure(grouped, &input, mha_cache, mha_pool, grouped_ticket,
                   KVP_CACHE_KV_HEAD_COUNT_MISMATCH,
                   "KV cache KV head count 8 must match attention layer KV head count 2", &err);
    assert_int_equal(err.layer_size, 2);
    assert_int_equal(err.cache_size, GQ_HEADS);
    expect_failure(mha, &input, grouped_cache, grouped_pool, mha_ticket,
                   KVP_CACHE_KV_HEAD_COUNT_MISMATCH,
                   "KV cache KV head count 2 must match attention layer KV head count 8", &err);
    assert_string_equal(kvp_status_name(KVP_CACHE_KV_HEAD_COUNT_MISMATCH),
                        "CacheKvHeadCountMismatch");

    /* Head count before KV head count: a 4-head grouped layer of the same width. */
    kvp_layer *four = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(GQ_D, 4, 2, GQ_CAPACITY, 500.0, 33, &four,
                                                   &err),
                   &err);
    expect_failure(four, &input, mha_cache, mha_pool, mha_ticket, KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 8 must match attention layer head count 4", &err);
    kvpt_destroy_layer(four);

    /* The grouped layer's own cache with an MHA-sized ticket: the ticket does not fit. */
    expect_failure(grouped, &input, grouped_cache, grouped_pool, mha_ticket,
                   KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 8 heads, head width 4 and capacity 8 does "
                   "not fit this KV cache",
                   &err);
    expect_failure(mha, &input, mha_cache, mha_pool, grouped_ticket,
                   KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 8 heads (2 KV heads), head width 4 and "
                   "capacity 8 does not fit this KV cache",
                   &err);
    assert_int_equal(err.heads, GQ_HEADS);
    assert_int_equal(err.kv_heads, 2);

    /* The reference's K/V buffers are [B, H_kv, T, d_h]: 2 * 3 * 4 doubles for T = 3. */
    double xs[3 * GQ_D];
    kvpt_fill_random(xs, 3 * GQ_D, 6);
    kvp_tensor three = kvp_tensor3(xs, 1, 3, GQ_D);
    double out[3 * GQ_D];
    double keys[2 * 3 * GQ_HD];
    kvpt_fill(out, 3 * GQ_D, -1.0);
    assert_int_equal(kvp_attention_reference(grouped, &three, out, 3 * GQ_D, keys, NULL,
                                             2 * 3 * GQ_HD - 1, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_int_equal(err.needed, 2 * 3 * GQ_HD);
    kvpt_assert_filled(out, 3 * GQ_D, -1.0);
    kvpt_assert_ok(kvp_attention_reference(grouped, &three, out, 3 * GQ_D, keys, NULL,
                                           2 * 3 * GQ_HD, &err),
                   &err);

    /* Cache creation: kv_heads nonzero, and the pool store kv_heads heads. The
     * query heads are attention's (the owner record): the pager does not know
     * them, so a hand-edited kv_heads that does not divide them is refused as
     * any kv_heads the pool does not store (GEOMETRY_MISMATCH), and a cache of
     * a matching pool by attention (CACHE_KV_HEAD_COUNT_MISMATCH). */
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(grouped, &binding, &err), &err);
    kvp_cache *out_cache = (kvp_cache *)0x1;
    kvpt_state before;
    kvpt_state_capture(grouped_cache, grouped_pool, &before);
    for (size_t bad = 0; bad < 3; bad++) {
        kvp_binding odd = binding;
        odd.kv_heads = (size_t[]){0, 3, 16}[bad];
        assert_int_equal(kvp_cache_create(grouped_pool, &odd, 1, 8, &out_cache, &err),
                         bad == 0 ? KVP_INVALID_ARGUMENT : KVP_GEOMETRY_MISMATCH);
        if (bad == 0) {
            kvpt_assert_error_text(&err, "argument `binding` is invalid: kv_heads and "
                                         "head_width must be nonzero");
        }
    }
    assert_int_equal(kvp_cache_create(mha_pool, &binding, 1, 8, &out_cache, &err),
                     KVP_GEOMETRY_MISMATCH);
    assert_int_equal(err.binding_geometry.heads, 2);
    assert_int_equal(err.pool_geometry.heads, GQ_HEADS);
    kvpt_assert_error_text(&err, "cache geometry (2 heads, head width 4) does not match page pool "
                                 "geometry (8 heads, head width 4)");
    assert_ptr_equal(out_cache, (kvp_cache *)0x1);
    kvpt_assert_state_unchanged(&before, grouped_cache, grouped_pool, 0);
    kvpt_state_free(&before);

    kvpt_destroy_ticket(mha_ticket, mha_pool);
    kvpt_destroy_ticket(grouped_ticket, grouped_pool);
    kvpt_destroy_cache(mha_cache, mha_pool);
    kvpt_destroy_cache(grouped_cache, grouped_pool);
    kvpt_destroy_pool(mha_pool);
    kvpt_destroy_pool(grouped_pool);
    kvpt_destroy_layer(grouped);
    kvpt_destroy_layer(mha);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_grouped_match_reference_across_blocks),
        cmocka_unit_test(test_attention_grouped_equals_mha_with_repeated_heads),
        cmocka_unit_test(test_attention_grouped_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
