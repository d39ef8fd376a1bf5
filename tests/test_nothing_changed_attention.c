/*
 * test_nothing_changed_attention.c: every failing call of attention.h
 * (tickets, prepare, forward, commit, the reference, each allocation swept)
 * and of model.h changes nothing (status.h's contract), in the plain and the
 * cached world; the calls and their statuses are listed in the table of
 * test_nothing_changed.c. Invariant checked by every EXPECT_FAIL: the
 * snapshot (pool stats, slab digest, audit, caches, sequence, parameters,
 * tickets) and the prefix cache are as before, but for POOL_EXHAUSTED's one
 * exhaustion. Shares the world and its checks with the other
 * test_nothing_changed*.c programs (nothing_changed_support.h). Unit test
 * (ctest test_nothing_changed_attention, memcheck.* in release, label
 * threads under tsan): uses pager/alloc.h and pager/pool_internal.h.
 */
#include "nothing_changed_support.h"

/* ---- attention.h ---------------------------------------------------------------------- */

static kvp_status make_ticket(world *w, void **out, kvp_error *err)
{
    return kvp_ticket_create(w->cache, (kvp_ticket **)out, err);
}

static void destroy_ticket(world *w, void *object)
{
    kvpt_destroy_ticket((kvp_ticket *)object, w->pool);
}

/* The reference's out-parameter is a buffer: the sweep passes it through a box. */
typedef struct reference_box {
    double out[2 * 3 * D];
} reference_box;

static kvp_status make_reference(world *w, void **out, kvp_error *err)
{
    static reference_box box;
    double input[2 * 3 * D];
    row_input(input, 2, 3, 40);
    kvp_tensor view = kvp_tensor3(input, 2, 3, D);
    kvp_status status = kvp_attention_reference(w->layer, &view, box.out, 2 * 3 * D, NULL, NULL,
                                                0, err);
    if (status == KVP_OK) {
        *out = &box;
    }
    return status;
}

static void destroy_nothing(world *w, void *object)
{
    (void)w;
    (void)object;
}

