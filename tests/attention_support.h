/*
 * attention_support.h: what the test_attention*.c programs share — the
 * seed's fixture (DESIGN.md: D = 4, H = 2, d_h = 2, capacity 4; its layer,
 * inputs and printed outputs), a cache and ticket on a pool of its own,
 * forward and result helpers, and the "nothing changed" checks of a refused
 * prepare, forward or commit (cache rows, page tables and pool byte-identical;
 * only the exhaustion counter may move, by the count given). Everything is
 * static inline: each including program uses what it needs. Included only by
 * tests/test_attention*.c (unit tests with internal headers pager/alloc.h and
 * pager/cache_internal.h).
 */
#ifndef KVPT_ATTENTION_SUPPORT_H
#define KVPT_ATTENTION_SUPPORT_H

#include "support.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/alloc.h"
#include "pager/cache_internal.h"

/* The seed's fixture (DESIGN.md): D = 4, H = 2, d_h = 2, capacity 4. */
#define D 4
#define H 2
#define HD 2
#define CAPACITY 4
#define MAX_POSITIONS 8
#define ROPE_BASE 10000.0
#define BT 2
#define STEPS 3

/* The seed's printed figures. */
static const double seed_outputs[STEPS][D] = {
    {1.0, 0.0, 1.0, 0.0},
    {0.213809009, 0.786190991, 0.770151153, -0.420735492},
    {0.629044078, 0.945303958, 0.374718490, -0.583589471},
};

static inline void fixture_inputs(double x[STEPS][D])
{
    const double inputs[STEPS][D] = {
        {1.0, 0.0, 1.0, 0.0},
        {cos(1.0), -sin(1.0), 0.0, 1.0},
        {cos(2.0), -sin(2.0), 1.0, 1.0},
    };
    memcpy(x, inputs, sizeof inputs);
}

/* output[0..D) is the seed's printed output of step t, to 1e-9. */
#define assert_seed_output(output, t) assert_seed_output_at((output), (t), __FILE__, __LINE__)
static inline void assert_seed_output_at(const double *output, size_t t, const char *file, int line)
{
    for (size_t f = 0; f < D; f++) {
        kvpt_assert_close_at(output[f], seed_outputs[t][f], 1e-9, file, line);
    }
}

/* ---- construction helpers ------------------------------------------------- */

/* The fixture's weights: identity, or W_o with W[i][(i + 2) % 4] = 1 (y = x W). */
static inline void fixture_matrix(double w[D * D], int swap)
{
    memset(w, 0, D * D * sizeof(double));
    for (size_t i = 0; i < D; i++) {
        w[i * D + (swap ? (i + D / 2) % D : i)] = 1.0;
    }
}

/* The seed's fixture layer, with fresh parameter nodes every call. */
static inline kvp_layer *fixture_layer(void)
{
    double identity[D * D];
    double swap[D * D];
    fixture_matrix(identity, 0);
    fixture_matrix(swap, 1);
    const double *const w[KVP_PARAM_COUNT] = {identity, identity, identity, swap};
    return kvpt_layer_from_matrices(D, w, H, MAX_POSITIONS, ROPE_BASE);
}

/* The seed's from_parameters: a layer over `layer`'s own nodes. */
static inline kvp_layer *layer_sharing(kvp_layer *layer, size_t max_positions, double base)
{
    kvp_layer *out = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param_mut(layer, 0), kvp_layer_param_mut(layer, 1),
                                    kvp_layer_param_mut(layer, 2), kvp_layer_param_mut(layer, 3), H,
                                    max_positions, base, &out, &err),
                   &err);
    return out;
}

static inline kvp_cache *cache_for(kvp_pool *pool, const kvp_layer *layer, size_t batch,
                                   size_t capacity)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    return kvpt_cache(pool, &binding, batch, capacity);
}

/*
 * The seed's fixture on a pool of its own: the fixture layer, one cache of
 * `batch` lanes and `capacity` rows with its ticket, and the three inputs.
 */
typedef struct fixture {
    kvp_pool *pool;
    kvp_layer *layer;
    kvp_cache *cache;
    kvp_ticket *ticket;
    double x[STEPS][D];
} fixture;

