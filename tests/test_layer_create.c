/*
 * test_layer_create.c: attention layers — creation errors in the
 * documented order with exact details and texts, for square and grouped
 * (fewer KV heads) layers; deterministic random layers (the documented
 * SplitMix64 fill, reproduced bit for bit) within [-1/sqrt(D), 1/sqrt(D)),
 * grouped ones continuing the same draws; the binding a cache captures; and
 * allocation fault sweeps over parameter, layer, random layer, random
 * grouped layer and ticket creation. Invariant: a failed creation writes no
 * out-parameter and takes no reference; leaks of a failed step are caught
 * by the memcheck run of this program. Parameters and RoPE are test_layer.c;
 * both share layer_support.h. Unit test (ctest test_layer_create,
 * memcheck.test_layer_create in release): uses pager/alloc.h and the layer
 * and ticket internals for sizes.
 */
#include "layer_support.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/layer_internal.h"
#include "attention/ticket_internal.h"
#include "pager/alloc.h"

/* Stops a fault sweep at a generous bound, so a broken injector cannot loop. */
#define SWEEP_LIMIT 64

/* ---- layers ----------------------------------------------------------------- */

/* The layer must be refused with `status` and `text`, *out untouched. */
static void expect_layer_failure(kvp_param *const p[KVP_PARAM_COUNT], size_t heads,
                                 size_t max_positions, double base, kvp_status status,
                                 const char *text, kvp_error *err)
{
    kvp_layer *out = (kvp_layer *)0x1;
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_layer_create(p[0], p[1], p[2], p[3], heads, max_positions, base, &out,
                                      err),
                     status);
    assert_int_equal(err->status, status);
    kvpt_assert_error_text(err, text);
    assert_ptr_equal(out, (kvp_layer *)0x1);
}

