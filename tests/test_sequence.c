/*
 * test_sequence.c: models and sequences made and refused — models sharing
 * their source layers' parameters, geometry mismatches with exact details
 * and texts, deterministic random models, a model refusing destruction while
 * sequences live (ModelBusy); allocation fault sweeps over model and
 * sequence creation; creation errors and queries; failures with no
 * kvp_error to fill returning the same status and changing nothing.
 * The family's other programs: test_sequence_step.c (steps and prefill
 * against the reference, all-or-nothing) and test_sequence_pages.c (reset
 * and replay, promises, admission, page arithmetic, the allocator-only
 * append); shared helpers are in sequence_support.h. Leaks of a failed call
 * are caught by the memcheck run of each program (ctest). Unit test: uses
 * pager/alloc.h and serve/sequence_internal.h.
 */
#include "sequence_support.h"

/* ---- models ---------------------------------------------------------------- */

static void test_sequence_model_create_shares_parameters(void **state)
{
    (void)state;
    enum { L = 3 };
    kvp_layer *src[L];
    for (size_t l = 0; l < L; l++) {
        src[l] = kvpt_random_layer(MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, 200 + l);
    }
    kvp_model *model = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_model_create((const kvp_layer *const *)src, L, &model, &err), &err);
    kvp_model_info info;
    kvp_model_info_init(&info);
    kvpt_assert_ok(kvp_model_info_get(model, &info, &err), &err);
    assert_int_equal(info.layers, L);
    assert_int_equal(info.model_width, MODEL_WIDTH);
    assert_int_equal(info.heads, HEADS);
    assert_int_equal(info.head_width, HEAD_WIDTH);

    kvp_binding src_bindings[L];
    for (size_t l = 0; l < L; l++) {
        const kvp_layer *layer = kvp_model_layer(model, l);
        assert_non_null(layer);
        assert_ptr_not_equal(layer, src[l]); /* its own layer object ... */
        kvp_binding mine;
        kvpt_assert_ok(kvp_layer_binding_get(layer, &mine, &err), &err);
        kvpt_assert_ok(kvp_layer_binding_get(src[l], &src_bindings[l], &err), &err);
        /* ... over the same parameter nodes, revisions and RoPE. */
        for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
            assert_ptr_equal(kvp_layer_param(layer, i), kvp_layer_param(src[l], i));
            assert_ptr_equal(kvp_model_param_mut(model, l, i), kvp_layer_param(layer, i));
            assert_int_equal(kvpt_record(&mine).node_id[i],
                             kvpt_record(&src_bindings[l]).node_id[i]);
            assert_int_equal(kvpt_record(&mine).revision[i],
                             kvpt_record(&src_bindings[l]).revision[i]);
        }
        assert_memory_equal(&mine, &src_bindings[l], sizeof mine);
    }
    assert_null(kvp_model_layer(model, L));
    assert_null(kvp_model_layer(model, SIZE_MAX));
    assert_null(kvp_model_layer(NULL, 0));
    assert_null(kvp_model_param_mut(model, L, 0));
    assert_null(kvp_model_param_mut(model, 0, KVP_PARAM_COUNT));
    assert_null(kvp_model_param_mut(NULL, 0, 0));

    /* A cache bound to a source layer serves the model's layer: same identities. */
    kvp_pool *pool = make_pool(2, 4);
    kvp_cache *cache = kvpt_cache(pool, &src_bindings[1], 1, 4);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double row[MODEL_WIDTH];
    kvpt_fill_random(row, MODEL_WIDTH, 9);
    kvp_tensor input = kvp_tensor3(row, 1, 1, MODEL_WIDTH);
    kvpt_assert_ok(kvp_attention_forward(kvp_model_layer(model, 1), &input, cache, ticket, &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_len(cache), 1);

    /* The model holds its own references: the sources can go first (memcheck). */
    for (size_t l = 0; l < L; l++) {
        kvpt_destroy_layer(src[l]);
    }
    kvpt_assert_ok(kvp_attention_forward(kvp_model_layer(model, 1), &input, cache, ticket, &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_len(cache), 2);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static void test_sequence_model_geometry_mismatch_and_errors(void **state)
{
    (void)state;
    kvp_layer *a = kvpt_random_layer(8, 2, MAX_POSITIONS, ROPE_BASE, 1); /* 2 heads of width 4 */
    kvp_layer *b = kvpt_random_layer(8, 4, MAX_POSITIONS, ROPE_BASE, 2); /* 4 heads of width 2 */
    kvp_layer *c = kvpt_random_layer(4, 2, MAX_POSITIONS, ROPE_BASE, 3); /* 2 heads of width 2 */
    kvp_layer *d = kvpt_random_layer(4, 1, MAX_POSITIONS, ROPE_BASE, 4); /* 1 head of width 4 */
    kvp_model *out = (kvp_model *)0x1;
    kvp_error err;

    const kvp_layer *heads_and_width[] = {a, b};
    memset(&err, 0x5A, sizeof err);
    assert_int_equal(kvp_model_create(heads_and_width, 2, &out, &err),
                     KVP_MODEL_GEOMETRY_MISMATCH);
    assert_int_equal(err.status, KVP_MODEL_GEOMETRY_MISMATCH);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.pool_geometry.heads, 2);
    assert_int_equal(err.pool_geometry.head_width, 4);
    assert_int_equal(err.binding_geometry.heads, 4);
    assert_int_equal(err.binding_geometry.head_width, 2);
    kvpt_assert_error_text(&err,
                           "model layer 1 geometry (4 heads, head width 2) differs from layer 0 "
                           "geometry (2 heads, head width 4)");
    assert_ptr_equal(out, (kvp_model *)0x1);
    assert_string_equal(kvp_status_name(KVP_MODEL_GEOMETRY_MISMATCH), "ModelGeometryMismatch");

    /* Only the head width differs, at layer 2. */
    const kvp_layer *width_only[] = {a, a, c};
    assert_int_equal(kvp_model_create(width_only, 3, &out, &err), KVP_MODEL_GEOMETRY_MISMATCH);
    assert_int_equal(err.layer, 2);
    kvpt_assert_error_text(&err,
                           "model layer 2 geometry (2 heads, head width 2) differs from layer 0 "
                           "geometry (2 heads, head width 4)");
    /* Only the head count differs. */
    const kvp_layer *heads_only[] = {a, d};
    assert_int_equal(kvp_model_create(heads_only, 2, &out, &err), KVP_MODEL_GEOMETRY_MISMATCH);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.binding_geometry.heads, 1);
    assert_int_equal(err.binding_geometry.head_width, 4);
    kvpt_assert_error_text(&err,
                           "model layer 1 geometry (1 heads, head width 4) differs from layer 0 "
                           "geometry (2 heads, head width 4)");
    assert_ptr_equal(out, (kvp_model *)0x1);
    /* Only the KV head count differs: pages would disagree, so the model refuses. */
    kvp_layer *a_mqa = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(8, 2, 1, MAX_POSITIONS, ROPE_BASE, 6, &a_mqa,
                                                   &err),
                   &err);
    const kvp_layer *kv_only[] = {a, a_mqa};
    assert_int_equal(kvp_model_create(kv_only, 2, &out, &err), KVP_MODEL_GEOMETRY_MISMATCH);
    assert_int_equal(err.layer, 1);
    assert_int_equal(err.kv_heads, 1);
    assert_int_equal(err.expected_kv_heads, 2);
    kvpt_assert_error_text(&err,
                           "model layer 1 geometry (2 heads, 1 KV heads, head width 4) differs "
                           "from layer 0 geometry (2 heads, 2 KV heads, head width 4)");
    assert_ptr_equal(out, (kvp_model *)0x1);
    const kvp_layer *all_mqa[] = {a_mqa, a_mqa};
    kvpt_assert_ok(kvp_model_create(all_mqa, 2, &out, &err), &err);
    kvp_model_info mqa_info;
    kvp_model_info_init(&mqa_info);
    kvpt_assert_ok(kvp_model_info_get(out, &mqa_info, &err), &err);
    assert_int_equal(mqa_info.heads, 2);
    assert_int_equal(mqa_info.kv_heads, 1);
    assert_int_equal(mqa_info.head_width, 4);
    kvpt_destroy_model(out);
    out = (kvp_model *)0x1;
    kvpt_destroy_layer(a_mqa);
    assert_int_equal(kvp_model_create_random_grouped(2, 8, 2, 3, MAX_POSITIONS, ROPE_BASE, 1, &out,
                                                     &err),
                     KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS);
    assert_ptr_equal(out, (kvp_model *)0x1);

    /* count 0, NULLs. */
    const kvp_layer *one[] = {a};
    assert_int_equal(kvp_model_create(one, 0, &out, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "count");
    kvpt_assert_error_text(&err, "argument `count` is invalid: a model needs at least one layer");
    assert_int_equal(kvp_model_create(NULL, 1, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layers");
    assert_int_equal(kvp_model_create(one, 1, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    const kvp_layer *with_null[] = {a, NULL};
    assert_int_equal(kvp_model_create(with_null, 2, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layers[i]");
    assert_int_equal(kvp_model_create(heads_and_width, 2, &out, NULL),
                     KVP_MODEL_GEOMETRY_MISMATCH);
    assert_ptr_equal(out, (kvp_model *)0x1);

    /* Random models: zero layers, a bad geometry, NULL out. */
    assert_int_equal(kvp_model_create_random(0, 8, 2, MAX_POSITIONS, ROPE_BASE, 1, &out, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "layers");
    assert_int_equal(kvp_model_create_random(2, 8, 3, MAX_POSITIONS, ROPE_BASE, 1, &out, &err),
                     KVP_HEADS_DO_NOT_DIVIDE_WIDTH);
    assert_int_equal(kvp_model_create_random(2, 8, 2, MAX_POSITIONS, ROPE_BASE, 1, NULL, &err),
                     KVP_NULL_ARGUMENT);
    assert_ptr_equal(out, (kvp_model *)0x1);

    kvp_model_info info;
    kvp_model_info_init(&info);
    assert_int_equal(kvp_model_info_get(NULL, &info, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "model");
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_model_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }

    /* The geometries agree when only layers' max positions differ. */
    kvp_layer *short_a = kvpt_random_layer(8, 2, 4, ROPE_BASE, 5);
    const kvp_layer *mixed[] = {a, short_a};
    kvpt_assert_ok(kvp_model_create(mixed, 2, &out, &err), &err);
    kvpt_assert_ok(kvp_model_info_get(out, &info, &err), &err);
    assert_int_equal(info.layers, 2);
    kvpt_destroy_model(out);
    kvpt_destroy_layer(short_a);
    kvpt_destroy_layer(a);
    kvpt_destroy_layer(b);
    kvpt_destroy_layer(c);
    kvpt_destroy_layer(d);
}

static void test_sequence_model_create_random_is_deterministic(void **state)
{
    (void)state;
    enum { L = 3 };
    const uint64_t seed = 500;
    kvp_model *first = make_model(L, seed);
    kvp_model *second = make_model(L, seed);
    kvp_model *other = make_model(L, seed + 1);
    for (size_t l = 0; l < L; l++) {
        kvp_layer *expected =
            kvpt_random_layer(MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, seed + l);
        const kvp_layer *mine = kvp_model_layer(first, l);
        const kvp_layer *twin = kvp_model_layer(second, l);
        const kvp_layer *shifted = kvp_model_layer(other, l);
        kvpt_assert_layer_info(mine, MODEL_WIDTH, HEADS, HEAD_WIDTH, MAX_POSITIONS, ROPE_BASE);
        for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
            const kvp_param *p = kvp_layer_param(mine, i);
            assert_memory_equal(kvp_param_values(p), kvp_param_values(kvp_layer_param(expected, i)),
                                MODEL_WIDTH * MODEL_WIDTH * sizeof(double));
            assert_memory_equal(kvp_param_values(p), kvp_param_values(kvp_layer_param(twin, i)),
                                MODEL_WIDTH * MODEL_WIDTH * sizeof(double));
            /* Fresh parameter nodes in each model. */
            assert_int_not_equal(kvp_param_id(p), kvp_param_id(kvp_layer_param(twin, i)));
            assert_int_not_equal(kvp_param_id(p), kvp_param_id(kvp_layer_param(expected, i)));
            assert_int_equal(kvp_param_revision(p), 0);
        }
        /* seed + 1's layer l is seed's layer l + 1. */
        if (l + 1 < L) {
            for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
                assert_memory_equal(kvp_param_values(kvp_layer_param(shifted, i)),
                                    kvp_param_values(kvp_layer_param(kvp_model_layer(first, l + 1),
                                                                     i)),
                                    MODEL_WIDTH * MODEL_WIDTH * sizeof(double));
            }
        }
        kvpt_destroy_layer(expected);
    }
    /* Adjacent layers of one model differ. */
    assert_memory_not_equal(kvp_param_values(kvp_layer_param(kvp_model_layer(first, 0), 0)),
                            kvp_param_values(kvp_layer_param(kvp_model_layer(first, 1), 0)),
                            MODEL_WIDTH * MODEL_WIDTH * sizeof(double));
    kvpt_destroy_model(first);
    kvpt_destroy_model(second);
    kvpt_destroy_model(other);
}

/* ---- allocation fault sweeps ----------------------------------------------- */

/* A failed step (kvpt_assert_fault_failed) at `site`. */
static void assert_step_failed(const kvpt_fault_step *s, uint64_t nth, kvpi_fault_site site)
{
    kvpt_assert_fault_failed(s, nth);
    assert_int_equal(s->site, site);
}

static void test_sequence_model_fault_sweeps(void **state)
{
    (void)state;
    enum { L = 3 };
    /* The template array, each layer (values scratch, four parameters, the layer), then
     * the model and its own layers. */
    kvpi_fault_site sites[2 + 7 * L];
    size_t n = 0;
    sites[n++] = KVPI_SITE_SCRATCH;
    for (size_t l = 0; l < L; l++) {
        sites[n++] = KVPI_SITE_SCRATCH;
        for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
            sites[n++] = KVPI_SITE_PARAM;
        }
        sites[n++] = KVPI_SITE_LAYER;
    }
    sites[n++] = KVPI_SITE_MODEL;
    for (size_t l = 0; l < L; l++) {
        sites[n++] = KVPI_SITE_LAYER;
    }
    assert_int_equal(n, KVPT_COUNT_OF(sites));
    kvp_model *expected = make_model(L, 77);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_model *model = (kvp_model *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_model_create_random(L, MODEL_WIDTH, HEADS, MAX_POSITIONS,
                                                           ROPE_BASE, 77, &model, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            for (size_t l = 0; l < L; l++) {
                for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
                    assert_memory_equal(
                        kvp_param_values(kvp_layer_param(kvp_model_layer(model, l), i)),
                        kvp_param_values(kvp_layer_param(kvp_model_layer(expected, l), i)),
                        MODEL_WIDTH * MODEL_WIDTH * sizeof(double));
                }
            }
            kvpt_destroy_model(model);
            break;
        }
        failures++;
        assert_true(nth <= KVPT_COUNT_OF(sites));
        assert_step_failed(&s, nth, sites[nth - 1]);
        assert_string_equal(s.err.what, kvpi_fault_site_name(sites[nth - 1]));
        if (nth == 1) {
            assert_int_equal(s.err.bytes, L * sizeof(kvp_layer *));
        }
        assert_ptr_equal(model, (kvp_model *)0x1);
    }
    assert_int_equal(failures, KVPT_COUNT_OF(sites));

    /* kvp_model_create: the model, then one layer object per layer. */
    const kvp_layer *src[L];
    for (size_t l = 0; l < L; l++) {
        src[l] = kvp_model_layer(expected, l);
    }
    failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_model *model = (kvp_model *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_model_create(src, L, &model, &s.err));
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            kvpt_destroy_model(model);
            break;
        }
        failures++;
        assert_step_failed(&s, nth, nth == 1 ? KVPI_SITE_MODEL : KVPI_SITE_LAYER);
        assert_ptr_equal(model, (kvp_model *)0x1);
    }
    /* Failed models dropped the parameter references they had taken (memcheck sees a leak). */
    assert_int_equal(failures, 1 + L);
    kvpt_destroy_model(expected);
}

static void test_sequence_create_fault_sweep(void **state)
{
    (void)state;
    enum { L = 3, B = 2, BT = 3, C = 7 };
    kvp_model *model = make_model(L, 88);
    kvp_pool *pool = make_pool(BT, L + L * B * KVPT_CEIL_DIV(C, BT));
    /* Another sequence holds pages, so "unchanged" covers a busy pool. */
    kvp_sequence *busy = kvpt_sequence(model, pool, 1, C);
    kvp_error err;
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(busy, 2, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(before.attached_caches, L);
    assert_int_equal(before.held_pages, L);

    /* Layer 0's cache first (it validates), the sequence and its one buffer block, layer 0's
     * ticket, then each further layer's cache and ticket. */
    static const kvpi_fault_site sites[] = {
        KVPI_SITE_CACHE_STRUCT, KVPI_SITE_CACHE_TABLES, KVPI_SITE_SEQUENCE,
        KVPI_SITE_SEQUENCE,     KVPI_SITE_TICKET,       KVPI_SITE_SCRATCH,
        KVPI_SITE_CACHE_STRUCT, KVPI_SITE_CACHE_TABLES, KVPI_SITE_TICKET,
        KVPI_SITE_SCRATCH,      KVPI_SITE_CACHE_STRUCT, KVPI_SITE_CACHE_TABLES,
        KVPI_SITE_TICKET,       KVPI_SITE_SCRATCH};
    /* Cache and ticket pointers, L + 2 activation rows, the blocked prefill's workspace
     * (64 tokens: this one is far below its byte cap), and every page id it can hold. */
    const size_t prefill_doubles = KVPI_PREFILL_BLOCK_DEFAULT *
                                   (B * HEADS * C + (2 * L + 5) * B * MODEL_WIDTH);
    const size_t buffer_bytes = 2 * L * sizeof(void *) +
                                (L + 2) * B * MODEL_WIDTH * sizeof(double) +
                                prefill_doubles * sizeof(double) +
                                L * B * KVPT_CEIL_DIV(C, BT) * sizeof(uint32_t);
    uint64_t failures = 0;
    for (uint64_t nth = 1;; nth++) {
        assert_true(nth <= SWEEP_LIMIT);
        kvp_sequence *seq = (kvp_sequence *)0x1;
        kvpt_fault_step s;
        kvpt_fault_step_arm(&s, nth);
        kvpt_fault_step_finish(&s, kvp_sequence_create(model, pool, B, C, &seq, &s.err));
        kvpt_assert_pool_ok(pool);
        if (!s.fired) {
            kvpt_assert_ok(s.status, &s.err);
            assert_int_equal(s.calls, failures);
            assert_int_equal(kvpt_stats(pool).attached_caches, 2 * L);
            assert_int_equal(kvp_sequence_len(seq), 0);
            kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, C, &err), &err);
            kvpt_assert_pool_ok(pool);
            assert_int_equal(kvp_sequence_held_pages(seq), L * B * KVPT_CEIL_DIV(C, BT));
            kvpt_destroy_sequence(seq, pool);
            break;
        }
        failures++;
        assert_true(nth <= KVPT_COUNT_OF(sites));
        assert_step_failed(&s, nth, sites[nth - 1]);
        if (nth == 4) {
            assert_string_equal(s.err.what, "sequence buffers");
            assert_int_equal(s.err.bytes, buffer_bytes);
        }
        assert_ptr_equal(seq, (kvp_sequence *)0x1);
        kvp_pool_stats after = kvpt_stats(pool);
        assert_memory_equal(&before, &after, sizeof before);
        assert_int_equal(after.attached_caches, L);
    }
    assert_int_equal(failures, KVPT_COUNT_OF(sites));
    kvpt_destroy_sequence(busy, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- creation ------------------------------------------------------------- */

static void expect_sequence_create_failure(const kvp_model *model, kvp_pool *pool, size_t batch,
                                           size_t capacity, kvp_status status, kvp_error *err)
{
    kvp_pool_stats before = kvpt_stats(pool);
    kvp_sequence *out = (kvp_sequence *)0x1;
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_sequence_create(model, pool, batch, capacity, &out, err), status);
    assert_int_equal(err->status, status);
    assert_ptr_equal(out, (kvp_sequence *)0x1);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
}

/*
 * A model outlives its sequences: kvp_model_destroy refuses with ModelBusy,
 * changing nothing, while any sequence created on it is alive (a failed
 * creation does not count), and succeeds once the last one is destroyed.
 */
static void test_sequence_model_destroy_refuses_live_sequences(void **state)
{
    (void)state;
    enum { L = 2, B = 1, BT = 2, C = 4 };
    kvp_model *model = make_model(L, 5);
    kvp_pool *pool = make_pool(BT, 8);
    kvp_sequence *a = kvpt_sequence(model, pool, B, C);
    kvp_sequence *b = kvpt_sequence(model, pool, B, C);
    double x[B * MODEL_WIDTH];
    double out[B * MODEL_WIDTH];
    kvpt_fill_random(x, B * MODEL_WIDTH, 50);
    kvp_tensor input = kvp_tensor3(x, B, 1, MODEL_WIDTH);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_step(a, &input, NULL, NULL, out, B * MODEL_WIDTH, &err), &err);
    kvp_binding before[L];
    for (size_t l = 0; l < L; l++) {
        kvpt_assert_ok(kvp_layer_binding_get(kvp_model_layer(model, l), &before[l], &err), &err);
    }
    kvp_pool_stats stats = kvpt_stats(pool);

    assert_int_equal(kvp_model_destroy(model, &err), KVP_MODEL_BUSY);
    assert_int_equal(err.status, KVP_MODEL_BUSY);
    kvpt_assert_error_text(&err, "model still has live sequences; destroy them before the model");
    kvpt_assert_ok(kvp_sequence_destroy(b, &err), &err);
    assert_int_equal(kvp_model_destroy(model, NULL), KVP_MODEL_BUSY);
    /* A creation that fails adds no live sequence. */
    kvp_sequence *failed = (kvp_sequence *)0x1;
    assert_int_equal(kvp_sequence_create(model, pool, 0, C, &failed, &err), KVP_ZERO_BATCH_SIZE);
    assert_ptr_equal(failed, (kvp_sequence *)0x1);

    /* Nothing changed: the model and the live sequence still work as before. */
    for (size_t l = 0; l < L; l++) {
        kvp_binding now;
        kvpt_assert_ok(kvp_layer_binding_get(kvp_model_layer(model, l), &now, &err), &err);
        assert_memory_equal(&now, &before[l], sizeof now);
    }
    kvp_model_info info;
    kvp_model_info_init(&info);
    kvpt_assert_ok(kvp_model_info_get(model, &info, &err), &err);
    assert_int_equal(info.layers, L);
    kvp_pool_stats after = kvpt_stats(pool);
    /* b's destruction detached its empty caches; the refusals changed nothing. */
    assert_int_equal(after.held_pages, stats.held_pages);
    assert_int_equal(after.held_pages, L * B);
    assert_int_equal(after.attached_caches, stats.attached_caches - L);
    assert_int_equal(after.acquires, stats.acquires);
    assert_int_equal(after.releases, stats.releases);
    kvpt_assert_ok(kvp_sequence_step(a, &input, NULL, NULL, out, B * MODEL_WIDTH, &err), &err);
    assert_int_equal(kvp_sequence_len(a), 2);
    kvpt_assert_pool_ok(pool);

    kvpt_destroy_sequence(a, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);
}

