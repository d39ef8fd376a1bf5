/*
 * test_layer.c: attention parameters and RoPE — parameters copy their
 * values, have process-unique increasing ids and a revision that every update
 * advances by exactly one (even when the values do not change) and that
 * other threads may read during updates (atomic; TSan), and are
 * reference counted so layers built over the same nodes share identities;
 * rectangular parameters' rows and columns; RoPE validation errors with
 * exact texts, rotation values for d_h = 2 and 4, the position range, norm
 * preservation, and the refusal of bases whose angles are not finite.
 * Invariant checked: a refusal changes nothing (out-parameters, revisions,
 * the features it would rotate).
 * Layer creation, the binding and the allocation fault sweeps are
 * test_layer_create.c; both share layer_support.h. Unit test (ctest
 * test_layer, memcheck.test_layer in release, and the tsan preset for the
 * revision read during updates).
 */
#include "layer_support.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The full-prefix reference of `layer` over `tokens` rows of a fixed input. */
static void reference_of(const kvp_layer *layer, size_t width, size_t tokens, double *out)
{
    double input[4 * 8];
    assert_true(width * tokens <= KVPT_COUNT_OF(input));
    for (size_t i = 0; i < width * tokens; i++) {
        input[i] = 0.25 * (double)(i % 7) - 0.5;
    }
    kvp_tensor view = kvp_tensor3(input, 1, tokens, width);
    kvp_error err;
    kvpt_assert_ok(kvp_attention_reference(layer, &view, out, width * tokens, NULL, NULL, 0, &err),
                   &err);
}

/* ---- parameters ---------------------------------------------------------- */

static void test_layer_param_create_copies_values(void **state)
{
    (void)state;
    double values[9];
    fill_ramp(values, 3, 0.5, -1.0);
    double copy[9];
    memcpy(copy, values, sizeof copy);
    kvp_param *param = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create(3, values, &param, &err), &err);
    assert_non_null(param);
    /* The caller's buffer may change or go away: the parameter kept a copy. */
    for (size_t i = 0; i < 9; i++) {
        values[i] = 1e9;
    }
    assert_int_equal(kvp_param_rows(param), 3);
    assert_ptr_not_equal(kvp_param_values(param), values);
    assert_memory_equal(kvp_param_values(param), copy, sizeof copy);
    assert_int_equal(kvp_param_revision(param), 0);
    assert_true(kvp_param_id(param) > 0);

    /* A 1 x 1 parameter is allowed. */
    kvp_param *tiny = NULL;
    double one = -0.0;
    kvpt_assert_ok(kvp_param_create(1, &one, &tiny, &err), &err);
    assert_int_equal(kvp_param_rows(tiny), 1);
    assert_memory_equal(kvp_param_values(tiny), &one, sizeof one); /* -0.0 bit for bit */
    release(tiny);
    release(param);
}

static void test_layer_param_ids_are_unique_and_increasing(void **state)
{
    (void)state;
    enum { N = 12 };
    kvp_param *params[N];
    uint64_t ids[N];
    for (size_t i = 0; i < N; i++) {
        params[i] = make_param(2, 1.0, (double)i);
        ids[i] = kvp_param_id(params[i]);
        assert_true(ids[i] > 0);
        if (i > 0) {
            assert_true(ids[i] > ids[i - 1]);
        }
    }
    /* Ids are never reused, not even after the holder of an id is freed. */
    release(params[N - 1]);
    release(params[0]);
    kvp_param *later = make_param(2, 1.0, 0.0);
    assert_true(kvp_param_id(later) > ids[N - 1]);
    for (size_t i = 1; i < N - 1; i++) {
        assert_true(kvp_param_id(later) != ids[i]);
        release(params[i]);
    }
    /* Layers created from fresh parameters get fresh ids too. */
    kvp_layer *a = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 1);
    kvp_layer *b = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 1);
    uint64_t previous = kvp_param_id(later);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_true(kvp_param_id(kvp_layer_param(a, i)) > previous);
        previous = kvp_param_id(kvp_layer_param(a, i));
    }
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_true(kvp_param_id(kvp_layer_param(b, i)) > previous);
        previous = kvp_param_id(kvp_layer_param(b, i));
    }
    kvpt_destroy_layer(a);
    kvpt_destroy_layer(b);
    release(later);
}