static void test_layer_create_errors_in_documented_order(void **state)
{
    (void)state;
    kvp_param *four[KVP_PARAM_COUNT];
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        four[i] = make_param(4, 0.1, (double)i);
    }
    kvp_param *three = make_param(3, 0.1, 0.0);
    kvp_param *six[KVP_PARAM_COUNT];
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        six[i] = make_param(6, 0.1, (double)i);
    }
    kvp_error err;

    /* NULL_ARGUMENT: out first, then the parameters in order. */
    assert_int_equal(kvp_layer_create(NULL, NULL, NULL, NULL, 0, 0, NAN, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvp_param *nulls[KVP_PARAM_COUNT] = {NULL, NULL, NULL, NULL};
    expect_layer_failure(nulls, 0, 0, NAN, KVP_NULL_ARGUMENT,
                         "argument `w_query` must not be NULL", &err);
    static const char *const names[] = {"w_query", "w_key", "w_value", "w_output"};
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        kvp_param *p[KVP_PARAM_COUNT] = {four[0], four[1], four[2], four[3]};
        p[i] = NULL;
        if (i + 1 < KVP_PARAM_COUNT) {
            p[i + 1] = three; /* a later width mismatch does not matter */
        }
        char text[64];
        snprintf(text, sizeof text, "argument `%s` must not be NULL", names[i]);
        expect_layer_failure(p, 3, 0, NAN, KVP_NULL_ARGUMENT, text, &err);
        assert_string_equal(err.argument, names[i]);
    }

    /* PARAMETER_WIDTH_MISMATCH: the first parameter whose width differs from W_q's. */
    kvp_param *mixed[KVP_PARAM_COUNT] = {four[0], four[1], three, three};
    expect_layer_failure(mixed, 0, 0, NAN, KVP_PARAMETER_WIDTH_MISMATCH,
                         "attention parameter 2 is 3x3, expected 4x4", &err);
    assert_int_equal(err.parameter, 2);
    assert_int_equal(err.expected_size, 4);
    assert_int_equal(err.actual_size, 3);
    kvp_param *query_odd[KVP_PARAM_COUNT] = {three, four[1], four[2], four[3]};
    expect_layer_failure(query_odd, 2, MAX_POSITIONS, ROPE_BASE, KVP_PARAMETER_WIDTH_MISMATCH,
                         "attention parameter 1 is 4x4, expected 3x3", &err);
    assert_int_equal(err.parameter, 1);
    kvp_param *output_odd[KVP_PARAM_COUNT] = {four[0], four[1], four[2], six[3]};
    expect_layer_failure(output_odd, 2, MAX_POSITIONS, ROPE_BASE, KVP_PARAMETER_WIDTH_MISMATCH,
                         "attention parameter 3 is 6x6, expected 4x4", &err);
    assert_int_equal(err.parameter, 3);

    /* HEADS_DO_NOT_DIVIDE_WIDTH, before any RoPE check. */
    expect_layer_failure(four, 0, 0, NAN, KVP_HEADS_DO_NOT_DIVIDE_WIDTH,
                         "attention model width 4 must be a nonzero multiple of 0 heads", &err);
    assert_int_equal(err.model_width, 4);
    assert_int_equal(err.heads, 0);
    expect_layer_failure(four, 3, 0, NAN, KVP_HEADS_DO_NOT_DIVIDE_WIDTH,
                         "attention model width 4 must be a nonzero multiple of 3 heads", &err);
    assert_int_equal(err.heads, 3);
    expect_layer_failure(four, 8, MAX_POSITIONS, ROPE_BASE, KVP_HEADS_DO_NOT_DIVIDE_WIDTH,
                         "attention model width 4 must be a nonzero multiple of 8 heads", &err);

    /* ROPE_* over d_h features: width, then positions, then base. */
    expect_layer_failure(six, 2, 0, NAN, KVP_ROPE_INVALID_WIDTH,
                         "RoPE feature width must be even and nonzero, got 3", &err);
    assert_int_equal(err.layer_rope.feature_width, 3);
    assert_int_equal(err.layer_rope.max_positions, 0);
    expect_layer_failure(four, 4, MAX_POSITIONS, ROPE_BASE, KVP_ROPE_INVALID_WIDTH,
                         "RoPE feature width must be even and nonzero, got 1", &err);
    expect_layer_failure(four, 2, 0, NAN, KVP_ROPE_ZERO_POSITIONS,
                         "RoPE max positions must be nonzero", &err);
    assert_int_equal(err.layer_rope.feature_width, 2);
    expect_layer_failure(four, 2, MAX_POSITIONS, NAN, KVP_ROPE_INVALID_BASE,
                         "RoPE base must be finite and greater than zero, got NaN", &err);
    expect_layer_failure(four, 1, MAX_POSITIONS, -2.0, KVP_ROPE_INVALID_BASE,
                         "RoPE base must be finite and greater than zero, got -2.0", &err);
    assert_int_equal(err.layer_rope.feature_width, 4);
    assert_int_equal(err.layer_rope.max_positions, MAX_POSITIONS);

    /* err is optional. */
    kvp_layer *layer = (kvp_layer *)0x1;
    assert_int_equal(kvp_layer_create(four[0], four[1], four[2], four[3], 3, MAX_POSITIONS,
                                      ROPE_BASE, &layer, NULL),
                     KVP_HEADS_DO_NOT_DIVIDE_WIDTH);
    assert_ptr_equal(layer, (kvp_layer *)0x1);

    /* The same parameters are fine with a valid configuration; one layer may use a
     * parameter in several roles. */
    layer = NULL;
    kvpt_assert_ok(kvp_layer_create(six[0], six[0], six[0], six[1], 3, 1, 0.5, &layer, &err),
                   &err);
    kvpt_assert_layer_info(layer, 6, 3, 2, 1, 0.5);
    kvpt_destroy_layer(layer);

    /* Failed creations took no reference: these releases free everything. */
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        release(four[i]);
        release(six[i]);
    }
    release(three);
}

