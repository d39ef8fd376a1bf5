/*
 * test_sequence.c: models and multi-layer sequences — models sharing their
 * source layers' parameters, geometry mismatches with exact details and texts,
 * deterministic random models, a model refusing destruction while sequences
 * live (ModelBusy); steps of 1 to 3 layers, 1 or 2 lanes and
 * blocks of 1, 3 and 16 positions matched within 1e-12 against a
 * layer-by-layer full-prefix reference (the residual stream and a custom
 * next-input function), with exact page counts; all-or-nothing steps (pool
 * exhaustion, a prepare error in a later layer, input errors) leaving every
 * layer's rows and page tables and the pool byte-identical; prefill equal to
 * the reference and, bit for bit, to single steps, reserving all its pages up
 * front, and rolled back on a non-finite score with the free list order
 * restored; reset and allocation-free replay onto the same physical pages;
 * promises, admission and page arithmetic; the allocator-only append; and
 * allocation fault sweeps over model and sequence creation. Leaks of a failed
 * step are caught by the memcheck run of this program (ctest). Unit test:
 * uses pager/alloc.h and serve/sequence_internal.h.
 */
#include "support.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "serve/sequence_internal.h"
#include "pager/alloc.h"

/* Every model here has 2 heads of width 4 (D = 8) unless a test says otherwise. */
#define MODEL_WIDTH 8
#define HEADS 2
#define HEAD_WIDTH 4
#define MAX_POSITIONS 32
#define ROPE_BASE 10000.0
#define MAX_LAYERS 3
#define MAX_BATCH 4

/* The documented bound between incremental and full-prefix outputs. */
#define TOLERANCE 1e-12

/* Stops a fault sweep at a generous bound, so a broken injector cannot loop. */
#define SWEEP_LIMIT 128

/* ---- construction helpers ------------------------------------------------ */

static kvp_model *make_model(size_t layers, uint64_t seed)
{
    return kvpt_random_model(layers, MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, seed);
}

/* A model of `layers` layers whose four parameters are all the identity. */
static kvp_model *identity_model(size_t layers)
{
    double eye[MODEL_WIDTH * MODEL_WIDTH];
    memset(eye, 0, sizeof eye);
    for (size_t i = 0; i < MODEL_WIDTH; i++) {
        eye[i * MODEL_WIDTH + i] = 1.0;
    }
    const double *const w[KVP_PARAM_COUNT] = {eye, eye, eye, eye};
    kvp_layer *layer = kvpt_layer_from_matrices(MODEL_WIDTH, w, HEADS, MAX_POSITIONS, ROPE_BASE);
    assert_true(layers <= MAX_LAYERS);
    return kvpt_model_of_one_layer(layer, layers);
}

static kvp_pool *make_pool(size_t block_tokens, size_t pages)
{
    return kvpt_pool(block_tokens, HEADS, HEAD_WIDTH, pages);
}

static void promise(kvp_sequence *seq, kvp_pool *pool, size_t pages)
{
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_promise(seq, pages, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(seq), pages);
}

/* Token t of [B, T, D] inputs as a [B, 1, D] row. */
static void gather_row(const double *inputs, size_t batch, size_t tokens, size_t t, double *row)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(row + b * MODEL_WIDTH, inputs + (b * tokens + t) * MODEL_WIDTH,
               MODEL_WIDTH * sizeof *row);
    }
}

/* Tokens [first, first + count) of [B, T, D] inputs as [B, count, D]. */
static void slice_tokens(const double *inputs, size_t batch, size_t tokens, size_t first,
                         size_t count, double *out)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(out + b * count * MODEL_WIDTH, inputs + (b * tokens + first) * MODEL_WIDTH,
               count * MODEL_WIDTH * sizeof *out);
    }
}

/* Steps token t of [B, T, D] inputs; output receives [B, 1, D]. */
static kvp_status step_token(kvp_sequence *seq, const double *inputs, size_t batch, size_t tokens,
                             size_t t, kvp_next_input_fn next_input, void *ctx, double *output,
                             kvp_error *err)
{
    double row[MAX_BATCH * MODEL_WIDTH];
    assert_true(batch <= MAX_BATCH);
    gather_row(inputs, batch, tokens, t, row);
    kvp_tensor view = kvp_tensor3(row, batch, 1, MODEL_WIDTH);
    return kvp_sequence_step(seq, &view, next_input, ctx, output, batch * MODEL_WIDTH, err);
}