static inline void fixture_open(fixture *f, size_t pages, size_t batch, size_t capacity)
{
    f->pool = kvpt_pool(BT, H, HD, pages);
    f->layer = fixture_layer();
    f->cache = cache_for(f->pool, f->layer, batch, capacity);
    f->ticket = kvpt_ticket(f->cache);
    fixture_inputs(f->x);
}

/* Destroys the ticket, the cache, the layer and the pool, which must then be idle. */
static inline void fixture_close(fixture *f)
{
    kvpt_destroy_ticket(f->ticket, f->pool);
    kvpt_destroy_cache(f->cache, f->pool);
    kvpt_destroy_layer(f->layer);
    kvpt_destroy_pool(f->pool);
}

static inline void forward_ok(const kvp_layer *layer, const kvp_tensor *input, kvp_cache *cache,
                              kvp_pool *pool, kvp_ticket *ticket)
{
    kvp_error err;
    kvpt_assert_ok(kvp_attention_forward(layer, input, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static inline kvp_attention_result result_of(const kvp_ticket *ticket)
{
    kvp_attention_result result;
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
    return result;
}

static inline size_t free_pages(kvp_pool *pool)
{
    return kvpt_stats(pool).free_pages;
}

/* The page ids of blocks [0, blocks) of lanes [0, lanes), lane-major. */
static inline void read_pages(const kvp_cache *cache, size_t lanes, size_t blocks, uint32_t *out)
{
    kvp_error err;
    for (size_t lane = 0; lane < lanes; lane++) {
        for (size_t block = 0; block < blocks; block++) {
            kvpt_assert_ok(kvp_cache_page(cache, lane, block, &out[lane * blocks + block], &err),
                           &err);
        }
    }
}

/*
 * kvp_attention_prepare, then kvp_attention_forward, must each fail with
 * `status` and `text` and leave the cache and the pool byte-identical, except
 * that each call adds `exhaustions` to the pool's exhaustion counter.
 * Afterwards the ticket holds no prepared row (commit refuses, changing
 * nothing), unless it held one before, which it then still holds. *err is
 * the forward's.
 */
static inline void expect_failure_counting(const kvp_layer *layer, const kvp_tensor *input,
                                           kvp_cache *cache, kvp_pool *pool, kvp_ticket *ticket,
                                           kvp_status status, const char *text,
                                           uint64_t exhaustions, kvp_error *err)
{
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    kvp_attention_result held;
    int was_prepared = kvp_ticket_result(ticket, &held, NULL) == KVP_OK && !held.committed;
    for (int forward = 0; forward < 2; forward++) {
        memset(err, 0x5A, sizeof *err);
        kvp_status got = forward ? kvp_attention_forward(layer, input, cache, ticket, err)
                                 : kvp_attention_prepare(layer, input, cache, ticket, err);
        assert_int_equal(got, status);
        assert_int_equal(err->status, status);
        kvpt_assert_error_text(err, text);
        kvpt_assert_state_unchanged(&before, cache, pool, (forward + 1) * exhaustions);
    }
    if (was_prepared) {
        /* A refused prepare leaves a held row as it was. */
        kvp_attention_result now = result_of(ticket);
        assert_int_equal(now.committed, 0);
        assert_int_equal(now.reserved_pages, held.reserved_pages);
        assert_int_equal(now.keys, held.keys);
        assert_ptr_equal(now.output, held.output);
    } else {
        kvp_error commit_err;
        assert_int_equal(kvp_ticket_commit(ticket, cache, &commit_err), KVP_TICKET_EMPTY);
        kvpt_assert_state_unchanged(&before, cache, pool, 2 * exhaustions);
    }
    kvpt_state_free(&before);
}

static inline void expect_failure(const kvp_layer *layer, const kvp_tensor *input, kvp_cache *cache,
                                  kvp_pool *pool, kvp_ticket *ticket, kvp_status status,
                                  const char *text, kvp_error *err)
{
    expect_failure_counting(layer, input, cache, pool, ticket, status, text, 0, err);
}

/* A commit that must be refused with `status` and `text`, changing nothing. */
static inline void expect_commit_failure(kvp_ticket *ticket, kvp_cache *cache, kvp_pool *pool,
                                         kvp_status status, const char *text, kvp_error *err)
{
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_ticket_commit(ticket, cache, err), status);
    assert_int_equal(err->status, status);
    kvpt_assert_error_text(err, text);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    kvpt_state_free(&before);
}

#endif /* KVPT_ATTENTION_SUPPORT_H */