static void test_sequence_create_errors_and_queries(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 6 };
    kvp_model *model = make_model(L, 3);
    kvp_pool *pool = make_pool(BT, 8);
    kvp_error err;
    kvp_sequence *out = (kvp_sequence *)0x1;
    assert_int_equal(kvp_sequence_create(NULL, pool, B, C, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "model");
    assert_int_equal(kvp_sequence_create(model, NULL, B, C, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    assert_int_equal(kvp_sequence_create(model, pool, B, C, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_ptr_equal(out, (kvp_sequence *)0x1);
    kvpt_assert_pool_ok(pool);

    expect_sequence_create_failure(model, pool, 0, C, KVP_ZERO_BATCH_SIZE, &err);
    expect_sequence_create_failure(model, pool, B, 0, KVP_ZERO_CAPACITY, &err);
    expect_sequence_create_failure(model, pool, B, MAX_POSITIONS + 1,
                                   KVP_CAPACITY_EXCEEDS_POSITIONS, &err);
    assert_int_equal(err.capacity, MAX_POSITIONS + 1);
    assert_int_equal(err.max_positions, MAX_POSITIONS);
    /* A pool of another page geometry. */
    kvp_pool *wide = kvpt_pool(BT, 4, 2, 4);
    expect_sequence_create_failure(model, wide, B, C, KVP_GEOMETRY_MISMATCH, &err);
    assert_int_equal(err.pool_geometry.heads, 4);
    assert_int_equal(err.pool_geometry.head_width, 2);
    assert_int_equal(err.binding_geometry.heads, HEADS);
    assert_int_equal(err.binding_geometry.head_width, HEAD_WIDTH);
    kvpt_destroy_pool(wide);

    /* Layer 1 allows fewer positions: its cache fails after layer 0's was made. */
    kvp_layer *first = kvpt_random_layer(MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, 10);
    kvp_layer *short_layer = kvpt_random_layer(MODEL_WIDTH, HEADS, 4, ROPE_BASE, 11);
    const kvp_layer *list[] = {first, short_layer};
    kvp_model *mixed = NULL;
    kvpt_assert_ok(kvp_model_create(list, 2, &mixed, &err), &err);
    expect_sequence_create_failure(mixed, pool, B, C, KVP_CAPACITY_EXCEEDS_POSITIONS, &err);
    assert_int_equal(err.max_positions, 4);
    kvp_sequence *fits = kvpt_sequence(mixed, pool, B, 4);
    assert_int_equal(kvp_sequence_capacity(fits), 4);
    kvpt_destroy_sequence(fits, pool);
    kvpt_destroy_model(mixed);
    kvpt_destroy_layer(first);
    kvpt_destroy_layer(short_layer);

    /* A good sequence: one empty cache per layer, bound to its layer. */
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    assert_int_equal(kvp_sequence_len(seq), 0);
    assert_int_equal(kvp_sequence_capacity(seq), C);
    assert_int_equal(kvp_sequence_held_pages(seq), 0);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0);
    assert_int_equal(kvpt_sequence_layers(seq), L);
    assert_int_equal(kvpt_stats(pool).attached_caches, L);
    assert_int_equal(kvpt_stats(pool).held_pages, 0);
    for (size_t l = 0; l < L; l++) {
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(kvp_sequence_cache(seq, l), &info, &err), &err);
        assert_int_equal(info.batch_size, B);
        assert_int_equal(info.capacity, C);
        assert_int_equal(info.len, 0);
        assert_int_equal(info.block_tokens, BT);
        kvp_binding binding;
        kvpt_assert_ok(kvp_layer_binding_get(kvp_model_layer(model, l), &binding, &err), &err);
        assert_memory_equal(&info.binding, &binding, sizeof binding);
    }
    assert_ptr_not_equal(kvp_sequence_cache(seq, 0), kvp_sequence_cache(seq, 1));
    assert_null(kvp_sequence_cache(seq, L));
    assert_null(kvp_sequence_cache(NULL, 0));
    assert_int_equal(kvp_sequence_len(NULL), 0);
    assert_int_equal(kvp_sequence_capacity(NULL), 0);
    assert_int_equal(kvp_sequence_held_pages(NULL), 0);
    assert_int_equal(kvp_sequence_promised_pages(NULL), 0);
    assert_int_equal(kvp_sequence_pages_for(NULL, 5), 0);
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_sequence_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_sequence_reset(NULL, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_sequence_promise(NULL, 1, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvpi_sequence_append_uncomputed(NULL, 1, &err), KVP_NULL_ARGUMENT);
    kvpt_destroy_sequence(seq, pool);
    assert_int_equal(kvpt_stats(pool).attached_caches, 0);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}
/*
 * Failures with no kvp_error to fill (err == NULL) return the same status and
 * change nothing; a NaN in lane 0 is found before lane 1 is looked at.
 */
static void test_sequence_failures_without_error_detail(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, C = 8 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, L * B * 2);
    kvp_model *model = make_model(L, 131);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double x[B * 4 * MODEL_WIDTH];
    kvpt_fill_random(x, KVPT_COUNT_OF(x), 132);
    kvp_tensor three = kvp_tensor3(x, B, 3, d);
    kvp_error err;

    /* Token 2 of lane 1 overflows its scores: the prefill fails at token 2 and rolls back. */
    for (size_t j = 0; j < d; j++) {
        x[(1 * 3 + 2) * d + j] = (j % 2) ? -1e156 : 1e156;
    }
    seq_state before;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_prefill(seq, &three, NULL, NULL, NULL, 0, NULL),
                     KVP_NONFINITE_SCORE);
    assert_seq_unchanged(&before, seq, pool, 0);
    kvpt_assert_pool_ok(pool);

    /* A NaN in lane 0 of token 1: found first, reported at lane 0's first column. */
    kvpt_fill_random(x, KVPT_COUNT_OF(x), 132);
    x[(0 * 3 + 1) * d + 5] = NAN;
    x[(1 * 3 + 1) * d + 2] = NAN;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_prefill(seq, &three, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_PROJECTION);
    assert_int_equal(err.token, 1);
    assert_int_equal(err.layer, 0);
    assert_int_equal(err.index, 0);
    assert_string_equal(err.what, "query");
    assert_true(isnan(err.value));
    assert_int_equal(kvp_sequence_prefill(seq, &three, NULL, NULL, NULL, 0, NULL),
                     KVP_NONFINITE_PROJECTION);
    assert_seq_unchanged(&before, seq, pool, 0);

    /* Fill the pool (4 tokens, 2 blocks), then every refusal without detail. */
    kvpt_fill_random(x, KVPT_COUNT_OF(x), 133);
    kvp_tensor four = kvp_tensor3(x, B, 4, d);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &four, NULL, NULL, NULL, 0, &err), &err);
    assert_int_equal(kvpt_stats(pool).free_pages, 0);
    kvp_tensor one = kvp_tensor3(x, B, 1, d);
    double out[B * MODEL_WIDTH];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_step(seq, &one, NULL, NULL, out, B * d, NULL),
                     KVP_POOL_EXHAUSTED);
    assert_seq_unchanged(&before, seq, pool, 1);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_prefill(seq, &one, NULL, NULL, NULL, 0, NULL),
                     KVP_POOL_EXHAUSTED);
    assert_seq_unchanged(&before, seq, pool, 1);
    x[3] = INFINITY;
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvp_sequence_step(seq, &one, NULL, NULL, out, B * d, NULL),
                     KVP_NONFINITE_PROJECTION);
    assert_seq_unchanged(&before, seq, pool, 0);
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);

    /* A model of more layers than can be addressed is refused before any entry is read. */
    const kvp_layer *layers[1] = {NULL};
    kvp_model *too_many = (kvp_model *)0x1;
    assert_int_equal(kvp_model_create(layers, SIZE_MAX, &too_many, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "count");
    assert_ptr_equal(too_many, (kvp_model *)0x1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sequence_failures_without_error_detail),
        cmocka_unit_test(test_sequence_model_create_shares_parameters),
        cmocka_unit_test(test_sequence_model_geometry_mismatch_and_errors),
        cmocka_unit_test(test_sequence_model_create_random_is_deterministic),
        cmocka_unit_test_teardown(test_sequence_model_fault_sweeps, kvpt_disarm),
        cmocka_unit_test(test_sequence_model_destroy_refuses_live_sequences),
        cmocka_unit_test_teardown(test_sequence_create_fault_sweep, kvpt_disarm),
        cmocka_unit_test(test_sequence_create_errors_and_queries),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