static void add_one(void *ctx, double *values, size_t width)
{
    size_t *calls = ctx;
    (*calls)++;
    for (size_t i = 0; i < width * width; i++) {
        values[i] += 1.0;
    }
}

/* The reader's side of the revision race test. */
typedef struct revision_reader {
    const kvp_param *param;
    uint64_t target;       /* the revision the writer ends at */
    atomic_int started;    /* set after the reader's first read */
    int monotonic;
    uint64_t last;
} revision_reader;

static void *read_revisions(void *arg)
{
    revision_reader *r = arg;
    uint64_t last = kvp_param_revision(r->param);
    atomic_store(&r->started, 1);
    r->monotonic = 1;
    while (last < r->target) {
        uint64_t now = kvp_param_revision(r->param);
        r->monotonic &= now >= last;
        last = now;
        sched_yield();
    }
    r->last = last;
    return NULL;
}

/*
 * The revision is atomic: a thread may read it while another updates the
 * parameter (ThreadSanitizer checks this in the tsan preset; before, the
 * update's plain increment raced with every read). The writer starts only
 * once the reader is reading, so their accesses overlap under any
 * scheduling; the reader sees a never-decreasing revision and ends at
 * exactly the writer's count.
 */
static void test_layer_param_revision_reads_race_free_with_updates(void **state)
{
    (void)state;
    enum { UPDATES = 200 };
    kvp_param *param = make_param(2, 1.0, 0.0);
    revision_reader r = {.param = param, .target = UPDATES};
    atomic_init(&r.started, 0);
    pthread_t reader;
    assert_int_equal(pthread_create(&reader, NULL, read_revisions, &r), 0);
    while (!atomic_load(&r.started)) {
        sched_yield();
    }
    kvp_error err;
    for (int i = 0; i < UPDATES; i++) {
        double values[4] = {(double)i, 0.0, 0.0, 1.0};
        kvpt_assert_ok(kvp_param_update(param, values, &err), &err);
    }
    assert_int_equal(pthread_join(reader, NULL), 0);
    assert_true(r.monotonic);
    assert_int_equal(r.last, UPDATES);
    assert_int_equal(kvp_param_revision(param), UPDATES);
    const double last[4] = {UPDATES - 1, 0.0, 0.0, 1.0};
    assert_memory_equal(kvp_param_values(param), last, sizeof last);
    kvpt_assert_ok(kvp_param_release(param, &err), &err);
}