/* Counts the calls of half_residual and flags any with the wrong layer or size. */
typedef struct next_calls {
    size_t layers;
    size_t elements;
    size_t calls;
    size_t wrong;
} next_calls;

/* A custom stream: next = 0.5 * input + output. ctx is a next_calls or NULL. */
static void half_residual(void *ctx, size_t layer, const double *input, const double *output,
                          size_t elements, double *next)
{
    next_calls *calls = ctx;
    if (calls != NULL) {
        if (layer != calls->calls % calls->layers || elements != calls->elements) {
            calls->wrong++;
        }
        calls->calls++;
    }
    for (size_t i = 0; i < elements; i++) {
        next[i] = 0.5 * input[i] + output[i];
    }
}

static void keep_values(void *ctx, double *values, size_t width)
{
    (void)ctx;
    (void)values;
    (void)width;
}

/* ---- the layer-by-layer reference ---------------------------------------- */

/*
 * x_0 = inputs [B, T, D]; x_{l+1} = x_l + ref_l(x_l), or 0.5 x_l + ref_l(x_l)
 * with `half`, where ref_l is layer l's full-prefix causal pass over all T
 * rows. Writes x_L to out and, when keys is not NULL, each layer's rotated
 * keys and values as [L][B, H, T, d_h].
 */
static void sequence_reference(const kvp_model *model, const double *inputs, size_t batch,
                               size_t tokens, int half, double *out, double *keys, double *values)
{
    kvp_model_info info;
    kvp_model_info_init(&info);
    kvp_error err;
    kvpt_assert_ok(kvp_model_info_get(model, &info, &err), &err);
    size_t n = batch * tokens * info.model_width;
    double *x = kvpt_doubles(n);
    double *y = kvpt_doubles(n);
    memcpy(x, inputs, n * sizeof *x);
    for (size_t l = 0; l < info.layers; l++) {
        kvp_tensor view = kvp_tensor3(x, batch, tokens, info.model_width);
        kvpt_assert_ok(kvp_attention_reference(kvp_model_layer(model, l), &view, y, n,
                                               keys != NULL ? keys + l * n : NULL,
                                               values != NULL ? values + l * n : NULL,
                                               keys != NULL ? n : 0, &err),
                       &err);
        for (size_t i = 0; i < n; i++) {
            x[i] = half ? 0.5 * x[i] + y[i] : x[i] + y[i];
        }
    }
    memcpy(out, x, n * sizeof *out);
    free(x);
    free(y);
}

#define assert_close_rows(a, b, n) assert_close_rows_at((a), (b), (n), __FILE__, __LINE__)
static void assert_close_rows_at(const double *a, const double *b, size_t n, const char *file,
                                 int line)
{
    double diff = kvpt_max_abs_diff(a, b, n);
    if (!(diff <= TOLERANCE)) {
        print_error("%s:%d: max abs diff %.3g exceeds %g\n", file, line, diff, TOLERANCE);
        fail();
    }
}

/* ---- sequence state, for "nothing changed" ------------------------------ */

/* Every layer's cache state (len, logical rows, page tables, pool stats) and digest. */
typedef struct seq_state {
    size_t layers;
    size_t len;
    size_t held;
    size_t promised;
    uint64_t digests[MAX_LAYERS];
    kvpt_state caches[MAX_LAYERS];
} seq_state;

static void seq_state_capture(const kvp_sequence *seq, kvp_pool *pool, seq_state *s)
{
    memset(s, 0, sizeof *s);
    s->layers = kvpt_sequence_layers(seq);
    assert_true(s->layers >= 1 && s->layers <= MAX_LAYERS);
    s->len = kvp_sequence_len(seq);
    s->held = kvp_sequence_held_pages(seq);
    s->promised = kvp_sequence_promised_pages(seq);
    kvp_error err;
    for (size_t l = 0; l < s->layers; l++) {
        const kvp_cache *cache = kvp_sequence_cache(seq, l);
        kvpt_state_capture((kvp_cache *)cache, pool, &s->caches[l]);
        kvpt_assert_ok(kvp_cache_digest(cache, &s->digests[l], &err), &err);
    }
}

static void seq_state_free(seq_state *s)
{
    for (size_t l = 0; l < s->layers; l++) {
        kvpt_state_free(&s->caches[l]);
    }
}

/*
 * `seq` and `pool` now equal `before` byte for byte — every layer's len,
 * logical keys and values, page tables and digest, the sequence's promise and
 * the pool stats, acquires, releases and high water included — except that
 * the pool counted `exhausted` more exhaustions. Frees `before`.
 */
