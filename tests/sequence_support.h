/*
 * sequence_support.h: what the test_sequence*.c programs share — models of
 * 2 heads of width 4 (D = 8) unless a test says otherwise, pools, promises,
 * one-token steps sliced from a [batch, tokens, D] input, the residual and
 * half-residual next-input functions, the layer-by-layer full-prefix
 * reference with its documented bound (TOLERANCE, 1e-12), and the sequence
 * state behind "nothing changed" (every layer's rows and page tables, the
 * pool byte-identical, exhaustions counted). Everything is static inline.
 * Included only by tests/test_sequence*.c (unit tests with pager/alloc.h and
 * serve/sequence_internal.h).
 */
#ifndef KVPT_SEQUENCE_SUPPORT_H
#define KVPT_SEQUENCE_SUPPORT_H

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

static inline kvp_model *make_model(size_t layers, uint64_t seed)
{
    return kvpt_random_model(layers, MODEL_WIDTH, HEADS, MAX_POSITIONS, ROPE_BASE, seed);
}

/* A model of `layers` layers whose four parameters are all the identity. */
static inline kvp_model *identity_model(size_t layers)
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

static inline kvp_pool *make_pool(size_t block_tokens, size_t pages)
{
    return kvpt_pool(block_tokens, HEADS, HEAD_WIDTH, pages);
}

static inline void promise(kvp_sequence *seq, kvp_pool *pool, size_t pages)
{
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_promise(seq, pages, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_sequence_promised_pages(seq), pages);
}

/* Token t of [B, T, D] inputs as a [B, 1, D] row. */
static inline void gather_row(const double *inputs, size_t batch, size_t tokens, size_t t,
                              double *row)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(row + b * MODEL_WIDTH, inputs + (b * tokens + t) * MODEL_WIDTH,
               MODEL_WIDTH * sizeof *row);
    }
}

/* Tokens [first, first + count) of [B, T, D] inputs as [B, count, D]. */
static inline void slice_tokens(const double *inputs, size_t batch, size_t tokens, size_t first,
                                size_t count, double *out)
{
    for (size_t b = 0; b < batch; b++) {
        memcpy(out + b * count * MODEL_WIDTH, inputs + (b * tokens + first) * MODEL_WIDTH,
               count * MODEL_WIDTH * sizeof *out);
    }
}

/* Steps token t of [B, T, D] inputs; output receives [B, 1, D]. */
static inline kvp_status step_token(kvp_sequence *seq, const double *inputs, size_t batch,
                                    size_t tokens, size_t t, kvp_next_input_fn next_input,
                                    void *ctx, double *output, kvp_error *err)
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
static inline void half_residual(void *ctx, size_t layer, const double *input, const double *output,
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

static inline void keep_values(void *ctx, double *values, size_t width)
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
static inline void sequence_reference(const kvp_model *model, const double *inputs, size_t batch,
                                      size_t tokens, int half, double *out, double *keys,
                                      double *values)
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
static inline void assert_close_rows_at(const double *a, const double *b, size_t n,
                                        const char *file, int line)
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

static inline void seq_state_capture(const kvp_sequence *seq, kvp_pool *pool, seq_state *s)
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

static inline void seq_state_free(seq_state *s)
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
static inline void assert_seq_unchanged_at(seq_state *before, const kvp_sequence *seq,
                                           kvp_pool *pool, uint64_t exhausted, const char *file,
                                           int line)
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
static inline size_t sequence_pages(const kvp_sequence *seq, uint32_t *out, size_t room)
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

#endif /* KVPT_SEQUENCE_SUPPORT_H */