static void test_layer_create_random_is_deterministic_and_bounded(void **state)
{
    (void)state;
    kvp_error err;
    kvp_layer *a = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 37);
    kvp_layer *b = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 37);
    kvp_layer *c = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 38);

    /* The documented fill: SplitMix64(seed), W_q, W_k, W_v, W_o row by row, each
     * entry (2u - 1) / sqrt(D) for u uniform in [0, 1) from the top 53 bits. */
    uint64_t rng = 37;
    double scale = 1.0 / sqrt(4.0);
    size_t differing = 0;
    for (size_t p = 0; p < KVP_PARAM_COUNT; p++) {
        const double *va = kvp_param_values(kvp_layer_param(a, p));
        const double *vb = kvp_param_values(kvp_layer_param(b, p));
        const double *vc = kvp_param_values(kvp_layer_param(c, p));
        assert_int_equal(kvp_param_rows(kvp_layer_param(a, p)), 4);
        assert_memory_equal(va, vb, 16 * sizeof(double));
        for (size_t i = 0; i < 16; i++) {
            double expected = kvpt_rand_unit(&rng) * scale;
            assert_memory_equal(&va[i], &expected, sizeof expected);
            differing += va[i] != vc[i];
        }
        /* Same values, but distinct nodes. */
        assert_true(kvp_param_id(kvp_layer_param(a, p)) != kvp_param_id(kvp_layer_param(b, p)));
    }
    assert_int_equal(differing, 4 * 16);
    kvpt_destroy_layer(a);
    kvpt_destroy_layer(b);
    kvpt_destroy_layer(c);

    /* Bounds, over many entries and widths. */
    const size_t widths[] = {1, 2, 16, 64};
    const size_t heads[] = {1, 1, 4, 8};
    for (size_t w = 0; w < KVPT_COUNT_OF(widths); w++) {
        size_t d = widths[w];
        if (d == 1) {
            /* d_h = 1 is odd: the layer is refused, and nothing leaks. */
            kvp_layer *out = (kvp_layer *)0x1;
            assert_int_equal(kvp_layer_create_random(1, 1, MAX_POSITIONS, ROPE_BASE, 5, &out,
                                                     &err),
                             KVP_ROPE_INVALID_WIDTH);
            assert_ptr_equal(out, (kvp_layer *)0x1);
            continue;
        }
        kvp_layer *layer = kvpt_random_layer(d, heads[w], 64, ROPE_BASE, 1000 + w);
        double bound = 1.0 / sqrt((double)d);
        double lowest = bound;
        double highest = -bound;
        for (size_t p = 0; p < KVP_PARAM_COUNT; p++) {
            const double *v = kvp_param_values(kvp_layer_param(layer, p));
            for (size_t i = 0; i < d * d; i++) {
                assert_true(v[i] >= -bound);
                assert_true(v[i] < bound);
                lowest = v[i] < lowest ? v[i] : lowest;
                highest = v[i] > highest ? v[i] : highest;
            }
        }
        if (d == 64) {
            /* 16384 draws cover the range: both ends are approached. */
            assert_true(lowest < -0.99 * bound);
            assert_true(highest > 0.99 * bound);
        }
        kvpt_destroy_layer(layer);
    }

    /* Errors: argument checks, then the layer's own checks after the parameters
     * were made (they must be released: memcheck). */
    kvp_layer *out = (kvp_layer *)0x1;
    assert_int_equal(kvp_layer_create_random(4, 2, 8, ROPE_BASE, 1, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_layer_create_random(0, 2, 8, ROPE_BASE, 1, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "model_width");
    kvpt_assert_error_text(&err, "argument `model_width` is invalid: must be nonzero and "
                                 "model_width^2 doubles must fit in memory");
    assert_int_equal(kvp_layer_create_random(SIZE_MAX / 4, 2, 8, ROPE_BASE, 1, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_int_equal(kvp_layer_create_random(4, 3, 8, ROPE_BASE, 1, &out, &err),
                     KVP_HEADS_DO_NOT_DIVIDE_WIDTH);
    kvpt_assert_error_text(&err, "attention model width 4 must be a nonzero multiple of 3 heads");
    assert_int_equal(kvp_layer_create_random(4, 2, 0, ROPE_BASE, 1, &out, &err),
                     KVP_ROPE_ZERO_POSITIONS);
    assert_int_equal(kvp_layer_create_random(4, 2, 8, INFINITY, 1, &out, &err),
                     KVP_ROPE_INVALID_BASE);
    kvpt_assert_error_text(&err, "RoPE base must be finite and greater than zero, got inf");
    assert_ptr_equal(out, (kvp_layer *)0x1);
}

static void test_layer_binding_and_info(void **state)
{
    (void)state;
    kvp_error err;
    kvp_layer *layer = kvpt_random_layer(12, 3, 20, 500.25, 9);
    kvp_binding binding;
    memset(&binding, 0x5A, sizeof binding);
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    /* The pager's part: kind, page geometry, positions, scales. */
    assert_int_equal(binding.kind, KVP_BINDING_LAYER);
    assert_int_equal(binding.reserved, 0);
    assert_int_equal(binding.kv_heads, 3);
    assert_int_equal(binding.head_width, 4);
    assert_int_equal(binding.max_positions, 20);
    assert_true(binding.k_scale == 1.0 && binding.v_scale == 1.0);
    assert_int_equal(binding.owner_revision, 0);
    /* Attention's record: what the seed's binding rule compares. */
    kvpi_layer_record record = kvpt_record(&binding);
    assert_int_equal(record.magic, KVPI_LAYER_RECORD_MAGIC);
    assert_int_equal(record.model_width, 12);
    assert_int_equal(record.heads, 3);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_int_equal(record.node_id[i], kvp_param_id(kvp_layer_param(layer, i)));
        assert_int_equal(record.revision[i], 0);
    }
    assert_int_equal(record.rope_feature_width, 4);
    assert_int_equal(record.rope_max_positions, 20);
    double base = 500.25;
    uint64_t bits = 0;
    memcpy(&bits, &base, sizeof bits);
    assert_int_equal(record.rope_base_bits, bits);
    /* The record bytes past attention's record are zero; the digest is the record's. */
    for (size_t i = sizeof record; i < KVP_BINDING_RECORD_BYTES; i++) {
        assert_int_equal(binding.record[i], 0);
    }
    kvp_binding again = kvpt_rebind(&binding, &record);
    assert_memory_equal(&again, &binding, sizeof binding);
    assert_true(binding.owner_digest[0] != 0 || binding.owner_digest[1] != 0);

    kvpt_assert_layer_info(layer, 12, 3, 4, 20, 500.25);

    /* Updates show in the binding, per parameter; identities stay. */
    kvp_param *w_key = kvp_layer_param_mut(layer, KVP_PARAM_KEY);
    kvp_param *w_output = kvp_layer_param_mut(layer, KVP_PARAM_OUTPUT);
    size_t calls = 0;
    kvpt_assert_ok(kvp_param_update_with(w_key, change_nothing, &calls, &err), &err);
    kvpt_assert_ok(kvp_param_update_with(w_output, change_nothing, &calls, &err), &err);
    kvpt_assert_ok(kvp_param_update_with(w_output, change_nothing, &calls, &err), &err);
    kvp_binding updated;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &updated, &err), &err);
    kvpi_layer_record now = kvpt_record(&updated);
    assert_int_equal(now.revision[KVP_PARAM_QUERY], 0);
    assert_int_equal(now.revision[KVP_PARAM_KEY], 1);
    assert_int_equal(now.revision[KVP_PARAM_VALUE], 0);
    assert_int_equal(now.revision[KVP_PARAM_OUTPUT], 2);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_int_equal(now.node_id[i], record.node_id[i]);
    }
    /* The owner's revision is the sum of the parameters'; the digest changes. */
    assert_int_equal(updated.owner_revision, 3);
    assert_memory_not_equal(updated.owner_digest, binding.owner_digest,
                            sizeof binding.owner_digest);

    /* NULL handling; out untouched on failure. */
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_binding untouched;
    memcpy(&untouched, &updated, sizeof updated);
    assert_int_equal(kvp_layer_binding_get(NULL, &updated, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layer");
    assert_int_equal(kvp_layer_binding_get(layer, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_memory_equal(&updated, &untouched, sizeof updated);
    assert_int_equal(kvp_layer_info_get(NULL, &info, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layer");
    assert_int_equal(kvp_layer_info_get(layer, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvpt_destroy_layer(layer);
}

/* ---- allocation fault sweeps ----------------------------------------------- */

/* A failed step (kvpt_assert_fault_failed) at `site`, naming `what` and `bytes`. */
static void assert_step_failed(const kvpt_fault_step *s, uint64_t nth, kvpi_fault_site site,
                               const char *what, size_t bytes)
{
    kvpt_assert_fault_failed(s, nth);
    assert_int_equal(s->site, site);
    assert_string_equal(s->err.what, what);
    assert_int_equal(s->err.bytes, bytes);
}

static void test_layer_fault_sweep_param_create(void **state)
{
    (void)state;
    double values[9];
    fill_ramp(values, 3, 1.0, 0.0);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_param *param = (kvp_param *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_param_create(3, values, &param, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            assert_memory_equal(kvp_param_values(param), values, sizeof values);
            assert_int_equal(kvp_param_revision(param), 0);
            release(param);
            break;
        }
        failures++;
        /* The node and its values are one allocation. */
        assert_true(s.err.bytes >= sizeof values);
        assert_step_failed(&s, nth, KVPI_SITE_PARAM, "parameter node", s.err.bytes);
        assert_ptr_equal(param, (kvp_param *)0x1);
    }
    assert_int_equal(failures, 1);
}

static void test_layer_fault_sweep_layer_create(void **state)
{
    (void)state;
    kvp_param *p[KVP_PARAM_COUNT];
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        p[i] = make_param(4, 0.25, (double)i);
    }
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_layer *layer = (kvp_layer *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_layer_create(p[0], p[1], p[2], p[3], 2, MAX_POSITIONS,
                                                    ROPE_BASE, &layer, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
                assert_ptr_equal(kvp_layer_param(layer, i), p[i]);
            }
            kvpt_destroy_layer(layer);
            break;
        }
        failures++;
        assert_step_failed(&s, nth, KVPI_SITE_LAYER, "attention layer",
                           kvpi_layer_alloc_bytes(2, MAX_POSITIONS));
        assert_ptr_equal(layer, (kvp_layer *)0x1);
    }
    assert_int_equal(failures, 1);
    /* A failed creation took no reference: these are the last ones (memcheck). */
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        release(p[i]);
    }
}

static void test_layer_fault_sweep_layer_create_random(void **state)
{
    (void)state;
    enum { D = 8 };
    /* Scratch for the values, four parameters, then the layer. */
    static const kvpi_fault_site sites[] = {KVPI_SITE_SCRATCH, KVPI_SITE_PARAM, KVPI_SITE_PARAM,
                                            KVPI_SITE_PARAM,   KVPI_SITE_PARAM, KVPI_SITE_LAYER};
    kvp_layer *expected = kvpt_random_layer(D, 2, MAX_POSITIONS, ROPE_BASE, 77);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_layer *layer = (kvp_layer *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_layer_create_random(D, 2, MAX_POSITIONS, ROPE_BASE, 77,
                                                           &layer, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
                assert_memory_equal(kvp_param_values(kvp_layer_param(layer, i)),
                                    kvp_param_values(kvp_layer_param(expected, i)),
                                    D * D * sizeof(double));
            }
            kvpt_destroy_layer(layer);
            break;
        }
        failures++;
        assert_true(nth <= KVPT_COUNT_OF(sites));
        kvpi_fault_site site = sites[nth - 1];
        size_t bytes = site == KVPI_SITE_SCRATCH ? D * D * sizeof(double)
                       : site == KVPI_SITE_LAYER ? kvpi_layer_alloc_bytes(D / 2, MAX_POSITIONS)
                                                 : s.err.bytes;
        assert_true(bytes >= D * D * sizeof(double) || site == KVPI_SITE_LAYER);
        assert_step_failed(&s, nth, site, kvpi_fault_site_name(site), bytes);
        assert_ptr_equal(layer, (kvp_layer *)0x1);
    }
    assert_int_equal(failures, KVPT_COUNT_OF(sites));
    kvpt_destroy_layer(expected);
}

/* ---- rectangular parameters and grouped layers ------------------------------ */

/* A rows x cols parameter with entry k = scale * k + offset. */
static kvp_param *make_matrix(size_t rows, size_t cols, double scale, double offset)
{
    double values[64 * 64];
    assert_true(rows * cols <= KVPT_COUNT_OF(values));
    for (size_t i = 0; i < rows * cols; i++) {
        values[i] = scale * (double)i + offset;
    }
    kvp_param *param = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create_matrix(rows, cols, values, &param, &err), &err);
    return param;
}

static void expect_grouped_failure(kvp_param *const p[KVP_PARAM_COUNT], size_t heads,
                                   size_t kv_heads, kvp_status status, const char *text,
                                   kvp_error *err)
{
    kvp_layer *out = (kvp_layer *)0x1;
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_layer_create_grouped(p[0], p[1], p[2], p[3], heads, kv_heads,
                                              MAX_POSITIONS, ROPE_BASE, &out, err),
                     status);
    assert_int_equal(err->status, status);
    kvpt_assert_error_text(err, text);
    assert_ptr_equal(out, (kvp_layer *)0x1);
}

/*
 * A grouped layer's checks, in order: NULLs; rows and the square W_q, W_o;
 * heads dividing the width; kv_heads dividing heads; the columns of W_k, W_v;
 * RoPE. D = 8, 4 heads of d_h = 2, 2 KV heads: W_k and W_v are 8 x 4.
 */
static void test_layer_create_grouped_errors_in_documented_order(void **state)
{
    (void)state;
    kvp_param *square = make_matrix(8, 8, 0.01, 0.0);
    kvp_param *kv4 = make_matrix(8, 4, 0.01, 0.5);
    kvp_param *kv2 = make_matrix(8, 2, 0.01, 0.25);
    kvp_param *wide = make_matrix(8, 16, 0.01, 0.0);
    kvp_param *short_rows = make_matrix(6, 4, 0.01, 0.0);
    kvp_error err;

    kvp_param *good[KVP_PARAM_COUNT] = {square, kv4, kv4, square};
    kvp_layer *out = (kvp_layer *)0x1;
    assert_int_equal(kvp_layer_create_grouped(square, kv4, kv4, square, 4, 2, MAX_POSITIONS,
                                              ROPE_BASE, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvp_param *no_value[KVP_PARAM_COUNT] = {square, kv4, NULL, square};
    expect_grouped_failure(no_value, 0, 0, KVP_NULL_ARGUMENT,
                           "argument `w_value` must not be NULL", &err);

    /* Rows and squareness first, parameter by parameter. */
    kvp_param *query_wide[KVP_PARAM_COUNT] = {wide, kv4, kv4, square};
    expect_grouped_failure(query_wide, 0, 0, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 0 is 8x16, expected 8x8", &err);
    assert_int_equal(err.parameter, 0);
    assert_int_equal(err.expected.rank, 2);
    assert_int_equal(err.actual.dims[1], 16);
    assert_int_equal(err.expected_size, 8); /* the first dimension that differs: cols */
    assert_int_equal(err.actual_size, 16);
    kvp_param *key_rows[KVP_PARAM_COUNT] = {square, short_rows, kv4, square};
    expect_grouped_failure(key_rows, 4, 2, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 1 is 6x4, expected 8x4", &err);
    assert_int_equal(err.expected_size, 8);
    assert_int_equal(err.actual_size, 6);
    kvp_param *output_kv[KVP_PARAM_COUNT] = {square, kv4, kv4, kv4};
    expect_grouped_failure(output_kv, 4, 2, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 3 is 8x4, expected 8x8", &err);

    /* Heads before KV heads, both before the K/V columns. */
    kvp_param *key_square[KVP_PARAM_COUNT] = {square, square, kv4, square};
    expect_grouped_failure(key_square, 3, 0, KVP_HEADS_DO_NOT_DIVIDE_WIDTH,
                           "attention model width 8 must be a nonzero multiple of 3 heads", &err);
    expect_grouped_failure(key_square, 4, 0, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS,
                           "attention head count 4 must be a nonzero multiple of 0 KV heads",
                           &err);
    assert_int_equal(err.heads, 4);
    assert_int_equal(err.kv_heads, 0);
    expect_grouped_failure(good, 4, 3, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS,
                           "attention head count 4 must be a nonzero multiple of 3 KV heads",
                           &err);
    expect_grouped_failure(good, 4, 8, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS,
                           "attention head count 4 must be a nonzero multiple of 8 KV heads",
                           &err);
    assert_string_equal(kvp_status_name(KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS),
                        "KvHeadsDoNotDivideHeads");
    expect_grouped_failure(key_square, 4, 2, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 1 is 8x8, expected 8x4", &err);
    kvp_param *value_mqa[KVP_PARAM_COUNT] = {square, kv4, kv2, square};
    expect_grouped_failure(value_mqa, 4, 2, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 2 is 8x2, expected 8x4", &err);
    assert_int_equal(err.expected_size, 4);
    assert_int_equal(err.actual_size, 2);
    /* The same square parameters make an MHA layer, so grouping is the only reason. */
    kvp_param *mha[KVP_PARAM_COUNT] = {square, square, square, square};
    expect_grouped_failure(mha, 4, 1, KVP_PARAMETER_WIDTH_MISMATCH,
                           "attention parameter 1 is 8x8, expected 8x2", &err);

    /* RoPE last: 8 heads of d_h = 1 with 2 KV heads (W_k 8 x 2). */
    kvp_param *thin[KVP_PARAM_COUNT] = {square, kv2, kv2, square};
    expect_grouped_failure(thin, 8, 2, KVP_ROPE_INVALID_WIDTH,
                           "RoPE feature width must be even and nonzero, got 1", &err);

    /* Valid: groups of 2 (kv 2) and MQA (kv 1, W_k 8 x 2). */
    out = NULL;
    kvpt_assert_ok(kvp_layer_create_grouped(square, kv4, kv4, square, 4, 2, MAX_POSITIONS,
                                            ROPE_BASE, &out, &err),
                   &err);
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvpt_assert_ok(kvp_layer_info_get(out, &info, &err), &err);
    assert_int_equal(info.model_width, 8);
    assert_int_equal(info.heads, 4);
    assert_int_equal(info.kv_heads, 2);
    assert_int_equal(info.head_width, 2);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(out, &binding, &err), &err);
    assert_int_equal(kvpt_record(&binding).heads, 4);
    assert_int_equal(binding.kv_heads, 2);
    assert_int_equal(kvpt_record(&binding).model_width, 8);
    kvpt_destroy_layer(out);
    kvpt_assert_ok(kvp_layer_create_grouped(square, kv2, kv2, square, 4, 1, MAX_POSITIONS,
                                            ROPE_BASE, &out, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_info_get(out, &info, &err), &err);
    assert_int_equal(info.kv_heads, 1);
    kvpt_destroy_layer(out);
    /* kvp_layer_create is the kv_heads == heads case. */
    kvpt_assert_ok(kvp_layer_create(square, square, square, square, 4, MAX_POSITIONS, ROPE_BASE,
                                    &out, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_info_get(out, &info, &err), &err);
    assert_int_equal(info.kv_heads, 4);
    kvpt_destroy_layer(out);

    release(square);
    release(kv4);
    release(kv2);
    release(wide);
    release(short_rows);
}

/*
 * kvp_layer_create_random_grouped with kv_heads == heads is
 * kvp_layer_create_random, bit for bit; with fewer KV heads W_q is the same
 * and W_k takes the next D * kv_heads * d_h draws. Its refusals write nothing.
 */
static void test_layer_create_random_grouped(void **state)
{
    (void)state;
    enum { D = 8 };
    kvp_error err;
    kvp_layer *plain = kvpt_random_layer(D, 4, MAX_POSITIONS, ROPE_BASE, 11);
    kvp_layer *same = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D, 4, 4, MAX_POSITIONS, ROPE_BASE, 11, &same,
                                                   &err),
                   &err);
    kvp_layer *mqa = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D, 4, 1, MAX_POSITIONS, ROPE_BASE, 11, &mqa,
                                                   &err),
                   &err);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_memory_equal(kvp_param_values(kvp_layer_param(same, i)),
                            kvp_param_values(kvp_layer_param(plain, i)), D * D * sizeof(double));
    }
    assert_memory_equal(kvp_param_values(kvp_layer_param(mqa, KVP_PARAM_QUERY)),
                        kvp_param_values(kvp_layer_param(plain, KVP_PARAM_QUERY)),
                        D * D * sizeof(double));
    /* MQA's W_k (8 x 2) is the first 16 draws after W_q: plain W_k's first 16 entries. */
    assert_int_equal(kvp_param_cols(kvp_layer_param(mqa, KVP_PARAM_KEY)), 2);
    assert_memory_equal(kvp_param_values(kvp_layer_param(mqa, KVP_PARAM_KEY)),
                        kvp_param_values(kvp_layer_param(plain, KVP_PARAM_KEY)),
                        D * 2 * sizeof(double));
    kvp_layer *out = (kvp_layer *)0x1;
    assert_int_equal(kvp_layer_create_random_grouped(D, 4, 3, MAX_POSITIONS, ROPE_BASE, 11, &out,
                                                     &err),
                     KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS);
    assert_int_equal(kvp_layer_create_random_grouped(D, 0, 1, MAX_POSITIONS, ROPE_BASE, 11, &out,
                                                     &err),
                     KVP_HEADS_DO_NOT_DIVIDE_WIDTH);
    assert_int_equal(kvp_layer_create_random_grouped(D, 4, 2, MAX_POSITIONS, ROPE_BASE, 11, NULL,
                                                     &err),
                     KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_layer_create_random_grouped(0, 4, 2, MAX_POSITIONS, ROPE_BASE, 11, &out,
                                                     &err),
                     KVP_INVALID_ARGUMENT);
    assert_ptr_equal(out, (kvp_layer *)0x1);
    kvpt_destroy_layer(plain);
    kvpt_destroy_layer(same);
    kvpt_destroy_layer(mqa);
}

/* The grouped random constructor's allocations, swept: scratch, four parameters, the layer. */
static void test_layer_fault_sweep_layer_create_random_grouped(void **state)
{
    (void)state;
    enum { D = 8 };
    static const kvpi_fault_site sites[] = {KVPI_SITE_SCRATCH, KVPI_SITE_PARAM, KVPI_SITE_PARAM,
                                            KVPI_SITE_PARAM,   KVPI_SITE_PARAM, KVPI_SITE_LAYER};
    kvp_layer *expected = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D, 4, 2, MAX_POSITIONS, ROPE_BASE, 78,
                                                   &expected, &err),
                   &err);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_layer *layer = (kvp_layer *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_layer_create_random_grouped(D, 4, 2, MAX_POSITIONS,
                                                                   ROPE_BASE, 78, &layer,
                                                                   &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
                const kvp_param *p = kvp_layer_param(layer, i);
                size_t n = kvp_param_rows(p) * kvp_param_cols(p);
                assert_int_equal(n, i == KVP_PARAM_KEY || i == KVP_PARAM_VALUE ? D * 4 : D * D);
                assert_memory_equal(kvp_param_values(p),
                                    kvp_param_values(kvp_layer_param(expected, i)),
                                    n * sizeof(double));
            }
            kvpt_destroy_layer(layer);
            break;
        }
        failures++;
        assert_true(nth <= KVPT_COUNT_OF(sites));
        kvpi_fault_site site = sites[nth - 1];
        size_t bytes = site == KVPI_SITE_SCRATCH ? D * D * sizeof(double)
                       : site == KVPI_SITE_LAYER ? kvpi_layer_alloc_bytes(D / 4, MAX_POSITIONS)
                                                 : s.err.bytes;
        assert_step_failed(&s, nth, site, kvpi_fault_site_name(site), bytes);
        assert_ptr_equal(layer, (kvp_layer *)0x1);
    }
    assert_int_equal(failures, KVPT_COUNT_OF(sites));
    kvpt_destroy_layer(expected);
}

static void test_layer_fault_sweep_ticket_create(void **state)
{
    (void)state;
    enum { B = 2, H = 2, HD = 4, C = 7 };
    kvp_pool *pool = kvpt_pool(3, H, HD, 8);
    kvp_binding binding = kvpt_binding(H, HD, C);
    kvp_cache *cache = kvpt_cache(pool, &binding, B, C);
    kvp_error err;
    kvp_pool_stats before = kvpt_stats(pool);
    /* Q, K, V, head outputs and output rows, the weights, and B reserved page ids. */
    const size_t buffer_bytes = (5 * B * H * HD + B * H * C) * sizeof(double) +
                                B * sizeof(uint32_t);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_ticket *ticket = (kvp_ticket *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_ticket_create(cache, &ticket, &s.err));
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats after = kvpt_stats(pool);
        assert_memory_equal(&before, &after, sizeof before);
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            kvp_attention_result result;
            assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);
            kvpt_destroy_ticket(ticket, pool);
            break;
        }
        failures++;
        if (nth == 1) {
            assert_step_failed(&s, nth, KVPI_SITE_TICKET, "attention ticket",
                               sizeof(struct kvp_ticket));
        } else {
            assert_step_failed(&s, nth, KVPI_SITE_SCRATCH, "attention ticket buffers",
                               buffer_bytes);
        }
        assert_ptr_equal(ticket, (kvp_ticket *)0x1);
    }
    assert_int_equal(failures, 2);
    assert_int_equal(kvp_ticket_create(NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_ticket_create(cache, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layer_create_errors_in_documented_order),
        cmocka_unit_test(test_layer_create_random_is_deterministic_and_bounded),
        cmocka_unit_test(test_layer_binding_and_info),
        cmocka_unit_test_teardown(test_layer_fault_sweep_param_create, kvpt_disarm),
        cmocka_unit_test_teardown(test_layer_fault_sweep_layer_create, kvpt_disarm),
        cmocka_unit_test_teardown(test_layer_fault_sweep_layer_create_random, kvpt_disarm),
        cmocka_unit_test_teardown(test_layer_fault_sweep_ticket_create, kvpt_disarm),
        cmocka_unit_test(test_layer_create_grouped_errors_in_documented_order),
        cmocka_unit_test(test_layer_create_random_grouped),
        cmocka_unit_test_teardown(test_layer_fault_sweep_layer_create_random_grouped, kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