#define assert_seq_unchanged(before, seq, pool, exhausted) \
    assert_seq_unchanged_at((before), (seq), (pool), (exhausted), __FILE__, __LINE__)
static void assert_seq_unchanged_at(seq_state *before, const kvp_sequence *seq, kvp_pool *pool,
                                    uint64_t exhausted, const char *file, int line)
{
    seq_state after;
    seq_state_capture(seq, pool, &after);
    if (after.layers != before->layers || after.len != before->len || after.held != before->held ||
        after.promised != before->promised) {
        print_error("%s:%d: sequence changed: layers %zu/%zu len %zu/%zu held %zu/%zu "
                    "promised %zu/%zu\n",
                    file, line, before->layers, after.layers, before->len, after.len, before->held,
                    after.held, before->promised, after.promised);
        fail();
    }
    for (size_t l = 0; l < before->layers; l++) {
        kvp_pool_stats *a = &after.caches[l].stats;
        const kvp_pool_stats *b = &before->caches[l].stats;
        if (a->exhaustions != b->exhaustions + exhausted) {
            print_error("%s:%d: pool counters: exhaustions %llu -> %llu (expected +%llu)\n", file,
                        line, (unsigned long long)b->exhaustions,
                        (unsigned long long)a->exhaustions, (unsigned long long)exhausted);
            fail();
        }
        a->exhaustions = b->exhaustions;
        kvpt_assert_state_equal_at(&before->caches[l], &after.caches[l], file, line);
        if (before->digests[l] != after.digests[l]) {
            print_error("%s:%d: layer %zu digest changed\n", file, line, l);
            fail();
        }
    }
    seq_state_free(before);
    seq_state_free(&after);
}

/* Page ids of every layer, lane and mapped block, in that order; returns the count. */
static size_t sequence_pages(const kvp_sequence *seq, uint32_t *out, size_t room)
{
    size_t n = 0;
    kvp_error err;
    for (size_t l = 0; l < kvpt_sequence_layers(seq); l++) {
        const kvp_cache *cache = kvp_sequence_cache(seq, l);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
        size_t mapped = KVPT_CEIL_DIV(info.len, info.block_tokens);
        for (size_t lane = 0; lane < info.batch_size; lane++) {
            for (size_t block = 0; block < mapped; block++) {
                assert_true(n < room);
                kvpt_assert_ok(kvp_cache_page(cache, lane, block, &out[n], &err), &err);
                n++;
            }
        }
    }
    return n;
}

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

/* ---- reset and replay ------------------------------------------------------------ */

/*
 * Steps, reset, a prefill replay and an allocation-free reset + step replay:
 * identical outputs and the same physical page for every layer, lane and
 * block, even though another sequence took pages in between the first run's
 * steps. Between the two counter reads only the sequence is called.
 */