static void test_nothing_changed_attention_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_ticket *ticket = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_create(NULL, &ticket, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_create(w.cache, NULL, &e));
    /* A layer-kind binding whose owner record is not attention's (hand-made):
     * attention cannot size a ticket for it. */
    kvp_binding not_attention;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &not_attention, &err), &err);
    memset(not_attention.record, 0, sizeof not_attention.record);
    kvp_cache *foreign_cache = kvpt_cache(w.pool, &not_attention, 1, 1);
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_ticket_create(foreign_cache, &ticket, &e));
    kvpt_destroy_cache(foreign_cache, w.pool);
    assert_ptr_equal(ticket, SENTINEL);
    sweep_call ticket_call = {make_ticket, destroy_ticket};
    assert_int_equal(sweep(&w, &ticket_call, 2), 2);
    EXPECT_NOOP(&w, kvp_ticket_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_discard(NULL, &e));

    /* Commit: the held ticket keeps its row and page through every refusal. */
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &binding, &err), &err);
    kvp_cache *foreign = kvpt_cache(w.pool, &binding, CACHE_B, CACHE_C);
    kvpt_snapshot_add_cache(&w.snap, foreign);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_commit(NULL, w.cache, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_commit(w.held, NULL, &e));
    EXPECT_FAIL(&w, KVP_TICKET_EMPTY, 0, kvp_ticket_commit(w.ticket, w.cache, &e));
    EXPECT_FAIL(&w, KVP_TICKET_FOREIGN_CACHE, 0, kvp_ticket_commit(w.held, foreign, &e));
    kvp_attention_result result;
    memset(&result, 0x5A, sizeof result);
    kvp_attention_result sentinel_result = result;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_result(NULL, &result, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_ticket_result(w.held, NULL, &e));
    kvp_ticket *fresh = kvpt_ticket(w.cache);
    EXPECT_FAIL(&w, KVP_TICKET_EMPTY, 0, kvp_ticket_result(fresh, &result, &e));
    assert_memory_equal(&result, &sentinel_result, sizeof result);

    /* Prepare and forward refuse, in the seed's order, leaving every ticket as it was. */
    double x[CACHE_B * 2 * (D + 1)];
    row_input(x, CACHE_B, 2, 41);
    kvp_tensor good = kvp_tensor3(x, CACHE_B, 1, D);
    kvp_tensor rank2 = good;
    rank2.shape.rank = 2;
    kvp_tensor two = kvp_tensor3(x, CACHE_B, 2, D);
    kvp_tensor batch2 = kvp_tensor3(x, CACHE_B + 1, 1, D);
    kvp_tensor wide = kvp_tensor3(x, CACHE_B, 1, D + 1);
    double nan_row[CACHE_B * D] = {0.5, NAN, 0.25, 1.0};
    kvp_tensor nan_input = kvp_tensor3(nan_row, CACHE_B, 1, D);
    const kvp_layer *layer1 = kvp_model_layer(w.model, 1);
    /* The same parameters under another RoPE base: only the RoPE check can tell. */
    kvp_layer *other_base = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_model_param_mut(w.model, 0, 0),
                                    kvp_model_param_mut(w.model, 0, 1),
                                    kvp_model_param_mut(w.model, 0, 2),
                                    kvp_model_param_mut(w.model, 0, 3),
                                    HEADS, POSITIONS, 500.0, &other_base, &err),
                   &err);
    /* An MQA layer of the same width and heads: only the KV head count differs. */
    kvp_layer *mqa = NULL;
    kvpt_assert_ok(kvp_layer_create_grouped(kvp_model_param_mut(w.model, 0, 0), w.narrow, w.narrow,
                                            kvp_model_param_mut(w.model, 0, 3), HEADS, 1, POSITIONS,
                                            BASE, &mqa, &err),
                   &err);
    const kvp_tensor *inputs[] = {&rank2, &two, &batch2, &wide, &good, &nan_input};
    const kvp_status input_errors[] = {KVP_INPUT_RANK,       KVP_SINGLE_TOKEN_REQUIRED,
                                       KVP_INPUT_BATCH_MISMATCH, KVP_INPUT_WIDTH_MISMATCH,
                                       KVP_CACHE_LAYER_MISMATCH, KVP_NONFINITE_PROJECTION};
    for (int forward = 0; forward < 2; forward++) {
        for (size_t i = 0; i < KVPT_COUNT_OF(inputs); i++) {
            const kvp_layer *with = i == 4 ? layer1 : w.layer;
            if (forward) {
                EXPECT_FAIL(&w, input_errors[i], 0,
                            kvp_attention_forward(with, inputs[i], w.cache, fresh, &e));
            } else {
                EXPECT_FAIL(&w, input_errors[i], 0,
                            kvp_attention_prepare(with, inputs[i], w.cache, fresh, &e));
            }
        }
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_forward(NULL, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_prepare(w.layer, NULL, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_prepare(w.layer, &good, NULL, fresh, &e));
        EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                    kvp_attention_forward(w.layer, &good, w.cache, NULL, &e));
        EXPECT_FAIL(&w, KVP_CACHE_ROPE_MISMATCH, 0,
                    kvp_attention_forward(other_base, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_CACHE_KV_HEAD_COUNT_MISMATCH, 0,
                    kvp_attention_prepare(mqa, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_CACHE_KV_HEAD_COUNT_MISMATCH, 0,
                    kvp_attention_forward(mqa, &good, w.cache, fresh, &e));
        EXPECT_FAIL(&w, KVP_TICKET_BUSY, 0,
                    kvp_attention_forward(w.layer, &good, w.cache, w.held, &e));
    }
    /* A ticket too small for the cache. */
    kvp_cache *small = kvpt_cache(w.pool, &binding, CACHE_B, 1);
    kvp_ticket *small_ticket = kvpt_ticket(small);
    EXPECT_FAIL(&w, KVP_TICKET_GEOMETRY_MISMATCH, 0,
                kvp_attention_prepare(w.layer, &good, w.cache, small_ticket, &e));
    /* FULL: the small cache after one row. */
    kvpt_assert_ok(kvp_attention_forward(w.layer, &good, small, small_ticket, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, small);
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_attention_forward(w.layer, &good, small, fresh, &e));
    /* A score that overflows: a huge input row whose projections stay finite. */
    double huge_row[CACHE_B * D] = {1e156, -1e156, 1e156, 1e156};
    kvp_tensor huge = kvp_tensor3(huge_row, CACHE_B, 1, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_SCORE, 0,
                kvp_attention_forward(w.layer, &huge, w.cache, fresh, &e));

    /* The stale ticket: prepared, then the cache moves on through another ticket. */
    kvp_ticket *stale = kvpt_ticket(small);
    kvpt_assert_ok(kvp_cache_reset(small, &err), &err);
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &good, small, stale, &err), &err);
    kvpt_assert_ok(kvp_attention_forward(w.layer, &good, small, small_ticket, &err), &err);
    kvpt_snapshot_add_ticket(&w.snap, stale);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_TICKET_STALE, 0, kvp_ticket_commit(stale, small, &e));
    kvpt_assert_ok(kvp_ticket_discard(stale, &err), &err);

    /* POOL_EXHAUSTED: the cache opens a block (len 4 -> the held row is at a boundary). */
    kvpt_assert_ok(kvp_ticket_discard(w.held, &err), &err);
    kvp_ticket *filler_ticket = NULL;
    kvp_cache *filler = fill_pool(&w, &filler_ticket);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_attention_prepare(w.layer, &good, w.cache, fresh, &e));
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_attention_forward(w.layer, &good, w.cache, fresh, &e));

    /* The reference: nothing written on any error. */
    double out[2 * 3 * D];
    double keys[2 * 3 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_fill(keys, KVPT_COUNT_OF(keys), 7.0);
    double input[2 * 3 * D];
    row_input(input, 2, 3, 42);
    kvp_tensor three = kvp_tensor3(input, 2, 3, D);
    kvp_tensor bad_shape = kvp_tensor3(input, 2, 3, D + 1);
    kvp_tensor too_long = kvp_tensor3(input, 1, POSITIONS + 1, D);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(NULL, &three, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(w.layer, NULL, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_attention_reference(w.layer, &three, NULL, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_REFERENCE_INPUT_SHAPE, 0,
                kvp_attention_reference(w.layer, &bad_shape, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_ROPE_POSITION_OUT_OF_RANGE, 0,
                kvp_attention_reference(w.layer, &too_long, out, 24, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_attention_reference(w.layer, &three, out, 23, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, NULL, 23, &e));
    input[D + 1] = NAN; /* lane 0, token 1 */
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, keys, 24, &e));
    row_input(input, 2, 3, 42);
    for (size_t i = 0; i < D; i++) {
        input[2 * D + i] = huge_row[i]; /* lane 0, token 2 */
    }
    EXPECT_FAIL(&w, KVP_NONFINITE_SCORE, 0,
                kvp_attention_reference(w.layer, &three, out, 24, keys, keys, 24, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_assert_filled(keys, KVPT_COUNT_OF(keys), 7.0);
    sweep_call reference_call = {make_reference, destroy_nothing};
    assert_int_equal(sweep(&w, &reference_call, 1), 1);

    kvpt_destroy_ticket(filler_ticket, w.pool);
    kvpt_destroy_cache(filler, w.pool);
    kvpt_destroy_ticket(stale, w.pool);
    kvpt_destroy_ticket(small_ticket, w.pool);
    kvpt_destroy_cache(small, w.pool);
    kvpt_destroy_ticket(fresh, w.pool);
    kvpt_destroy_cache(foreign, w.pool);
    kvpt_destroy_layer(other_base);
    kvpt_destroy_layer(mqa);
    world_free(&w);
}

/* ---- model.h ---------------------------------------------------------------------------- */

static kvp_status make_model(world *w, void **out, kvp_error *err)
{
    const kvp_layer *layers[2] = {kvp_model_layer(w->model, 1), w->layer};
    return kvp_model_create(layers, 2, (kvp_model **)out, err);
}

static kvp_status make_random_model(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_model_create_random(2, D, HEADS, POSITIONS, BASE, 3, (kvp_model **)out, err);
}

static kvp_status make_random_grouped_model(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_model_create_random_grouped(2, D, HEADS, 1, POSITIONS, BASE, 3,
                                           (kvp_model **)out, err);
}

static void destroy_model(world *w, void *object)
{
    (void)w;
    kvpt_destroy_model((kvp_model *)object);
}

static void test_nothing_changed_model_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_model *model = SENTINEL;
    kvp_layer *odd = kvpt_random_layer(D, 1, POSITIONS, BASE, 9);
    const kvp_layer *layers[3] = {w.layer, NULL, odd};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(NULL, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(layers, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_model_create(layers, 0, &model, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_create(layers, 2, &model, &e));
    layers[1] = odd;
    EXPECT_FAIL(&w, KVP_MODEL_GEOMETRY_MISMATCH, 0, kvp_model_create(layers, 2, &model, &e));
    /* Same width, heads and head width; only the KV heads differ. */
    kvp_layer *mqa = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D, HEADS, 1, POSITIONS, BASE, 9, &mqa, &err),
                   &err);
    layers[1] = mqa;
    EXPECT_FAIL(&w, KVP_MODEL_GEOMETRY_MISMATCH, 0, kvp_model_create(layers, 2, &model, &e));
    kvpt_destroy_layer(mqa);
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_model_create_random_grouped(2, D, HEADS, 3, 8, BASE, 1, &model, &e));
    assert_ptr_equal(model, SENTINEL);
    sweep_call grouped_model_call = {make_random_grouped_model, destroy_model};
    assert_true(sweep(&w, &grouped_model_call, 12) >= 12);
    sweep_call model_call = {make_model, destroy_model};
    assert_int_equal(sweep(&w, &model_call, 3), 3);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_model_create_random(2, D, HEADS, 8, BASE, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_model_create_random(0, D, HEADS, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_model_create_random(SIZE_MAX, D, HEADS, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_model_create_random(2, D, 3, 8, BASE, 1, &model, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_model_create_random(2, 64, 1, 8, 5e-324, 1, &model, &e));
    assert_ptr_equal(model, SENTINEL);
    sweep_call random_call = {make_random_model, destroy_model};
    assert_true(sweep(&w, &random_call, 12) >= 12);

    EXPECT_NOOP(&w, kvp_model_destroy(NULL, &e));
    /* The world's sequence still runs the model (world_free then destroys both). */
    EXPECT_FAIL(&w, KVP_MODEL_BUSY, 0, kvp_model_destroy(w.model, &e));
    kvp_model_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_model_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_model_info_get(w.model, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);
    kvpt_destroy_layer(odd);
    world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_nothing_changed_attention_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_model_functions, kvpt_disarm),
        CACHED_TEST(test_nothing_changed_attention_functions),
        CACHED_TEST(test_nothing_changed_model_functions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