static void test_layer_param_revision_advances_by_one_on_every_update(void **state)
{
    (void)state;
    kvp_param *param = make_param(2, 1.0, 0.0);
    uint64_t id = kvp_param_id(param);
    kvp_error err;
    assert_int_equal(kvp_param_revision(param), 0);

    double next[4] = {4.0, 3.0, 2.0, 1.0};
    kvpt_assert_ok(kvp_param_update(param, next, &err), &err);
    assert_int_equal(kvp_param_revision(param), 1);
    assert_memory_equal(kvp_param_values(param), next, sizeof next);

    /* The same values again: still a new revision. */
    kvpt_assert_ok(kvp_param_update(param, next, &err), &err);
    assert_int_equal(kvp_param_revision(param), 2);
    assert_memory_equal(kvp_param_values(param), next, sizeof next);

    /* Updating from its own storage is allowed and changes nothing but the revision. */
    kvpt_assert_ok(kvp_param_update(param, kvp_param_values(param), &err), &err);
    assert_int_equal(kvp_param_revision(param), 3);
    assert_memory_equal(kvp_param_values(param), next, sizeof next);

    size_t calls = 0;
    kvpt_assert_ok(kvp_param_update_with(param, add_one, &calls, &err), &err);
    assert_int_equal(calls, 1);
    assert_int_equal(kvp_param_revision(param), 4);
    const double plus_one[4] = {5.0, 4.0, 3.0, 2.0};
    assert_memory_equal(kvp_param_values(param), plus_one, sizeof plus_one);

    kvpt_assert_ok(kvp_param_update_with(param, change_nothing, &calls, &err), &err);
    assert_int_equal(calls, 2);
    assert_int_equal(kvp_param_revision(param), 5);
    assert_memory_equal(kvp_param_values(param), plus_one, sizeof plus_one);

    /* Failed updates advance nothing. */
    assert_int_equal(kvp_param_update(param, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "values");
    kvpt_assert_error_text(&err, "argument `values` must not be NULL");
    assert_int_equal(kvp_param_update_with(param, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "fn");
    kvpt_assert_error_text(&err, "argument `fn` must not be NULL");
    assert_int_equal(kvp_param_revision(param), 5);
    assert_memory_equal(kvp_param_values(param), plus_one, sizeof plus_one);
    /* Identity never changes with updates. */
    assert_int_equal(kvp_param_id(param), id);
    release(param);
}

static void test_layer_param_errors_and_null_queries(void **state)
{
    (void)state;
    double values[4] = {1.0, 2.0, 3.0, 4.0};
    kvp_param *out = (kvp_param *)0x1;
    kvp_error err;
    assert_int_equal(kvp_param_create(2, NULL, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "values");
    kvpt_assert_error_text(&err, "argument `values` must not be NULL");
    assert_int_equal(kvp_param_create(2, values, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_param_create(0, values, &out, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "width");
    kvpt_assert_error_text(&err, "argument `width` is invalid: a parameter needs a nonzero width");
    assert_int_equal(kvp_param_create(SIZE_MAX / 2, values, &out, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `width` is invalid: width * width overflows");
    /* width * width fits in size_t, but not as doubles. */
    assert_int_equal(kvp_param_create((size_t)1 << 31, values, &out, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `width` is invalid: width * width overflows");
    assert_int_equal(kvp_param_create(0, values, &out, NULL), KVP_INVALID_ARGUMENT);
    assert_ptr_equal(out, (kvp_param *)0x1); /* out untouched on failure */

    assert_int_equal(kvp_param_retain(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "param");
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_param_release(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_param_update(NULL, values, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "param");
    assert_int_equal(kvp_param_update_with(NULL, change_nothing, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "param");
    assert_int_equal(kvp_param_id(NULL), 0);
    assert_int_equal(kvp_param_revision(NULL), 0);
    assert_int_equal(kvp_param_rows(NULL), 0);
    assert_null(kvp_param_values(NULL));
}

/*
 * Layers over the same nodes share identities; references keep every node
 * alive exactly as long as some holder needs it (memcheck checks the frees).
 */
static void test_layer_shared_params_keep_identity_and_references(void **state)
{
    (void)state;
    kvp_param *params[KVP_PARAM_COUNT];
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        params[i] = make_param(4, 0.01 * (double)(i + 1), -0.05);
    }
    kvp_layer *first = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create(params[0], params[1], params[2], params[3], 2, MAX_POSITIONS,
                                    ROPE_BASE, &first, &err),
                   &err);
    /* Retain / release pairs leave the count where it was. */
    kvpt_assert_ok(kvp_param_retain(params[0], &err), &err);
    release(params[0]);
    /* The caller's references can go: the layer holds its own. */
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_ptr_equal(kvp_layer_param(first, i), params[i]);
        release(params[i]);
    }
    assert_null(kvp_layer_param(first, KVP_PARAM_COUNT));
    assert_null(kvp_layer_param(NULL, 0));
    /* A const layer gives only const parameters; the mutable getter needs a mutable layer. */
    _Static_assert(_Generic(kvp_layer_param((const kvp_layer *)NULL, 0),
                            const kvp_param *: 1, default: 0),
                   "kvp_layer_param returns a const parameter");
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_ptr_equal(kvp_layer_param_mut(first, i), kvp_layer_param(first, i));
    }
    assert_null(kvp_layer_param_mut(first, KVP_PARAM_COUNT));
    assert_null(kvp_layer_param_mut(NULL, 0));
    double expected[4 * 3];
    reference_of(first, 4, 3, expected);

    /* The seed's from_parameters over another layer's nodes. */
    kvp_layer *second = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param_mut(first, 0), kvp_layer_param_mut(first, 1),
                                    kvp_layer_param_mut(first, 2), kvp_layer_param_mut(first, 3), 2,
                                    MAX_POSITIONS, ROPE_BASE, &second, &err),
                   &err);
    kvp_binding a;
    kvp_binding b;
    kvpt_assert_ok(kvp_layer_binding_get(first, &a, &err), &err);
    kvpt_assert_ok(kvp_layer_binding_get(second, &b, &err), &err);
    assert_memory_equal(&a, &b, sizeof a);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_int_equal(kvpt_record(&b).node_id[i], kvp_param_id(kvp_layer_param(first, i)));
        assert_ptr_equal(kvp_layer_param(second, i), kvp_layer_param(first, i));
    }
    double output[4 * 3];
    reference_of(second, 4, 3, output);
    assert_memory_equal(output, expected, sizeof output);

    /* An in-place update through one layer is seen by the other: same node. */
    double values[16];
    memcpy(values, kvp_param_values(kvp_layer_param(second, KVP_PARAM_VALUE)), sizeof values);
    kvpt_assert_ok(kvp_param_update(kvp_layer_param_mut(second, KVP_PARAM_VALUE), values, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_binding_get(first, &a, &err), &err);
    assert_int_equal(kvpt_record(&a).revision[KVP_PARAM_VALUE], 1);
    assert_int_equal(kvpt_record(&a).revision[KVP_PARAM_QUERY], 0);

    /* Destroying the first layer keeps the shared nodes alive for the second. */
    kvpt_destroy_layer(first);
    kvpt_assert_ok(kvp_layer_binding_get(second, &b, &err), &err);
    assert_memory_equal(&a, &b, sizeof a);
    reference_of(second, 4, 3, output);
    assert_memory_equal(output, expected, sizeof output);
    assert_memory_equal(kvp_param_values(kvp_layer_param(second, KVP_PARAM_VALUE)), values,
                        sizeof values);
    /* A caller may keep a node past its last layer by retaining it. */
    kvp_param *kept = kvp_layer_param_mut(second, KVP_PARAM_OUTPUT);
    kvpt_assert_ok(kvp_param_retain(kept, &err), &err);
    uint64_t kept_id = kvp_param_id(kept);
    kvpt_destroy_layer(second);
    assert_int_equal(kvp_param_id(kept), kept_id);
    assert_int_equal(kvp_param_rows(kept), 4);
    release(kept); /* the last reference: frees the node */
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_layer_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
}

/* ---- RoPE ----------------------------------------------------------------- */

/* The rope must be rejected with `status` and `text`; err.layer_rope is the config. */
static void expect_rope_invalid(kvp_rope_config rope, kvp_status status, const char *text)
{
    kvp_error err;
    memset(&err, 0x5A, sizeof err);
    assert_int_equal(kvp_rope_validate(&rope, &err), status);
    assert_int_equal(err.status, status);
    kvpt_assert_error_text(&err, text);
    assert_int_equal(err.layer_rope.feature_width, rope.feature_width);
    assert_int_equal(err.layer_rope.max_positions, rope.max_positions);
    assert_memory_equal(&err.layer_rope.base, &rope.base, sizeof rope.base);
    /* Rotation validates the same way first, and touches nothing. */
    double features[4] = {1.0, 2.0, 3.0, 4.0};
    const double untouched[4] = {1.0, 2.0, 3.0, 4.0};
    memset(&err, 0x5A, sizeof err);
    assert_int_equal(kvp_rope_rotate(&rope, features, 0, &err), status);
    kvpt_assert_error_text(&err, text);
    assert_memory_equal(features, untouched, sizeof features);
}

static void test_layer_rope_validate_errors(void **state)
{
    (void)state;
    expect_rope_invalid((kvp_rope_config){3, 8, ROPE_BASE}, KVP_ROPE_INVALID_WIDTH,
                        "RoPE feature width must be even and nonzero, got 3");
    expect_rope_invalid((kvp_rope_config){1, 8, ROPE_BASE}, KVP_ROPE_INVALID_WIDTH,
                        "RoPE feature width must be even and nonzero, got 1");
    expect_rope_invalid((kvp_rope_config){0, 8, ROPE_BASE}, KVP_ROPE_INVALID_WIDTH,
                        "RoPE feature width must be even and nonzero, got 0");
    expect_rope_invalid((kvp_rope_config){2, 0, ROPE_BASE}, KVP_ROPE_ZERO_POSITIONS,
                        "RoPE max positions must be nonzero");
    expect_rope_invalid((kvp_rope_config){2, 8, 0.0}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got 0.0");
    expect_rope_invalid((kvp_rope_config){2, 8, -0.0}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got -0.0");
    expect_rope_invalid((kvp_rope_config){2, 8, -10000.0}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got -10000.0");
    expect_rope_invalid((kvp_rope_config){4, 8, -0.5}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got -0.5");
    expect_rope_invalid((kvp_rope_config){2, 8, NAN}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got NaN");
    expect_rope_invalid((kvp_rope_config){2, 8, INFINITY}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got inf");
    expect_rope_invalid((kvp_rope_config){2, 8, -INFINITY}, KVP_ROPE_INVALID_BASE,
                        "RoPE base must be finite and greater than zero, got -inf");
    /* Order: width, then positions, then base. */
    expect_rope_invalid((kvp_rope_config){5, 0, NAN}, KVP_ROPE_INVALID_WIDTH,
                        "RoPE feature width must be even and nonzero, got 5");
    expect_rope_invalid((kvp_rope_config){2, 0, -1.0}, KVP_ROPE_ZERO_POSITIONS,
                        "RoPE max positions must be nonzero");

    /* Valid configurations, including tiny and huge positive bases. */
    kvp_error err;
    memset(&err, 0x5A, sizeof err);
    kvp_error untouched;
    memcpy(&untouched, &err, sizeof err);
    const kvp_rope_config good[] = {
        {2, 1, ROPE_BASE}, {16, 4096, 500000.0}, {2, 8, DBL_MIN}, {2, 8, DBL_MAX}, {2, 8, 1.0}};
    for (size_t i = 0; i < KVPT_COUNT_OF(good); i++) {
        kvpt_assert_ok(kvp_rope_validate(&good[i], &err), &err);
    }
    assert_memory_equal(&err, &untouched, sizeof err); /* success leaves err alone */
    assert_int_equal(kvp_rope_validate(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "rope");
    assert_int_equal(kvp_rope_rotate(NULL, NULL, 0, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "rope");
    assert_int_equal(kvp_rope_rotate(&good[0], NULL, 0, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "features");
    kvpt_assert_error_text(&err, "argument `features` must not be NULL");
}

static void test_layer_rope_rotate_values(void **state)
{
    (void)state;
    kvp_error err;
    /* d_h = 2: theta_0 = 1, so the angle is the position. */
    kvp_rope_config two = {2, MAX_POSITIONS, ROPE_BASE};
    double x[2] = {1.0, 0.0};
    kvpt_assert_ok(kvp_rope_rotate(&two, x, 1, &err), &err);
    assert_true(x[0] == cos(1.0));
    assert_true(x[1] == sin(1.0));
    /* The seed's head-1 key at position 2: [1, 1] -> [cos 2 - sin 2, sin 2 + cos 2]. */
    double y[2] = {1.0, 1.0};
    kvpt_assert_ok(kvp_rope_rotate(&two, y, 2, &err), &err);
    kvpt_assert_close(y[0], -1.325444263, 1e-9);
    kvpt_assert_close(y[1], 0.493150590, 1e-9);
    kvpt_assert_close(y[0], cos(2.0) - sin(2.0), 1e-15);
    kvpt_assert_close(y[1], sin(2.0) + cos(2.0), 1e-15);
    /* The seed's head-0 inputs rotate back onto [1, 0]. */
    double z[2] = {cos(2.0), -sin(2.0)};
    kvpt_assert_ok(kvp_rope_rotate(&two, z, 2, &err), &err);
    kvpt_assert_close(z[0], 1.0, 1e-15);
    kvpt_assert_close(z[1], 0.0, 1e-15);
    /* Position 0 is the identity, bit for bit. */
    double w[2] = {0.3, -0.7};
    kvpt_assert_ok(kvp_rope_rotate(&two, w, 0, &err), &err);
    assert_true(w[0] == 0.3 && w[1] == -0.7);

    /* d_h = 4: theta_0 = 1, theta_1 = base^(-2/4) = 0.01. */
    kvp_rope_config four = {4, MAX_POSITIONS, ROPE_BASE};
    double v[4] = {1.0, 0.0, 1.0, 0.0};
    kvpt_assert_ok(kvp_rope_rotate(&four, v, 3, &err), &err);
    kvpt_assert_close(v[0], cos(3.0), 1e-15);
    kvpt_assert_close(v[1], sin(3.0), 1e-15);
    kvpt_assert_close(v[2], cos(0.03), 1e-15);
    kvpt_assert_close(v[3], sin(0.03), 1e-15);
    kvpt_assert_close(v[2], 0.999550033748988, 1e-14);
    kvpt_assert_close(v[3], 0.0299955002024957, 1e-14);
    double u[4] = {0.5, -2.0, 3.0, 0.25};
    kvpt_assert_ok(kvp_rope_rotate(&four, u, 7, &err), &err);
    kvpt_assert_close(u[0], 0.5 * cos(7.0) + 2.0 * sin(7.0), 1e-14);
    kvpt_assert_close(u[1], 0.5 * sin(7.0) - 2.0 * cos(7.0), 1e-14);
    kvpt_assert_close(u[2], 3.0 * cos(0.07) - 0.25 * sin(0.07), 1e-14);
    kvpt_assert_close(u[3], 3.0 * sin(0.07) + 0.25 * cos(0.07), 1e-14);

    /* Another base: d_h = 4 with base 100 gives theta_1 = 0.1. */
    kvp_rope_config hundred = {4, MAX_POSITIONS, 100.0};
    double t[4] = {0.0, 1.0, 0.0, 1.0};
    kvpt_assert_ok(kvp_rope_rotate(&hundred, t, 5, &err), &err);
    kvpt_assert_close(t[0], -sin(5.0), 1e-15);
    kvpt_assert_close(t[1], cos(5.0), 1e-15);
    kvpt_assert_close(t[2], -sin(0.5), 1e-15);
    kvpt_assert_close(t[3], cos(0.5), 1e-15);
}

static void test_layer_rope_rotate_out_of_range_changes_nothing(void **state)
{
    (void)state;
    kvp_rope_config rope = {4, MAX_POSITIONS, ROPE_BASE};
    double features[4] = {0.1, 0.2, 0.3, 0.4};
    const double untouched[4] = {0.1, 0.2, 0.3, 0.4};
    const size_t positions[] = {MAX_POSITIONS, MAX_POSITIONS + 1, SIZE_MAX};
    for (size_t i = 0; i < KVPT_COUNT_OF(positions); i++) {
        kvp_error err;
        memset(&err, 0x5A, sizeof err);
        assert_int_equal(kvp_rope_rotate(&rope, features, positions[i], &err),
                         KVP_ROPE_POSITION_OUT_OF_RANGE);
        assert_int_equal(err.status, KVP_ROPE_POSITION_OUT_OF_RANGE);
        assert_int_equal(err.position, positions[i]);
        assert_int_equal(err.layer_rope.feature_width, 4);
        assert_int_equal(err.layer_rope.max_positions, MAX_POSITIONS);
        assert_true(err.layer_rope.base == ROPE_BASE);
        char text[128];
        snprintf(text, sizeof text, "RoPE position %zu is out of range for 8 positions",
                 positions[i]);
        kvpt_assert_error_text(&err, text);
        assert_memory_equal(features, untouched, sizeof features);
    }
    /* The last position is in range. */
    kvp_error err;
    kvpt_assert_ok(kvp_rope_rotate(&rope, features, MAX_POSITIONS - 1, &err), &err);
    kvpt_assert_close(features[0], 0.1 * cos(7.0) - 0.2 * sin(7.0), 1e-15);
}

static void test_layer_rope_rotation_preserves_norm(void **state)
{
    (void)state;
    uint64_t rng = 0x5EED;
    const size_t widths[] = {2, 4, 8, 16};
    for (size_t w = 0; w < KVPT_COUNT_OF(widths); w++) {
        kvp_rope_config rope = {widths[w], 4096, ROPE_BASE};
        for (size_t trial = 0; trial < 32; trial++) {
            double features[16];
            double norm_before = 0.0;
            for (size_t f = 0; f < widths[w]; f++) {
                features[f] = kvpt_rand_unit(&rng) * 4.0;
                norm_before += features[f] * features[f];
            }
            size_t position = (size_t)(kvpt_rand_next(&rng) % rope.max_positions);
            kvp_error err;
            kvpt_assert_ok(kvp_rope_rotate(&rope, features, position, &err), &err);
            double norm_after = 0.0;
            for (size_t f = 0; f < widths[w]; f++) {
                norm_after += features[f] * features[f];
            }
            kvpt_assert_close(sqrt(norm_after), sqrt(norm_before), 1e-13);
        }
    }
}

/* The index of the first non-finite of values[0..n), or n. */
static size_t first_nonfinite(const double *values, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(values[i])) {
            return i;
        }
    }
    return n;
}

/* Does p * base^(-2i / width) stay finite for every pair i and position p < positions? */
static int all_angles_finite(size_t width, size_t positions, double base)
{
    for (size_t i = 0; i < width / 2; i++) {
        double theta = pow(base, -(double)(2 * i) / (double)width);
        if (!isfinite(theta) || !isfinite((double)(positions - 1) * theta)) {
            return 0;
        }
    }
    return 1;
}

/*
 * A positive, finite base is refused exactly when some rotation angle below
 * max_positions is not finite (checked against every angle, computed here
 * independently); an accepted one rotates the last position to finite
 * features. Refusals change nothing and name the configuration.
 */
static void test_layer_rope_refuses_bases_with_nonfinite_angles(void **state)
{
    (void)state;
    static const double bases[] = {5e-324, 1e-320, 1e-310, 1e-300, 1e-200, 1e-10, 0.5, 1.0,
                                   10000.0, 1e300, DBL_MAX};
    static const size_t widths[] = {2, 4, 44, 64, 128};
    static const size_t positions[] = {1, 8, 4096, SIZE_MAX};
    size_t refused = 0;
    size_t accepted = 0;
    for (size_t b = 0; b < KVPT_COUNT_OF(bases); b++) {
        for (size_t w = 0; w < KVPT_COUNT_OF(widths); w++) {
            for (size_t p = 0; p < KVPT_COUNT_OF(positions); p++) {
                kvp_rope_config rope = {widths[w], positions[p], bases[b]};
                kvp_error err;
                memset(&err, 0, sizeof err);
                kvp_status status = kvp_rope_validate(&rope, &err);
                if (all_angles_finite(widths[w], positions[p], bases[b])) {
                    kvpt_assert_ok(status, &err);
                    double features[128];
                    for (size_t i = 0; i < widths[w]; i++) {
                        features[i] = 1.0 - (double)i / 64.0;
                    }
                    kvpt_assert_ok(kvp_rope_rotate(&rope, features, positions[p] - 1, &err),
                                   &err);
                    assert_int_equal(first_nonfinite(features, widths[w]), widths[w]);
                    accepted++;
                    continue;
                }
                assert_int_equal(status, KVP_ROPE_INVALID_BASE);
                assert_int_equal(err.layer_rope.feature_width, widths[w]);
                assert_int_equal(err.layer_rope.max_positions, positions[p]);
                assert_true(err.layer_rope.base == bases[b]);
                double features[128] = {0.25};
                assert_int_equal(kvp_rope_rotate(&rope, features, 0, &err),
                                 KVP_ROPE_INVALID_BASE);
                assert_true(features[0] == 0.25 && features[1] == 0.0);
                refused++;
            }
        }
    }
    /* Both sides of the line are exercised. */
    assert_true(refused >= 10);
    assert_true(accepted >= 100);

    /* The case: 5e-324 over 64 features; the text says why. */
    kvp_rope_config tiny = {64, 8, 5e-324};
    kvp_error err;
    assert_int_equal(kvp_rope_validate(&tiny, &err), KVP_ROPE_INVALID_BASE);
    kvpt_assert_error_text(&err, "RoPE base 5e-324 gives a non-finite rotation angle within 8 "
                                 "positions of 64 features");
    /* Finite theta, but the angle at the last of SIZE_MAX positions overflows. */
    kvp_rope_config far = {64, SIZE_MAX, 1e-300};
    assert_int_equal(kvp_rope_validate(&far, &err), KVP_ROPE_INVALID_BASE);
    kvp_rope_config near = {64, 4096, 1e-300};
    kvpt_assert_ok(kvp_rope_validate(&near, &err), &err);
    /* Non-positive and non-finite bases keep the seed-style text. */
    kvp_rope_config zero = {64, 8, 0.0};
    assert_int_equal(kvp_rope_validate(&zero, &err), KVP_ROPE_INVALID_BASE);
    kvpt_assert_error_text(&err, "RoPE base must be finite and greater than zero, got 0.0");

    /* Layers refuse it through their RoPE over d_h = D / heads. */
    double *zeros = kvpt_doubles(64 * 64);
    kvp_param *p64 = NULL;
    kvpt_assert_ok(kvp_param_create(64, zeros, &p64, &err), &err);
    free(zeros);
    kvp_layer *layer = (kvp_layer *)0x1;
    assert_int_equal(kvp_layer_create(p64, p64, p64, p64, 1, 8, 5e-324, &layer, &err),
                     KVP_ROPE_INVALID_BASE);
    assert_ptr_equal(layer, (kvp_layer *)0x1);
    assert_int_equal(err.layer_rope.feature_width, 64);
    assert_int_equal(kvp_param_revision(p64), 0);
    /* Over 32 features the same base is fine: theta_15 = base^(-30/32) is finite. */
    kvpt_assert_ok(kvp_layer_create(p64, p64, p64, p64, 2, 8, 5e-324, &layer, &err), &err);
    kvpt_destroy_layer(layer);
    assert_int_equal(kvp_layer_create_random(64, 1, 8, 5e-324, 1, &layer, &err),
                     KVP_ROPE_INVALID_BASE);
    kvpt_assert_ok(kvp_param_release(p64, &err), &err);
}

/* ---- rectangular parameters ------------------------------------------------ */

/* Counts calls and checks the callback sees the row count as `width`. */
static void expect_rows_3(void *ctx, double *values, size_t width)
{
    (void)values;
    assert_int_equal(width, 3);
    ++*(size_t *)ctx;
}

static void test_layer_param_matrix_rows_and_cols(void **state)
{
    (void)state;
    double values[6] = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0};
    kvp_param *param = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create_matrix(3, 2, values, &param, &err), &err);
    assert_int_equal(kvp_param_rows(param), 3);
    assert_int_equal(kvp_param_cols(param), 2);
    assert_int_equal(kvp_param_rows(param), 3); /* the input width */
    assert_memory_equal(kvp_param_values(param), values, sizeof values);
    double next[6] = {6.0, 5.0, 4.0, 3.0, 2.0, 1.0};
    kvpt_assert_ok(kvp_param_update(param, next, &err), &err);
    assert_memory_equal(kvp_param_values(param), next, sizeof next);
    size_t calls = 0;
    kvpt_assert_ok(kvp_param_update_with(param, expect_rows_3, &calls, &err), &err);
    assert_int_equal(calls, 1);
    assert_int_equal(kvp_param_revision(param), 2);
    release(param);

    /* A square matrix is kvp_param_create's parameter. */
    kvpt_assert_ok(kvp_param_create_matrix(2, 2, values, &param, &err), &err);
    assert_int_equal(kvp_param_rows(param), 2);
    assert_int_equal(kvp_param_cols(param), 2);
    release(param);
    assert_int_equal(kvp_param_rows(NULL), 0);
    assert_int_equal(kvp_param_cols(NULL), 0);

    /* Refusals write nothing. */
    kvp_param *out = (kvp_param *)0x1;
    assert_int_equal(kvp_param_create_matrix(3, 2, NULL, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "values");
    assert_int_equal(kvp_param_create_matrix(3, 2, values, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_param_create_matrix(0, 2, values, &out, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `rows` is invalid: a parameter needs a nonzero row "
                                 "count");
    assert_int_equal(kvp_param_create_matrix(3, 0, values, &out, &err), KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `cols` is invalid: a parameter needs a nonzero column "
                                 "count");
    assert_int_equal(kvp_param_create_matrix(SIZE_MAX / 2, 3, values, &out, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `cols` is invalid: rows * cols overflows");
    assert_int_equal(kvp_param_create_matrix((size_t)1 << 31, (size_t)1 << 31, values, &out,
                                             &err),
                     KVP_INVALID_ARGUMENT);
    assert_ptr_equal(out, (kvp_param *)0x1);
}
int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layer_param_create_copies_values),
        cmocka_unit_test(test_layer_param_ids_are_unique_and_increasing),
        cmocka_unit_test(test_layer_param_revision_advances_by_one_on_every_update),
        cmocka_unit_test(test_layer_param_revision_reads_race_free_with_updates),
        cmocka_unit_test(test_layer_param_errors_and_null_queries),
        cmocka_unit_test(test_layer_shared_params_keep_identity_and_references),
        cmocka_unit_test(test_layer_rope_validate_errors),
        cmocka_unit_test(test_layer_rope_rotate_values),
        cmocka_unit_test(test_layer_rope_rotate_out_of_range_changes_nothing),
        cmocka_unit_test(test_layer_rope_rotation_preserves_norm),
        cmocka_unit_test(test_layer_rope_refuses_bases_with_nonfinite_angles),
        cmocka_unit_test(test_layer_param_matrix_rows_and_cols),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