static void test_sequence_reset_replays_same_pages_without_allocation(void **state)
{
    (void)state;
    enum { L = 3, B = 2, BT = 3, T = 8, OTHER = 4 };
    const size_t d = MODEL_WIDTH;
    const size_t seq_pages = L * B * KVPT_CEIL_DIV(T, BT);
    const size_t other_pages = L * 1 * KVPT_CEIL_DIV(OTHER, BT);
    kvp_pool *pool = make_pool(BT, seq_pages + other_pages + 3);
    kvp_model *model = make_model(L, 91);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, T);
    kvp_sequence *other = kvpt_sequence(model, pool, 1, T);
    double inputs[B * T * MODEL_WIDTH];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 92);
    double rows[T][B * MODEL_WIDTH];
    kvp_tensor views[T];
    for (size_t t = 0; t < T; t++) {
        gather_row(inputs, B, T, t, rows[t]);
        views[t] = kvp_tensor3(rows[t], B, 1, d);
    }
    double other_prompt[OTHER * MODEL_WIDTH];
    kvpt_fill_random(other_prompt, KVPT_COUNT_OF(other_prompt), 93);
    kvp_tensor other_view = kvp_tensor3(other_prompt, 1, OTHER, d);
    kvp_error err;

    double first[T][B * MODEL_WIDTH];
    for (size_t t = 0; t < T; t++) {
        kvpt_assert_ok(kvp_sequence_step(seq, &views[t], NULL, NULL, first[t], B * d, &err),
                       &err);
        kvpt_assert_pool_ok(pool);
        if (t == 1) { /* other's pages land between seq's blocks 0 and 1 */
            kvpt_assert_ok(kvp_sequence_prefill(other, &other_view, NULL, NULL, NULL, 0, &err),
                           &err);
            kvpt_assert_pool_ok(pool);
        }
    }
    uint32_t pages[L * B * KVPT_CEIL_DIV(T, BT)];
    uint32_t again[L * B * KVPT_CEIL_DIV(T, BT)];
    assert_int_equal(sequence_pages(seq, pages, KVPT_COUNT_OF(pages)), seq_pages);
    uint64_t other_digests[L];
    for (size_t l = 0; l < L; l++) {
        kvpt_assert_ok(kvp_cache_digest(kvp_sequence_cache(other, l), &other_digests[l], &err),
                       &err);
    }

    /* Reset: every page and the promise back; other untouched. */
    promise(seq, pool, 4);
    kvp_pool_stats before = kvpt_stats(pool);
    kvpt_assert_ok(kvp_sequence_reset(seq, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(kvp_sequence_len(seq), 0);
    assert_int_equal(kvp_sequence_held_pages(seq), 0);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0);
    for (size_t l = 0; l < L; l++) {
        assert_int_equal(kvp_cache_len(kvp_sequence_cache(seq, l)), 0);
        uint64_t digest = 0;
        kvpt_assert_ok(kvp_cache_digest(kvp_sequence_cache(other, l), &digest, &err), &err);
        assert_int_equal(digest, other_digests[l]);
    }
    assert_int_equal(after.held_pages, other_pages);
    assert_int_equal(after.releases, before.releases + seq_pages);
    assert_int_equal(after.acquires, before.acquires);
    assert_int_equal(after.promised_pages, 0);
    assert_int_equal(after.attached_caches, 2 * L);
    assert_int_equal(after.slab_address, before.slab_address);

    /* A prefill replay: the single steps' outputs and pages. */
    kvp_tensor prompt = kvp_tensor3(inputs, B, T, d);
    double prefilled[B * T * MODEL_WIDTH];
    kvpt_assert_ok(kvp_sequence_prefill(seq, &prompt, NULL, NULL, prefilled,
                                        KVPT_COUNT_OF(prefilled), &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    for (size_t t = 0; t < T; t++) {
        for (size_t b = 0; b < B; b++) {
            assert_memory_equal(prefilled + (b * T + t) * d, first[t] + b * d, d * sizeof(double));
        }
    }
    assert_int_equal(sequence_pages(seq, again, KVPT_COUNT_OF(again)), seq_pages);
    assert_memory_equal(again, pages, sizeof pages);

    /* Reset and step replay, with no heap traffic and no allocation call at all. */
    double replay[T][B * MODEL_WIDTH];
    kvp_status statuses[T + 1];
    kvpt_heap_window heap;
    kvpi_fault_arm(1); /* would fail the very first allocation call */
    kvpt_heap_window_open(&heap);
    statuses[0] = kvp_sequence_reset(seq, &err);
    for (size_t t = 0; t < T; t++) {
        statuses[t + 1] = kvp_sequence_step(seq, &views[t], NULL, NULL, replay[t], B * d, &err);
    }
    kvpt_heap_window_close(&heap);
    uint64_t calls = kvpi_fault_calls();
    int fired = kvpi_fault_fired();
    kvpi_fault_arm(0);

    for (size_t i = 0; i <= T; i++) {
        assert_int_equal(statuses[i], KVP_OK);
    }
    assert_int_equal(calls, 0);
    assert_false(fired);
    kvpt_assert_no_heap_traffic(&heap);
    kvpt_assert_pool_ok(pool);
    assert_memory_equal(replay, first, sizeof first);
    assert_int_equal(sequence_pages(seq, again, KVPT_COUNT_OF(again)), seq_pages);
    assert_memory_equal(again, pages, sizeof pages);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_sequence(other, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- promises, admission and page arithmetic ---------------------------------------- */

static void test_sequence_promise_consumed_by_steps_and_returned(void **state)
{
    (void)state;
    enum { L = 2, BT = 2, C = 8 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 20);
    kvp_model *model = make_model(L, 101);
    kvp_sequence *one = kvpt_sequence(model, pool, 1, C);
    kvp_sequence *two = kvpt_sequence(model, pool, 1, C);
    double inputs[C * MODEL_WIDTH];
    kvpt_fill_random(inputs, KVPT_COUNT_OF(inputs), 102);
    double out[C * MODEL_WIDTH];
    kvp_error err;
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);

    promise(one, pool, 5);
    assert_int_equal(kvpt_stats(pool).promised_pages, 5);
    promise(two, pool, 3);
    assert_int_equal(kvpt_stats(pool).promised_pages, 8);
    promise(one, pool, 6); /* replaces, not adds */
    assert_int_equal(kvpt_stats(pool).promised_pages, 9);

    /* A step opening a block takes L pages from the promise; a step inside a block none. */
    kvpt_assert_ok(step_token(one, inputs, 1, C, 0, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(one), 4);
    assert_int_equal(kvpt_stats(pool).promised_pages, 7);
    kvpt_assert_ok(step_token(one, inputs, 1, C, 1, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(one), 4);
    /* A prefill of 3 from len 2 takes 4 pages: the promise is spent exactly. */
    double prompt[3 * MODEL_WIDTH];
    slice_tokens(inputs, 1, C, 2, 3, prompt);
    kvp_tensor three = kvp_tensor3(prompt, 1, 3, d);
    assert_int_equal(kvp_sequence_pages_for(one, 5), 4);
    kvpt_assert_ok(kvp_sequence_prefill(one, &three, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(one), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 3);
    /* len 5 -> 6 inside a block, 6 -> 7 opens one: pages beyond the promise leave it at 0. */
    kvpt_assert_ok(step_token(one, inputs, 1, C, 5, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(step_token(one, inputs, 1, C, 6, NULL, NULL, out, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(one), 0);
    assert_int_equal(kvp_sequence_held_pages(one), L * 4);
    assert_int_equal(kvpt_stats(pool).promised_pages, 3);

    /* two: a prefill taking more than promised spends only the promise. */
    kvp_tensor four = kvp_tensor3(inputs, 1, 4, d);
    kvpt_assert_ok(kvp_sequence_prefill(two, &four, NULL, NULL, out, KVPT_COUNT_OF(out), &err),
                   &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_held_pages(two), 4);
    assert_int_equal(kvp_sequence_promised_pages(two), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);

    /* Reset and destroy hand back what is left. */
    promise(two, pool, 2);
    promise(one, pool, 7);
    assert_int_equal(kvpt_stats(pool).promised_pages, 9);
    kvpt_assert_ok(kvp_sequence_reset(two, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(two), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 7);
    promise(two, pool, 1);
    kvpt_destroy_sequence(one, pool);
    assert_int_equal(kvpt_stats(pool).promised_pages, 1);
    promise(two, pool, 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    promise(two, pool, 3);
    kvpt_destroy_sequence(two, pool);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static kvp_admission admit(kvp_pool *pool, size_t pages, size_t watermark)
{
    kvp_pool_stats before = kvpt_stats(pool);
    kvp_admission admission = (kvp_admission)-1;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_admit(pool, pages, watermark, &admission, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before); /* a question, not a reservation */
    return admission;
}

static void test_sequence_pool_admit_boundaries(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 2, TOTAL = 10 };
    kvp_pool *pool = make_pool(BT, TOTAL);
    kvp_model *model = make_model(L, 111);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, 8);
    kvp_error err;

    /* Empty pool: free 10, promised 0. */
    assert_int_equal(admit(pool, TOTAL, 0), KVP_ADMIT_NOW); /* exactly equal */
    assert_int_equal(admit(pool, TOTAL - 1, 1), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 0, TOTAL), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 0, 0), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, TOTAL, 1), KVP_ADMIT_NEVER);
    assert_int_equal(admit(pool, TOTAL + 1, 0), KVP_ADMIT_NEVER);
    assert_int_equal(admit(pool, 0, TOTAL + 1), KVP_ADMIT_NEVER);
    assert_int_equal(admit(pool, SIZE_MAX, SIZE_MAX), KVP_ADMIT_NEVER); /* no wrap-around */
    assert_int_equal(admit(pool, 1, SIZE_MAX), KVP_ADMIT_NEVER);

    /* 4 pages held: free 6. */
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 6);
    assert_int_equal(admit(pool, 6, 0), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 5, 1), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 7, 0), KVP_ADMIT_LATER);
    assert_int_equal(admit(pool, 5, 2), KVP_ADMIT_LATER);
    assert_int_equal(admit(pool, TOTAL, 0), KVP_ADMIT_LATER); /* fits once pages come back */
    assert_int_equal(admit(pool, TOTAL, 1), KVP_ADMIT_NEVER);

    /* Promised pages count as used: a NOW becomes LATER. */
    promise(seq, pool, 2);
    assert_int_equal(admit(pool, 6, 0), KVP_ADMIT_LATER);
    assert_int_equal(admit(pool, 4, 0), KVP_ADMIT_NOW); /* 6 - 2 == 4 */
    assert_int_equal(admit(pool, 3, 1), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 4, 1), KVP_ADMIT_LATER);
    assert_int_equal(admit(pool, TOTAL, 0), KVP_ADMIT_LATER);
    /* Promised beyond what is free: nothing is admitted now. */
    promise(seq, pool, 8);
    assert_int_equal(admit(pool, 0, 0), KVP_ADMIT_LATER);
    assert_int_equal(admit(pool, 1, 0), KVP_ADMIT_LATER);
    /* The step that takes promised pages leaves free - promised as it was. */
    promise(seq, pool, 5);
    assert_int_equal(admit(pool, 1, 0), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 2, 0), KVP_ADMIT_LATER);
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 2, &err), &err); /* len 3: 4 pages */
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 2);
    assert_int_equal(kvpt_stats(pool).promised_pages, 1);
    assert_int_equal(admit(pool, 1, 0), KVP_ADMIT_NOW);
    assert_int_equal(admit(pool, 2, 0), KVP_ADMIT_LATER);

    /* A promise beyond every page the sequence can ever hold is refused, changing nothing. */
    kvp_sequence *greedy = kvpt_sequence(model, pool, 1, 8);
    size_t most = kvp_sequence_pages_for(greedy, 8);
    kvp_pool_stats before = kvpt_stats(pool);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_promise(greedy, most + 1, &err), KVP_OUT_OF_RANGE);
    kvpt_assert_pool_ok(pool);
    assert_string_equal(err.argument, "pages");
    assert_int_equal(err.index, most + 1);
    assert_int_equal(err.limit, most + 1);
    assert_int_equal(kvp_sequence_promise(greedy, SIZE_MAX, &err), KVP_OUT_OF_RANGE);
    assert_int_equal(kvp_sequence_promised_pages(greedy), 0);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(admit(pool, 1, 0), KVP_ADMIT_NOW);
    /* The largest promise is taken, and then nothing more is admitted now. */
    promise(greedy, pool, most);
    assert_int_equal(kvpt_stats(pool).promised_pages, after.promised_pages + most);
    assert_int_equal(admit(pool, 1, 0), KVP_ADMIT_LATER);
    promise(seq, pool, 0); /* lowering is always possible */
    kvpt_destroy_sequence(greedy, pool);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);

    /* Errors; out untouched. */
    kvp_admission untouched = (kvp_admission)77;
    assert_int_equal(kvp_pool_admit(NULL, 1, 0, &untouched, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    assert_int_equal(kvp_pool_admit(pool, 1, 0, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(untouched, 77);

    kvpt_destroy_sequence(seq, pool);
    assert_int_equal(admit(pool, TOTAL, 0), KVP_ADMIT_NOW);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

static void test_sequence_pages_for(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 3 };
    kvp_pool *pool = make_pool(BT, 16);
    assert_int_equal(kvp_pool_pages_for(pool, 2, 0), 0);
    assert_int_equal(kvp_pool_pages_for(pool, 2, 1), 2);
    assert_int_equal(kvp_pool_pages_for(pool, 2, 3), 2);
    assert_int_equal(kvp_pool_pages_for(pool, 2, 4), 4);
    assert_int_equal(kvp_pool_pages_for(pool, 2, 7), 6);
    assert_int_equal(kvp_pool_pages_for(pool, 5, 9), 15);
    assert_int_equal(kvp_pool_pages_for(pool, 0, 9), 0);
    assert_int_equal(kvp_pool_pages_for(pool, 1, SIZE_MAX), SIZE_MAX / BT + (SIZE_MAX % BT != 0));
    assert_int_equal(kvp_pool_pages_for(NULL, 2, 4), 0);

    /*
     * Overflow saturates at SIZE_MAX, which admission answers NEVER: 2^63
     * lanes of 4 tokens (2 blocks each) would wrap to 0, which would be NOW.
     */
    size_t lanes = (size_t)1 << 63;
    assert_int_equal(kvp_pool_pages_for(pool, lanes, 4), SIZE_MAX);
    assert_int_equal(kvp_pool_pages_for(pool, lanes, 3), lanes); /* one block: fits */
    assert_int_equal(kvp_pool_pages_for(pool, 2, SIZE_MAX), 2 * (SIZE_MAX / BT)); /* fits */
    assert_int_equal(kvp_pool_pages_for(pool, 4, SIZE_MAX), SIZE_MAX);
    assert_int_equal(kvp_pool_pages_for(pool, SIZE_MAX, 1), SIZE_MAX);
    /* The largest product that fits (exactly SIZE_MAX), and one lane more. */
    assert_int_equal((SIZE_MAX / 5) * 5, SIZE_MAX);
    assert_int_equal(kvp_pool_pages_for(pool, SIZE_MAX / 5, 5 * BT), SIZE_MAX);
    assert_int_equal(kvp_pool_pages_for(pool, SIZE_MAX / 5 + 1, 5 * BT), SIZE_MAX);
    assert_int_equal(kvp_pool_pages_for(pool, SIZE_MAX / 5, 4 * BT), SIZE_MAX / 5 * 4);
    kvp_admission admission = KVP_ADMIT_NOW;
    kvp_error admit_err;
    kvpt_assert_ok(kvp_pool_admit(pool, kvp_pool_pages_for(pool, lanes, 4), 0, &admission,
                                  &admit_err),
                   &admit_err);
    assert_int_equal(admission, KVP_ADMIT_NEVER);
    kvpt_assert_ok(kvp_pool_admit(pool, 1, SIZE_MAX, &admission, &admit_err), &admit_err);
    assert_int_equal(admission, KVP_ADMIT_NEVER);
    kvpt_assert_ok(kvp_pool_admit(pool, SIZE_MAX, SIZE_MAX, &admission, &admit_err), &admit_err);
    assert_int_equal(admission, KVP_ADMIT_NEVER);

    kvp_model *model = make_model(L, 121);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, 9);
    kvp_error err;
    assert_int_equal(kvp_sequence_pages_for(seq, 0), 0);
    assert_int_equal(kvp_sequence_pages_for(seq, 1), L * B);
    assert_int_equal(kvp_sequence_pages_for(seq, 3), L * B);
    assert_int_equal(kvp_sequence_pages_for(seq, 4), 2 * L * B);
    assert_int_equal(kvp_sequence_pages_for(seq, 9), 3 * L * B);
    /* Far past capacity the count saturates too: L * B * (SIZE_MAX / 3 + 1) overflows. */
    assert_int_equal(kvp_sequence_pages_for(seq, SIZE_MAX), SIZE_MAX);
    assert_int_equal(kvp_sequence_pages_for(seq, SIZE_MAX / 8),
                     L * B * KVPT_CEIL_DIV(SIZE_MAX / 8, BT));
    assert_int_equal(kvp_sequence_pages_for(NULL, 4), 0);
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 2, &err), &err);
    kvpt_assert_pool_ok(pool);
    /* From len 2: the rest of block 0 is free, each further block costs L * B. */
    assert_int_equal(kvp_sequence_pages_for(seq, 1), 0);
    assert_int_equal(kvp_sequence_pages_for(seq, 2), 0);
    assert_int_equal(kvp_sequence_pages_for(seq, 3), 0);
    assert_int_equal(kvp_sequence_pages_for(seq, 4), L * B);
    assert_int_equal(kvp_sequence_pages_for(seq, 7), 2 * L * B);
    /* It is exactly what a prefill to that length takes. */
    uint64_t acquires = kvpt_stats(pool).acquires;
    size_t expected = kvp_sequence_pages_for(seq, 7);
    double prompt[B * 5 * MODEL_WIDTH];
    kvpt_fill_random(prompt, KVPT_COUNT_OF(prompt), 122);
    kvp_tensor view = kvp_tensor3(prompt, B, 5, MODEL_WIDTH);
    kvpt_assert_ok(kvp_sequence_prefill(seq, &view, NULL, NULL, NULL, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvpt_stats(pool).acquires - acquires, expected);
    assert_int_equal(kvp_sequence_held_pages(seq), kvp_pool_pages_for(pool, L * B, 7));
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_model(model);
}

/* ---- the allocator-only append ------------------------------------------------------ */

static void test_sequence_append_uncomputed_all_or_nothing(void **state)
{
    (void)state;
    enum { L = 2, B = 2, BT = 3, C = 7 };
    const size_t d = MODEL_WIDTH;
    kvp_pool *pool = make_pool(BT, 11);
    kvp_model *model = make_model(L, 131);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    kvp_error err;
    promise(seq, pool, 5);

    /* 4 zero rows in every layer: 2 blocks, 8 pages, 5 of them promised. */
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 4, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 4);
    assert_int_equal(kvp_sequence_held_pages(seq), 8);
    assert_int_equal(kvp_sequence_promised_pages(seq), 0);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.held_pages, 8);
    assert_int_equal(stats.promised_pages, 0);
    assert_int_equal(stats.attached_reservations, 0);
    double snap[B * HEADS * C * HEAD_WIDTH];
    double zeros[B * HEADS * C * HEAD_WIDTH];
    memset(zeros, 0, sizeof zeros);
    for (size_t l = 0; l < L; l++) {
        const kvp_cache *cache = kvp_sequence_cache(seq, l);
        assert_int_equal(kvp_cache_len(cache), 4);
        size_t n = B * HEADS * 4 * HEAD_WIDTH;
        kvpt_assert_ok(kvp_cache_keys(cache, snap, n, &err), &err);
        assert_memory_equal(snap, zeros, n * sizeof(double));
        kvpt_assert_ok(kvp_cache_values(cache, snap, n, &err), &err);
        assert_memory_equal(snap, zeros, n * sizeof(double));
    }

    /* A computed step inside block 1 attends over the zero rows. */
    double row[B * MODEL_WIDTH];
    kvpt_fill_random(row, KVPT_COUNT_OF(row), 132);
    kvp_tensor view = kvp_tensor3(row, B, 1, d);
    double out[B * MODEL_WIDTH];
    kvpt_assert_ok(kvp_sequence_step(seq, &view, NULL, NULL, out, KVPT_COUNT_OF(out), &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 5);
    for (size_t i = 0; i < KVPT_COUNT_OF(out); i++) {
        assert_true(isfinite(out[i]));
    }

    /* FULL: 3 more than the 2 left. */
    seq_state before;
    seq_state_capture(seq, pool, &before);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvpi_sequence_append_uncomputed(seq, 3, &err), KVP_FULL);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.capacity, C);
    assert_int_equal(err.layer, SIZE_MAX);
    assert_seq_unchanged(&before, seq, pool, 0);
    /* POOL_EXHAUSTED: 2 rows reach block 2 (4 pages), 3 are free. */
    promise(seq, pool, 1);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvpi_sequence_append_uncomputed(seq, 2, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(err.needed, 4);
    assert_int_equal(err.available, 3);
    assert_int_equal(err.layer, SIZE_MAX);
    assert_seq_unchanged(&before, seq, pool, 1);
    /* One row stays inside block 1; zero rows change nothing. */
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 1, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_len(seq), 6);
    assert_int_equal(kvp_sequence_promised_pages(seq), 1);
    seq_state_capture(seq, pool, &before);
    kvpt_assert_ok(kvpi_sequence_append_uncomputed(seq, 0, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_seq_unchanged(&before, seq, pool, 0);
    seq_state_capture(seq, pool, &before);
    assert_int_equal(kvpi_sequence_append_uncomputed(seq, 1, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    assert_seq_unchanged(&before, seq, pool, 1);
    kvpt_destroy_sequence(seq, pool);
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
        cmocka_unit_test(test_sequence_step_matches_layer_by_layer_reference),
        cmocka_unit_test(test_sequence_step_custom_next_input_matches_reference),
        cmocka_unit_test(test_sequence_step_pool_exhausted_changes_nothing),
        cmocka_unit_test(test_sequence_step_prepare_error_in_later_layer_changes_nothing),
        cmocka_unit_test(test_sequence_step_input_errors_name_layer_zero),
        cmocka_unit_test(test_sequence_prefill_matches_reference_and_single_steps),
        cmocka_unit_test(test_sequence_prefill_pool_exhausted_reserves_up_front),
        cmocka_unit_test(test_sequence_prefill_full_and_shape_errors_change_nothing),
        cmocka_unit_test(test_sequence_prefill_nonfinite_score_rolls_back_everything),
        cmocka_unit_test_teardown(test_sequence_reset_replays_same_pages_without_allocation,
                                  kvpt_disarm),
        cmocka_unit_test(test_sequence_promise_consumed_by_steps_and_returned),
        cmocka_unit_test(test_sequence_pool_admit_boundaries),
        cmocka_unit_test(test_sequence_pages_for),
        cmocka_unit_test(test_sequence_append_uncomputed_all_or_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
