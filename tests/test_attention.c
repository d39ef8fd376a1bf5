/*
 * test_attention.c: incremental attention through the paged cache — the
 * seed's fixture (outputs, attention weights, logical rotated keys and
 * unrotated values, work counts, zero difference from the full-prefix
 * reference); prepare changing nothing until commit, and the pages a prepare
 * reserves; randomized geometries (batch, heads, head width, block size,
 * capacity) checked step by step against the full-prefix reference; every
 * validation failure in the seed's order with exact details and texts, each
 * leaving the cache's rows, page tables and pool byte-identical; in-place
 * updates that make a cache stale for good; pool exhaustion, non-finite
 * projections, scores and outputs; the ticket's life (stale, foreign, empty,
 * busy, wrong geometry, pages held until discard); reset and replay onto the
 * same pages with no heap traffic; the reference's own errors; and
 * grouped-query heads (kv_heads 1, heads / 4, heads): exact against the
 * reference and across block sizes, bit-identical to a multi-head layer
 * with repeated K/V columns, and their validation. Unit test:
 * uses internal headers (pager/alloc.h, pager/cache_internal.h).
 */
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
/* [position][head][key]: newest-query weights over keys 0..position. */
static const double seed_weights[STEPS][H][STEPS] = {
    {{1.0}, {1.0}},
    {{0.5, 0.5}, {0.213809008676, 0.786190991324}},
    {{1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0}, {0.054696042457, 0.370955922197, 0.574348035346}},
};
/* [head][position][feature] after the three steps. */
static const double seed_keys[H][STEPS][HD] = {
    {{1.0, 0.0}, {1.0, 0.0}, {1.0, 0.0}},
    {{1.0, 0.0}, {-0.841470985, 0.540302306}, {-1.325444263, 0.493150590}},
};
static const double seed_values[H][STEPS][HD] = {
    {{1.0, 0.0}, {0.540302306, -0.841470985}, {-0.416146837, -0.909297427}},
    {{1.0, 0.0}, {0.0, 1.0}, {1.0, 1.0}},
};

static void fixture_inputs(double x[STEPS][D])
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
static void assert_seed_output_at(const double *output, size_t t, const char *file, int line)
{
    for (size_t f = 0; f < D; f++) {
        kvpt_assert_close_at(output[f], seed_outputs[t][f], 1e-9, file, line);
    }
}

/* ---- construction helpers ------------------------------------------------- */

/* The fixture's weights: identity, or W_o with W[i][(i + 2) % 4] = 1 (y = x W). */
static void fixture_matrix(double w[D * D], int swap)
{
    memset(w, 0, D * D * sizeof(double));
    for (size_t i = 0; i < D; i++) {
        w[i * D + (swap ? (i + D / 2) % D : i)] = 1.0;
    }
}

/* The seed's fixture layer, with fresh parameter nodes every call. */
static kvp_layer *fixture_layer(void)
{
    double identity[D * D];
    double swap[D * D];
    fixture_matrix(identity, 0);
    fixture_matrix(swap, 1);
    const double *const w[KVP_PARAM_COUNT] = {identity, identity, identity, swap};
    return kvpt_layer_from_matrices(D, w, H, MAX_POSITIONS, ROPE_BASE);
}

/* The seed's from_parameters: a layer over `layer`'s own nodes. */
static kvp_layer *layer_sharing(kvp_layer *layer, size_t max_positions, double base)
{
    kvp_layer *out = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param_mut(layer, 0), kvp_layer_param_mut(layer, 1),
                                    kvp_layer_param_mut(layer, 2), kvp_layer_param_mut(layer, 3), H,
                                    max_positions, base, &out, &err),
                   &err);
    return out;
}

static kvp_cache *cache_for(kvp_pool *pool, const kvp_layer *layer, size_t batch,
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

static void fixture_open(fixture *f, size_t pages, size_t batch, size_t capacity)
{
    f->pool = kvpt_pool(BT, H, HD, pages);
    f->layer = fixture_layer();
    f->cache = cache_for(f->pool, f->layer, batch, capacity);
    f->ticket = kvpt_ticket(f->cache);
    fixture_inputs(f->x);
}

/* Destroys the ticket, the cache, the layer and the pool, which must then be idle. */
static void fixture_close(fixture *f)
{
    kvpt_destroy_ticket(f->ticket, f->pool);
    kvpt_destroy_cache(f->cache, f->pool);
    kvpt_destroy_layer(f->layer);
    kvpt_destroy_pool(f->pool);
}

static void forward_ok(const kvp_layer *layer, const kvp_tensor *input, kvp_cache *cache,
                       kvp_pool *pool, kvp_ticket *ticket)
{
    kvp_error err;
    kvpt_assert_ok(kvp_attention_forward(layer, input, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static kvp_attention_result result_of(const kvp_ticket *ticket)
{
    kvp_attention_result result;
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
    return result;
}

static size_t free_pages(kvp_pool *pool)
{
    return kvpt_stats(pool).free_pages;
}

/* The page ids of blocks [0, blocks) of lanes [0, lanes), lane-major. */
static void read_pages(const kvp_cache *cache, size_t lanes, size_t blocks, uint32_t *out)
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
static void expect_failure_counting(const kvp_layer *layer, const kvp_tensor *input,
                                    kvp_cache *cache, kvp_pool *pool, kvp_ticket *ticket,
                                    kvp_status status, const char *text, uint64_t exhaustions,
                                    kvp_error *err)
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

static void expect_failure(const kvp_layer *layer, const kvp_tensor *input, kvp_cache *cache,
                           kvp_pool *pool, kvp_ticket *ticket, kvp_status status,
                           const char *text, kvp_error *err)
{
    expect_failure_counting(layer, input, cache, pool, ticket, status, text, 0, err);
}

/* A commit that must be refused with `status` and `text`, changing nothing. */
static void expect_commit_failure(kvp_ticket *ticket, kvp_cache *cache, kvp_pool *pool,
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

/* ---- the seed's fixture ----------------------------------------------------- */

static void test_attention_fixture_matches_seed_trace(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 16, 1, CAPACITY);
    kvp_error err;

    size_t full = 0;
    size_t incremental = 0;
    size_t reused = 0;
    for (size_t t = 0; t < STEPS; t++) {
        kvp_tensor input = kvp_tensor3(fx.x[t], 1, 1, D);
        assert_int_equal(kvp_cache_len(fx.cache), t);
        /* Success leaves the error detail alone. */
        memset(&err, 0x5A, sizeof err);
        kvp_error untouched;
        memcpy(&untouched, &err, sizeof err);
        kvpt_assert_ok(kvp_attention_forward(fx.layer, &input, fx.cache, fx.ticket, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        assert_memory_equal(&err, &untouched, sizeof err);
        assert_int_equal(kvp_cache_len(fx.cache), t + 1);

        kvp_attention_result result = result_of(fx.ticket);
        assert_int_equal(result.batch_size, 1);
        assert_int_equal(result.heads, H);
        assert_int_equal(result.model_width, D);
        assert_int_equal(result.keys, t + 1);
        assert_int_equal(result.committed, 1);
        assert_int_equal(result.reserved_pages, 0); /* consumed by the commit */
        assert_int_equal(result.work.position, t);
        assert_int_equal(result.work.full_prefix_rows_per_projection, t + 1);
        assert_int_equal(result.work.incremental_rows_per_projection, 1);
        assert_int_equal(result.work.reused_key_value_rows, t);
        full += result.work.full_prefix_rows_per_projection;
        incremental += result.work.incremental_rows_per_projection;
        reused += result.work.reused_key_value_rows;

        assert_seed_output(result.output, t);
        for (size_t h = 0; h < H; h++) {
            for (size_t k = 0; k <= t; k++) {
                kvpt_assert_close(result.weights[h * result.keys + k], seed_weights[t][h][k],
                                  1e-12);
            }
        }

        /* The full-prefix reference over positions 0..t agrees exactly. */
        double reference[STEPS * D];
        kvp_tensor prefix = kvp_tensor3(&fx.x[0][0], 1, t + 1, D);
        kvpt_assert_ok(kvp_attention_reference(fx.layer, &prefix, reference, STEPS * D, NULL, NULL,
                                               0, &err),
                       &err);
        double diff = kvpt_max_abs_diff(result.output, reference + t * D, D);
        assert_true(diff <= 1e-12);
        assert_true(diff == 0.0);

        /* The logical snapshot [1, H, t + 1, d_h] holds the seed's rows. */
        double keys[H * STEPS * HD];
        double values[H * STEPS * HD];
        kvpt_assert_ok(kvp_cache_keys(fx.cache, keys, KVPT_COUNT_OF(keys), &err), &err);
        kvpt_assert_ok(kvp_cache_values(fx.cache, values, KVPT_COUNT_OF(values), &err), &err);
        for (size_t h = 0; h < H; h++) {
            for (size_t p = 0; p <= t; p++) {
                for (size_t f = 0; f < HD; f++) {
                    size_t at = (h * (t + 1) + p) * HD + f;
                    kvpt_assert_close(keys[at], seed_keys[h][p][f], 1e-9);
                    kvpt_assert_close(values[at], seed_values[h][p][f], 1e-9);
                    /* W_v = I: the values are the inputs' head slices, bit for bit. */
                    assert_memory_equal(&values[at], &fx.x[p][h * HD + f], sizeof(double));
                }
            }
        }
        kvp_pool_stats stats = kvpt_stats(fx.pool);
        assert_int_equal(stats.held_pages, KVPT_CEIL_DIV(t + 1, BT));
    }
    /* The seed's work line: 6, 3, 3 and 6. */
    assert_int_equal(full, 6);
    assert_int_equal(incremental, 3);
    assert_int_equal(reused, 3);
    assert_int_equal(2 * reused, 6);

    /* One reference pass over all three rows gives the same rows, keys and values. */
    double reference[STEPS * D];
    double ref_keys[H * STEPS * HD];
    double ref_values[H * STEPS * HD];
    kvp_tensor all = kvp_tensor3(&fx.x[0][0], 1, STEPS, D);
    kvpt_assert_ok(kvp_attention_reference(fx.layer, &all, reference, KVPT_COUNT_OF(reference),
                                           ref_keys, ref_values, KVPT_COUNT_OF(ref_keys), &err),
                   &err);
    double keys[H * STEPS * HD];
    double values[H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_keys(fx.cache, keys, KVPT_COUNT_OF(keys), &err), &err);
    kvpt_assert_ok(kvp_cache_values(fx.cache, values, KVPT_COUNT_OF(values), &err), &err);
    assert_memory_equal(keys, ref_keys, sizeof keys);
    assert_memory_equal(values, ref_values, sizeof values);
    for (size_t t = 0; t < STEPS; t++) {
        assert_seed_output(reference + t * D, t);
    }

    /* Three positions on two pages: lane 0 maps pages 0 and 1 of the fresh pool. */
    uint32_t page = 0;
    kvpt_assert_ok(kvp_cache_page(fx.cache, 0, 0, &page, &err), &err);
    assert_int_equal(page, 0);
    kvpt_assert_ok(kvp_cache_page(fx.cache, 0, 1, &page, &err), &err);
    assert_int_equal(page, 1);
    assert_int_equal(free_pages(fx.pool), 14);

    fixture_close(&fx);
}

/*
 * Prepare computes the result and reserves the new block's pages, but the
 * cache does not change until commit; mid-block a prepare reserves nothing.
 */
static void test_attention_prepare_changes_nothing_until_commit(void **state)
{
    (void)state;
    enum { B = 2 };
    fixture fx;
    fixture_open(&fx, 8, B, CAPACITY);
    kvp_ticket *other = kvpt_ticket(fx.cache);
    kvp_error err;

    for (size_t t = 0; t < STEPS; t++) {
        /* Lane 0 runs the fixture; lane 1 the same rows scaled by 1/2. */
        double rows[B * D];
        for (size_t f = 0; f < D; f++) {
            rows[f] = fx.x[t][f];
            rows[D + f] = 0.5 * fx.x[t][f];
        }
        kvp_tensor input = kvp_tensor3(rows, B, 1, D);
        kvpt_state before;
        kvpt_state after;
        kvpt_state_capture(fx.cache, fx.pool, &before);
        kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, fx.ticket, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        kvpt_state_capture(fx.cache, fx.pool, &after);

        size_t reserved = t % BT == 0 ? B : 0;
        kvp_attention_result result = result_of(fx.ticket);
        assert_int_equal(result.reserved_pages, reserved);
        assert_int_equal(result.committed, 0);
        assert_int_equal(result.keys, t + 1);
        assert_int_equal(result.batch_size, B);
        assert_int_equal(result.work.position, t);
        assert_seed_output(result.output, t);
        /* Only the reservation shows: the pages are held, by the ticket. */
        assert_int_equal(after.stats.held_pages, before.stats.held_pages + reserved);
        assert_int_equal(after.stats.free_pages, before.stats.free_pages - reserved);
        assert_int_equal(after.stats.attached_reservations, reserved != 0);
        assert_int_equal(after.stats.acquires, before.stats.acquires + reserved);
        after.stats = before.stats;
        kvpt_assert_state_equal(&before, &after);
        kvpt_state_free(&after);

        /* Another ticket prepared on the same state computes the same row. */
        kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, other, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        kvp_attention_result second = result_of(other);
        assert_memory_equal(second.output, result.output, B * D * sizeof(double));
        assert_memory_equal(second.weights, result.weights, B * H * (t + 1) * sizeof(double));
        assert_int_equal(free_pages(fx.pool), before.stats.free_pages - 2 * reserved);
        kvpt_assert_ok(kvp_ticket_discard(other, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        assert_int_equal(free_pages(fx.pool), before.stats.free_pages - reserved);
        assert_int_equal(kvp_ticket_result(other, &second, &err), KVP_TICKET_EMPTY);
        kvpt_assert_error_text(&err, "attention ticket holds no prepared row");

        kvpt_assert_ok(kvp_ticket_commit(fx.ticket, fx.cache, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        assert_int_equal(kvp_cache_len(fx.cache), t + 1);
        kvp_attention_result committed = result_of(fx.ticket);
        assert_int_equal(committed.committed, 1);
        assert_int_equal(committed.reserved_pages, 0);
        assert_ptr_equal(committed.output, result.output);
        kvp_pool_stats stats = kvpt_stats(fx.pool);
        assert_int_equal(stats.held_pages, B * KVPT_CEIL_DIV(t + 1, BT));
        assert_int_equal(stats.attached_reservations, 0);
        kvpt_state_free(&before);
    }
    /* Lane 1's values are the lane-0 rows halved; its keys were rotated alike. */
    double values[B * H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_values(fx.cache, values, KVPT_COUNT_OF(values), &err), &err);
    for (size_t i = 0; i < H * STEPS * HD; i++) {
        assert_true(values[H * STEPS * HD + i] == 0.5 * values[i]);
    }
    /* Discard after commit is a no-op on the cache and the pool. */
    kvp_pool_stats before = kvpt_stats(fx.pool);
    kvpt_assert_ok(kvp_ticket_discard(fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_ticket_discard(fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvp_pool_stats after = kvpt_stats(fx.pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(kvp_cache_len(fx.cache), STEPS);

    /* Destroying a ticket that holds pages returns them. */
    double rows[B * D] = {0};
    kvp_tensor input = kvp_tensor3(rows, B, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, other, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(result_of(other).reserved_pages, 0); /* position 3 is mid-block */
    kvpt_destroy_ticket(other, fx.pool);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    other = kvpt_ticket(fx.cache);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, other, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(result_of(other).reserved_pages, B);
    assert_int_equal(free_pages(fx.pool), 8 - B);
    kvpt_destroy_ticket(other, fx.pool);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), 8);

    fixture_close(&fx);
}

/* ---- randomized geometries against the reference ---------------------------- */

typedef struct random_case {
    size_t batch;
    size_t heads;
    size_t head_width;
    size_t block_tokens;
    size_t capacity;
    uint64_t seed;
} random_case;

/*
 * One random layer and input sequence [B, C, D]; forward every position until
 * full (alternating prepare + commit and forward), comparing each step with
 * the reference's row at that position; then the logical K/V with the
 * reference's, the physical pages, and a FULL that changes nothing.
 */
static void run_random_case(const random_case *rc)
{
    size_t b_count = rc->batch;
    size_t heads = rc->heads;
    size_t hd = rc->head_width;
    size_t d = heads * hd;
    size_t c = rc->capacity;
    size_t bt = rc->block_tokens;
    size_t total = b_count * KVPT_CEIL_DIV(c, bt);
    kvp_error err;
    kvp_pool *pool = kvpt_pool(bt, heads, hd, total);
    double base = rc->seed % 2 ? ROPE_BASE : 500.0;
    kvp_layer *layer = kvpt_random_layer(d, heads, c + rc->seed % 3, base, rc->seed);
    kvp_cache *cache = cache_for(pool, layer, b_count, c);
    kvp_ticket *ticket = kvpt_ticket(cache);

    size_t rows = b_count * c * d;
    size_t kv = b_count * heads * c * hd;
    double *sequence = kvpt_doubles(rows); /* [B, C, D] */
    double *steps = kvpt_doubles(rows);    /* [C][B * D] */
    double *ref_out = kvpt_doubles(rows);
    double *ref_keys = kvpt_doubles(kv);
    double *ref_values = kvpt_doubles(kv);
    double *keys = kvpt_doubles(kv);
    double *values = kvpt_doubles(kv);
    double *expected = kvpt_doubles(b_count * d);
    kvpt_fill_random(sequence, rows, rc->seed * 7919 + 1);
    for (size_t lane = 0; lane < b_count; lane++) {
        for (size_t t = 0; t < c; t++) {
            memcpy(steps + (t * b_count + lane) * d, sequence + (lane * c + t) * d,
                   d * sizeof(double));
        }
    }
    kvp_tensor whole = kvp_tensor3(sequence, b_count, c, d);
    kvpt_assert_ok(kvp_attention_reference(layer, &whole, ref_out, rows, ref_keys, ref_values, kv,
                                           &err),
                   &err);

    for (size_t t = 0; t < c; t++) {
        kvp_tensor input = kvp_tensor3(steps + t * b_count * d, b_count, 1, d);
        if (t % 2 == 0) {
            kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, ticket, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvp_attention_result prepared = result_of(ticket);
            assert_int_equal(prepared.reserved_pages, t % bt == 0 ? b_count : 0);
            assert_int_equal(prepared.committed, 0);
            assert_int_equal(kvp_cache_len(cache), t);
            kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
            kvpt_assert_pool_ok(pool);
        } else {
            kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
        }
        kvpt_assert_pool_ok(pool);
        assert_int_equal(kvp_cache_len(cache), t + 1);

        kvp_attention_result result = result_of(ticket);
        assert_int_equal(result.committed, 1);
        assert_int_equal(result.batch_size, b_count);
        assert_int_equal(result.heads, heads);
        assert_int_equal(result.model_width, d);
        assert_int_equal(result.keys, t + 1);
        assert_int_equal(result.work.position, t);
        assert_int_equal(result.work.full_prefix_rows_per_projection, t + 1);
        assert_int_equal(result.work.incremental_rows_per_projection, 1);
        assert_int_equal(result.work.reused_key_value_rows, t);
        for (size_t lane = 0; lane < b_count; lane++) {
            memcpy(expected + lane * d, ref_out + (lane * c + t) * d, d * sizeof(double));
        }
        double diff = kvpt_max_abs_diff(result.output, expected, b_count * d);
        if (!(diff <= 1e-12)) {
            print_error("B=%zu H=%zu d_h=%zu block=%zu C=%zu seed=%llu: step %zu differs by %g\n",
                        b_count, heads, hd, bt, c, (unsigned long long)rc->seed, t, diff);
            fail();
        }
        for (size_t row = 0; row < b_count * heads; row++) {
            double sum = 0.0;
            for (size_t k = 0; k <= t; k++) {
                double w = result.weights[row * result.keys + k];
                assert_true(w >= 0.0 && w <= 1.0);
                sum += w;
            }
            kvpt_assert_close(sum, 1.0, 1e-12);
        }
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, b_count * KVPT_CEIL_DIV(t + 1, bt));
        assert_int_equal(stats.free_pages, total - stats.held_pages);
        assert_int_equal(stats.attached_reservations, 0);
    }
    assert_true(kvp_cache_is_full(cache));

    /* The retained rows are the reference's rotated keys and values, bit for bit. */
    kvpt_assert_ok(kvp_cache_keys(cache, keys, kv, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, values, kv, &err), &err);
    assert_memory_equal(keys, ref_keys, kv * sizeof(double));
    assert_memory_equal(values, ref_values, kv * sizeof(double));

    /* A fresh pool hands out pages block-major, lane-minor. */
    for (size_t lane = 0; lane < b_count; lane++) {
        for (size_t block = 0; block < KVPT_CEIL_DIV(c, bt); block++) {
            uint32_t page = 0;
            kvpt_assert_ok(kvp_cache_page(cache, lane, block, &page, &err), &err);
            assert_int_equal(page, block * b_count + lane);
        }
    }
    assert_int_equal(free_pages(pool), 0);

    /* Full: nothing changes. */
    kvp_tensor input = kvp_tensor3(steps, b_count, 1, d);
    char text[64];
    snprintf(text, sizeof text, "KV cache is full at capacity %zu", c);
    expect_failure(layer, &input, cache, pool, ticket, KVP_FULL, text, &err);
    assert_int_equal(err.capacity, c);

    free(sequence);
    free(steps);
    free(ref_out);
    free(ref_keys);
    free(ref_values);
    free(keys);
    free(values);
    free(expected);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

/*
 * Every (head width, block size) pair twice, with batch 1..3 and heads 1..4
 * spread over the pairs so that each round covers every value of each axis,
 * and capacities that are and are not multiples of the block size (1 to 64).
 */
static void test_attention_random_geometries_match_reference(void **state)
{
    (void)state;
    static const size_t head_widths[] = {2, 4, 8, 16};
    static const size_t blocks[] = {1, 2, 3, 16};
    static const size_t capacities[2][16] = {
        {64, 37, 17, 50, 5, 33, 1, 23, 48, 7, 31, 16, 60, 9, 2, 45},
        {3, 64, 41, 32, 19, 2, 63, 49, 11, 29, 6, 34, 1, 55, 26, 18},
    };
    size_t covered_batch[4] = {0};
    size_t covered_heads[5] = {0};
    size_t unaligned = 0;
    for (size_t round = 0; round < 2; round++) {
        for (size_t i = 0; i < KVPT_COUNT_OF(head_widths); i++) {
            for (size_t j = 0; j < KVPT_COUNT_OF(blocks); j++) {
                size_t k = i * KVPT_COUNT_OF(blocks) + j;
                random_case rc;
                rc.batch = 1 + (k + round) % 3;
                rc.heads = 1 + (i + j + 2 * round) % 4;
                rc.head_width = head_widths[i];
                rc.block_tokens = blocks[j];
                rc.capacity = capacities[round][k];
                rc.seed = 100 + 16 * round + k;
                covered_batch[rc.batch]++;
                covered_heads[rc.heads]++;
                unaligned += rc.capacity % rc.block_tokens != 0;
                run_random_case(&rc);
            }
        }
    }
    for (size_t b = 1; b <= 3; b++) {
        assert_true(covered_batch[b] > 0);
    }
    for (size_t h = 1; h <= 4; h++) {
        assert_true(covered_heads[h] > 0);
    }
    assert_true(unaligned >= 8);
}

/* ---- validation errors -------------------------------------------------------- */

/* Every check of the seed's validate_incremental_request, each on its own. */
static void test_attention_validation_errors_with_exact_details(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 32, 1, CAPACITY);
    kvp_tensor single = kvp_tensor3(fx.x[0], 1, 1, D);
    forward_ok(fx.layer, &single, fx.cache, fx.pool, fx.ticket);
    kvp_tensor next = kvp_tensor3(fx.x[1], 1, 1, D);
    kvp_error err;

    /* InputRank. */
    kvp_tensor rank2 = {fx.x[0], {2, {1, D}}};
    expect_failure(fx.layer, &rank2, fx.cache, fx.pool, fx.ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 2",
                   &err);
    assert_int_equal(err.rank, 2);
    kvp_tensor rank4 = kvp_tensor4(fx.x[0], 1, 1, 1, D);
    expect_failure(fx.layer, &rank4, fx.cache, fx.pool, fx.ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 4",
                   &err);
    assert_int_equal(err.rank, 4);
    kvp_tensor rank0 = {fx.x[0], {0, {0}}};
    expect_failure(fx.layer, &rank0, fx.cache, fx.pool, fx.ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 0",
                   &err);

    /* SingleTokenRequired. */
    kvp_tensor two = kvp_tensor3(&fx.x[0][0], 1, 2, D);
    expect_failure(fx.layer, &two, fx.cache, fx.pool, fx.ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 2", &err);
    assert_int_equal(err.tokens, 2);
    kvp_tensor none = kvp_tensor3(fx.x[0], 1, 0, D);
    expect_failure(fx.layer, &none, fx.cache, fx.pool, fx.ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 0", &err);
    assert_int_equal(err.tokens, 0);

    /* InputBatchMismatch. */
    kvp_tensor batch2 = kvp_tensor3(&fx.x[0][0], 2, 1, D);
    expect_failure(fx.layer, &batch2, fx.cache, fx.pool, fx.ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 2 must match cache batch 1", &err);
    assert_int_equal(err.expected_size, 1);
    assert_int_equal(err.actual_size, 2);
    kvp_tensor batch0 = kvp_tensor3(fx.x[0], 0, 1, D);
    expect_failure(fx.layer, &batch0, fx.cache, fx.pool, fx.ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 0 must match cache batch 1", &err);

    /* InputWidthMismatch. */
    kvp_tensor narrow = kvp_tensor3(fx.x[0], 1, 1, 3);
    expect_failure(fx.layer, &narrow, fx.cache, fx.pool, fx.ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 3", &err);
    assert_int_equal(err.expected_size, 4);
    assert_int_equal(err.actual_size, 3);
    kvp_tensor wide = kvp_tensor3(&fx.x[0][0], 1, 1, 8);
    expect_failure(fx.layer, &wide, fx.cache, fx.pool, fx.ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 8", &err);

    /* CacheModelWidthMismatch: a cache of the seed's "wider" layer (D = 8, 2 heads). */
    kvp_layer *wider = kvpt_random_layer(8, 2, MAX_POSITIONS, ROPE_BASE, 37);
    kvp_pool *wide_pool = kvpt_pool(BT, 2, 4, 4);
    kvp_cache *wide_cache = cache_for(wide_pool, wider, 1, CAPACITY);
    kvp_ticket *wide_ticket = kvpt_ticket(wide_cache);
    double eight[8] = {0.5, -0.5, 0.25, 1.0, -1.0, 0.0, 0.75, 0.125};
    kvp_tensor wide_row = kvp_tensor3(eight, 1, 1, 8);
    forward_ok(wider, &wide_row, wide_cache, wide_pool, wide_ticket);
    expect_failure(fx.layer, &single, wide_cache, wide_pool, wide_ticket,
                   KVP_CACHE_MODEL_WIDTH_MISMATCH,
                   "KV cache model width 8 must match attention layer width 4", &err);
    assert_int_equal(err.layer_size, 4);
    assert_int_equal(err.cache_size, 8);

    /* CacheHeadCountMismatch: the seed's one-head layer (D = 4, d_h = 4). */
    kvp_layer *one_head = kvpt_random_layer(D, 1, MAX_POSITIONS, ROPE_BASE, 38);
    kvp_pool *one_pool = kvpt_pool(BT, 1, 4, 4);
    kvp_cache *one_cache = cache_for(one_pool, one_head, 1, CAPACITY);
    kvp_ticket *one_ticket = kvpt_ticket(one_cache);
    forward_ok(one_head, &single, one_cache, one_pool, one_ticket);
    expect_failure(fx.layer, &single, one_cache, one_pool, one_ticket,
                   KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 1 must match attention layer head count 2", &err);
    assert_int_equal(err.layer_size, 2);
    assert_int_equal(err.cache_size, 1);

    /*
     * CacheHeadWidthMismatch. A valid binding has model_width == heads *
     * head_width, so with equal model widths and head counts the head widths
     * agree: this check is unreachable through kvp_cache_create (as it is
     * through the seed's LayerKvCache::new). Forge the captured model width.
     */
    kvp_pool *odd_pool = kvpt_pool(BT, 2, 3, 4);
    kvp_binding odd = kvpt_binding(2, 3, MAX_POSITIONS);
    kvp_cache *odd_cache = kvpt_cache(odd_pool, &odd, 1, CAPACITY);
    kvp_ticket *odd_ticket = kvpt_ticket(odd_cache);
    kvpi_layer_record odd_record = kvpt_record(&odd);
    odd_record.model_width = D;
    odd_cache->binding = kvpt_rebind(&odd, &odd_record);
    expect_failure(fx.layer, &single, odd_cache, odd_pool, odd_ticket,
                   KVP_CACHE_HEAD_WIDTH_MISMATCH,
                   "KV cache head width 3 must match attention layer head width 2", &err);
    assert_int_equal(err.layer_size, 2);
    assert_int_equal(err.cache_size, 3);

    /* CacheLayerMismatch: a rebuilt layer, same shapes and values, new nodes. */
    /* The pager checks only its part of a binding (kind, page geometry);
     * attention's record is the owner's, checked at prepare as above. */
    kvp_binding unknown = odd;
    unknown.kind = 0;
    kvp_cache *refused = (kvp_cache *)0x1;
    assert_int_equal(kvp_cache_create(odd_pool, &unknown, 1, CAPACITY, &refused, &err),
                     KVP_INVALID_ARGUMENT);
    kvpt_assert_error_text(&err, "argument `binding` is invalid: kind must be "
                                 "KVP_BINDING_LAYER or KVP_BINDING_EXTERNAL, reserved 0");
    assert_ptr_equal(refused, (kvp_cache *)0x1);
    kvpt_assert_pool_ok(odd_pool);

    kvp_layer *rebuilt = fixture_layer();
    expect_failure(rebuilt, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    /* ... and one new node among four shared ones is enough. */
    kvp_layer *partly = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param_mut(fx.layer, 0),
                                    kvp_layer_param_mut(fx.layer, 1),
                                    kvp_layer_param_mut(fx.layer, 2),
                                    kvp_layer_param_mut(rebuilt, 3), H,
                                    MAX_POSITIONS, ROPE_BASE, &partly, &err),
                   &err);
    expect_failure(partly, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    kvpt_destroy_layer(partly);

    /* CacheRopeMismatch: the same nodes under another base, or more positions. */
    kvp_layer *other_base = layer_sharing(fx.layer, MAX_POSITIONS, 2.0 * ROPE_BASE);
    expect_failure(other_base, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 20000.0)",
                   &err);
    assert_int_equal(err.cache_rope.feature_width, 2);
    assert_int_equal(err.cache_rope.max_positions, 8);
    assert_true(err.cache_rope.base == ROPE_BASE);
    assert_int_equal(err.layer_rope.feature_width, 2);
    assert_int_equal(err.layer_rope.max_positions, 8);
    assert_true(err.layer_rope.base == 2.0 * ROPE_BASE);
    kvp_layer *more_positions = layer_sharing(fx.layer, MAX_POSITIONS + 1, ROPE_BASE);
    expect_failure(more_positions, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 9 positions, base 10000.0)",
                   &err);
    assert_int_equal(err.layer_rope.max_positions, 9);
    kvp_layer *fractional = layer_sharing(fx.layer, MAX_POSITIONS, 12345.678);
    expect_failure(fractional, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 12345.678)",
                   &err);
    /* The base compares by bits: the next double up is a different configuration. */
    kvp_layer *next_base = layer_sharing(fx.layer, MAX_POSITIONS, nextafter(ROPE_BASE, INFINITY));
    expect_failure(next_base, &next, fx.cache, fx.pool, fx.ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base "
                   "10000.000000000002)",
                   &err);

    /* Full: the seed's one-row cache. */
    kvp_cache *small = cache_for(fx.pool, fx.layer, 1, 1);
    kvp_ticket *small_ticket = kvpt_ticket(small);
    forward_ok(fx.layer, &single, small, fx.pool, small_ticket);
    expect_failure(fx.layer, &single, small, fx.pool, small_ticket, KVP_FULL,
                   "KV cache is full at capacity 1", &err);
    assert_int_equal(err.capacity, 1);

    /* The cache that took all of this still works, with the fixture's numbers. */
    forward_ok(fx.layer, &next, fx.cache, fx.pool, fx.ticket);
    kvp_attention_result result = result_of(fx.ticket);
    assert_seed_output(result.output, 1);

    kvpt_destroy_ticket(small_ticket, fx.pool);
    kvpt_destroy_cache(small, fx.pool);
    kvpt_destroy_layer(next_base);
    kvpt_destroy_layer(fractional);
    kvpt_destroy_layer(more_positions);
    kvpt_destroy_layer(other_base);
    kvpt_destroy_layer(rebuilt);
    kvpt_destroy_ticket(odd_ticket, odd_pool);
    kvpt_destroy_cache(odd_cache, odd_pool);
    kvpt_destroy_pool(odd_pool);
    kvpt_destroy_ticket(one_ticket, one_pool);
    kvpt_destroy_cache(one_cache, one_pool);
    kvpt_destroy_pool(one_pool);
    kvpt_destroy_layer(one_head);
    kvpt_destroy_ticket(wide_ticket, wide_pool);
    kvpt_destroy_cache(wide_cache, wide_pool);
    kvpt_destroy_pool(wide_pool);
    kvpt_destroy_layer(wider);
    fixture_close(&fx);
}

/* When several checks fail, the one earliest in the seed's order is reported. */
static void test_attention_validation_order(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 32, 1, 1);
    kvp_cache *full = fx.cache;
    kvp_tensor single = kvp_tensor3(fx.x[0], 1, 1, D);
    double huge[2 * D] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, D);
    kvp_error err;
    forward_ok(fx.layer, &single, full, fx.pool, fx.ticket);

    /* Rank before capacity; tokens before batch; batch before width. */
    kvp_tensor rank2 = {fx.x[0], {2, {1, D}}};
    expect_failure(fx.layer, &rank2, full, fx.pool, fx.ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 2",
                   &err);
    kvp_tensor two_by_two = kvp_tensor3(huge, 2, 2, 2);
    expect_failure(fx.layer, &two_by_two, full, fx.pool, fx.ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 2", &err);
    kvp_tensor batch_and_width = kvp_tensor3(huge, 2, 1, 3);
    expect_failure(fx.layer, &batch_and_width, full, fx.pool, fx.ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 2 must match cache batch 1", &err);

    /* Input width before the cache's model width. */
    kvp_layer *wider = kvpt_random_layer(8, 1, MAX_POSITIONS, ROPE_BASE, 5);
    kvp_pool *wide_pool = kvpt_pool(BT, 1, 8, 2);
    kvp_cache *wide_cache = cache_for(wide_pool, wider, 1, CAPACITY);
    kvp_tensor narrow = kvp_tensor3(fx.x[0], 1, 1, 3);
    expect_failure(fx.layer, &narrow, wide_cache, wide_pool, fx.ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 3", &err);
    /* Model width before head count (D = 8 with 1 head differs in both). */
    expect_failure(fx.layer, &single, wide_cache, wide_pool, fx.ticket,
                   KVP_CACHE_MODEL_WIDTH_MISMATCH,
                   "KV cache model width 8 must match attention layer width 4", &err);

    /* Head count before identities and revisions: the fixture's own nodes, with
     * a stale revision, in a one-head binding. */
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(fx.layer, &binding, &err), &err);
    kvpi_layer_record one_record = kvpt_record(&binding);
    one_record.heads = 1;
    one_record.rope_feature_width = D;
    one_record.revision[KVP_PARAM_VALUE] = 5;
    kvp_binding one_head = binding;
    one_head.kv_heads = 1;
    one_head.head_width = D;
    one_head = kvpt_rebind(&one_head, &one_record);
    kvp_pool *one_pool = kvpt_pool(BT, 1, D, 2);
    kvp_cache *one_cache = kvpt_cache(one_pool, &one_head, 1, CAPACITY);
    expect_failure(fx.layer, &single, one_cache, one_pool, fx.ticket, KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 1 must match attention layer head count 2", &err);
    one_record.node_id[KVP_PARAM_OUTPUT] = 1;
    one_head = kvpt_rebind(&one_head, &one_record);
    kvp_cache *one_cache_other_ids = kvpt_cache(one_pool, &one_head, 1, CAPACITY);
    expect_failure(fx.layer, &single, one_cache_other_ids, one_pool, fx.ticket,
                   KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 1 must match attention layer head count 2", &err);

    /* Head width before identities (kvpt_binding's ids are not the layer's). */
    kvp_pool *odd_pool = kvpt_pool(BT, H, 3, 2);
    kvp_binding odd = kvpt_binding(H, 3, MAX_POSITIONS);
    kvp_cache *odd_cache = kvpt_cache(odd_pool, &odd, 1, CAPACITY);
    kvpi_layer_record odd_record = kvpt_record(&odd);
    odd_record.model_width = D;
    odd_cache->binding = kvpt_rebind(&odd, &odd_record);
    expect_failure(fx.layer, &single, odd_cache, odd_pool, fx.ticket, KVP_CACHE_HEAD_WIDTH_MISMATCH,
                   "KV cache head width 3 must match attention layer head width 2", &err);

    /* All four identities before any revision: a stale revision at index 0 and a
     * foreign node at index 3 report the identity. */
    kvpi_layer_record record = kvpt_record(&binding);
    record.revision[KVP_PARAM_QUERY] = 7;
    record.node_id[KVP_PARAM_OUTPUT] += 1000;
    kvp_binding forged = kvpt_rebind(&binding, &record);
    kvp_cache *forged_cache = kvpt_cache(fx.pool, &forged, 1, CAPACITY);
    expect_failure(fx.layer, &single, forged_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    kvpt_destroy_cache(forged_cache, fx.pool);

    /* Revisions in stable order, before RoPE and capacity. */
    record = kvpt_record(&binding);
    record.revision[KVP_PARAM_KEY] = 3;
    record.revision[KVP_PARAM_OUTPUT] = 9;
    double other_base = 20000.0;
    memcpy(&record.rope_base_bits, &other_base, sizeof other_base);
    forged = kvpt_rebind(&binding, &record);
    forged_cache = kvpt_cache(fx.pool, &forged, 1, CAPACITY);
    expect_failure(fx.layer, &single, forged_cache, fx.pool, fx.ticket,
                   KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 3 at stable index 1 does not match layer "
                   "revision 0",
                   &err);
    assert_int_equal(err.parameter, 1);
    assert_int_equal(err.cache_revision, 3);
    assert_int_equal(err.layer_revision, 0);
    kvpt_destroy_cache(forged_cache, fx.pool);

    /* RoPE before capacity: the full cache under another base. */
    kvp_layer *rope_layer = layer_sharing(fx.layer, MAX_POSITIONS, other_base);
    expect_failure(rope_layer, &single, full, fx.pool, fx.ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 20000.0)",
                   &err);

    /* Capacity before the ticket and before any computation. */
    kvp_cache *open = cache_for(fx.pool, fx.layer, 1, CAPACITY);
    kvp_ticket *busy = kvpt_ticket(open);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &single, open, busy, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_failure(fx.layer, &single, full, fx.pool, busy, KVP_FULL,
                   "KV cache is full at capacity 1", &err);
    expect_failure(fx.layer, &overflowing, full, fx.pool, fx.ticket, KVP_FULL,
                   "KV cache is full at capacity 1", &err);

    /* A busy ticket before its geometry; geometry before any computation. */
    kvp_cache *batch2 = cache_for(fx.pool, fx.layer, 2, CAPACITY);
    kvp_tensor pair = kvp_tensor3(huge, 2, 1, D);
    expect_failure(fx.layer, &pair, batch2, fx.pool, busy, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    expect_failure(fx.layer, &pair, batch2, fx.pool, fx.ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 2 heads, head width 2 and capacity 1 does "
                   "not fit this KV cache",
                   &err);
    kvpt_assert_ok(kvp_ticket_discard(busy, &err), &err);
    kvpt_assert_pool_ok(fx.pool);

    /* Computation before the page reservation: on an exhausted pool a row that
     * would open a block fails on its score, and no exhaustion is counted. */
    kvp_pool *tight = kvpt_pool(BT, H, HD, 1);
    kvp_cache *tight_cache = cache_for(tight, fx.layer, 1, CAPACITY);
    kvp_cache *hog = cache_for(tight, fx.layer, 1, CAPACITY);
    kvp_ticket *hog_ticket = kvpt_ticket(hog);
    forward_ok(fx.layer, &single, hog, tight, hog_ticket);
    assert_int_equal(free_pages(tight), 0);
    expect_failure(fx.layer, &overflowing, tight_cache, tight, busy, KVP_NONFINITE_SCORE,
                   "incremental softmax: attention score at flat index 0 must be finite, got inf",
                   &err);
    expect_failure_counting(fx.layer, &single, tight_cache, tight, busy, KVP_POOL_EXHAUSTED,
                            "page pool exhausted: 1 pages needed, 0 free", 1, &err);

    kvpt_destroy_ticket(hog_ticket, tight);
    kvpt_destroy_cache(hog, tight);
    kvpt_destroy_cache(tight_cache, tight);
    kvpt_destroy_pool(tight);
    kvpt_destroy_cache(batch2, fx.pool);
    kvpt_destroy_ticket(busy, fx.pool);
    kvpt_destroy_cache(open, fx.pool);
    kvpt_destroy_layer(rope_layer);
    kvpt_destroy_cache(odd_cache, odd_pool);
    kvpt_destroy_pool(odd_pool);
    kvpt_destroy_cache(one_cache_other_ids, one_pool);
    kvpt_destroy_cache(one_cache, one_pool);
    kvpt_destroy_pool(one_pool);
    kvpt_destroy_cache(wide_cache, wide_pool);
    kvpt_destroy_pool(wide_pool);
    kvpt_destroy_layer(wider);
    fixture_close(&fx);
}

static void copy_values(void *ctx, double *values, size_t width)
{
    memcpy(values, ctx, width * width * sizeof *values);
}

/*
 * The seed's AdamW case: an in-place update keeps the nodes but advances a
 * revision, so the old cache is stale, and reset does not refresh it; a new
 * cache of the updated layer works.
 */
static void test_attention_in_place_update_makes_cache_stale_for_good(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 16, 1, CAPACITY);
    kvp_cache *old_cache = fx.cache;
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(fx.x[1], 1, 1, D);
    kvp_error err;
    forward_ok(fx.layer, &x0, old_cache, fx.pool, fx.ticket);

    /* The same values written back: the revision still advances. */
    kvp_param *w_value = kvp_layer_param_mut(fx.layer, KVP_PARAM_VALUE);
    double same[D * D];
    memcpy(same, kvp_param_values(w_value), sizeof same);
    kvpt_assert_ok(kvp_param_update_with(w_value, copy_values, same, &err), &err);
    assert_int_equal(kvp_param_revision(w_value), 1);
    expect_failure(fx.layer, &x1, old_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 2 does not match layer "
                   "revision 1",
                   &err);
    assert_int_equal(err.parameter, 2);
    assert_int_equal(err.cache_revision, 0);
    assert_int_equal(err.layer_revision, 1);

    /* Reset clears the rows but not the binding. */
    kvpt_assert_ok(kvp_cache_reset(old_cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_failure(fx.layer, &x0, old_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 2 does not match layer "
                   "revision 1",
                   &err);

    /* A new cache of the updated layer reproduces the first output exactly. */
    kvp_cache *new_cache = cache_for(fx.pool, fx.layer, 1, CAPACITY);
    forward_ok(fx.layer, &x0, new_cache, fx.pool, fx.ticket);
    kvp_attention_result result = result_of(fx.ticket);
    assert_memory_equal(result.output, seed_outputs[0], sizeof seed_outputs[0]);

    /* Two more updates: the lowest stale index is reported, with both revisions. */
    kvp_param *w_key = kvp_layer_param_mut(fx.layer, KVP_PARAM_KEY);
    kvp_param *w_output = kvp_layer_param_mut(fx.layer, KVP_PARAM_OUTPUT);
    memcpy(same, kvp_param_values(w_output), sizeof same);
    kvpt_assert_ok(kvp_param_update(w_output, same, &err), &err);
    kvpt_assert_ok(kvp_param_update(w_output, same, &err), &err);
    expect_failure(fx.layer, &x1, new_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 3 does not match layer "
                   "revision 2",
                   &err);
    memcpy(same, kvp_param_values(w_key), sizeof same);
    kvpt_assert_ok(kvp_param_update(w_key, same, &err), &err);
    expect_failure(fx.layer, &x1, new_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 1 does not match layer "
                   "revision 1",
                   &err);
    /* The old cache still reports its own first stale index. */
    expect_failure(fx.layer, &x0, old_cache, fx.pool, fx.ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 1 does not match layer "
                   "revision 1",
                   &err);

    kvpt_destroy_cache(new_cache, fx.pool);
    fixture_close(&fx);
}

/* ---- pool exhaustion and non-finite values --------------------------------------- */

static void test_attention_pool_exhausted_changes_nothing_but_the_counter(void **state)
{
    (void)state;
    enum { B = 2 };
    /* Four pages: another cache takes one, this cache's first block two. */
    fixture fx;
    fixture_open(&fx, 4, B, CAPACITY);
    kvp_cache *other = cache_for(fx.pool, fx.layer, 1, CAPACITY);
    kvp_ticket *other_ticket = kvpt_ticket(other);
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    forward_ok(fx.layer, &x0, other, fx.pool, other_ticket);
    double rows[STEPS][B * D];
    for (size_t t = 0; t < STEPS; t++) {
        memcpy(rows[t], fx.x[t], sizeof fx.x[t]);
        memcpy(rows[t] + D, fx.x[t], sizeof fx.x[t]);
    }
    kvp_tensor r0 = kvp_tensor3(rows[0], B, 1, D);
    kvp_tensor r1 = kvp_tensor3(rows[1], B, 1, D);
    kvp_tensor r2 = kvp_tensor3(rows[2], B, 1, D);
    forward_ok(fx.layer, &r0, fx.cache, fx.pool, fx.ticket);
    forward_ok(fx.layer, &r1, fx.cache, fx.pool, fx.ticket);
    assert_int_equal(free_pages(fx.pool), 1);

    kvp_error err;
    uint64_t exhaustions = kvpt_stats(fx.pool).exhaustions;
    expect_failure_counting(fx.layer, &r2, fx.cache, fx.pool, fx.ticket, KVP_POOL_EXHAUSTED,
                            "page pool exhausted: 2 pages needed, 1 free", 1, &err);
    assert_int_equal(err.needed, 2);
    assert_int_equal(err.available, 1);
    kvp_pool_stats stats = kvpt_stats(fx.pool);
    assert_int_equal(stats.exhaustions, exhaustions + 2); /* prepare and forward */
    assert_int_equal(stats.attached_reservations, 0);
    kvp_attention_result result;
    assert_int_equal(kvp_ticket_result(fx.ticket, &result, &err), KVP_TICKET_EMPTY);

    /* With the other cache gone, the same row goes through, with the seed's output
     * in both lanes. */
    kvpt_destroy_ticket(other_ticket, fx.pool);
    kvpt_destroy_cache(other, fx.pool);
    forward_ok(fx.layer, &r2, fx.cache, fx.pool, fx.ticket);
    result = result_of(fx.ticket);
    for (size_t lane = 0; lane < B; lane++) {
        assert_seed_output(result.output + lane * D, 2);
    }
    assert_int_equal(free_pages(fx.pool), 0);
    assert_int_equal(kvpt_stats(fx.pool).exhaustions, exhaustions + 2);

    fixture_close(&fx);
}

/* A fixture-shaped layer with W[which] = I except column 1 rows 0 and 2 = value. */
static kvp_layer *layer_with_column(size_t which, double value)
{
    double identity[D * D];
    double swap[D * D];
    double special[D * D];
    fixture_matrix(identity, 0);
    fixture_matrix(swap, 1);
    fixture_matrix(special, which == KVP_PARAM_OUTPUT);
    special[0 * D + 1] = value;
    special[2 * D + 1] = value;
    const double *w[KVP_PARAM_COUNT] = {identity, identity, identity, swap};
    w[which] = special;
    return kvpt_layer_from_matrices(D, w, H, MAX_POSITIONS, ROPE_BASE);
}

static void test_attention_nonfinite_projection_names_the_projection(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 16);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;
    static const char *const names[] = {"query", "key", "value"};

    /* [1, 0, 1, 0] times a column holding DBL_MAX twice overflows at index 1. */
    for (size_t which = 0; which < 3; which++) {
        kvp_layer *layer = layer_with_column(which, DBL_MAX);
        kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
        kvp_ticket *ticket = kvpt_ticket(cache);
        kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D); /* x1 W stays finite */
        forward_ok(layer, &x1, cache, pool, ticket);
        kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
        char text[128];
        snprintf(text, sizeof text,
                 "incremental Q/K/V projection: %s at flat index 1 must be finite, got inf",
                 names[which]);
        expect_failure(layer, &x0, cache, pool, ticket, KVP_NONFINITE_PROJECTION, text, &err);
        assert_string_equal(err.what, names[which]);
        assert_int_equal(err.index, 1);
        assert_true(isinf(err.value) && err.value > 0);
        kvp_attention_result result;
        assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);
        kvpt_destroy_ticket(ticket, pool);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_layer(layer);
    }

    /* -DBL_MAX gives -inf; in lane 1 the flat index counts lane 0's row. */
    kvp_layer *layer = layer_with_column(KVP_PARAM_VALUE, -DBL_MAX);
    kvp_cache *cache = cache_for(pool, layer, 2, CAPACITY);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double rows[2 * D] = {0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0};
    kvp_tensor pair = kvp_tensor3(rows, 2, 1, D);
    expect_failure(layer, &pair, cache, pool, ticket, KVP_NONFINITE_PROJECTION,
                   "incremental Q/K/V projection: value at flat index 5 must be finite, got -inf",
                   &err);
    assert_int_equal(err.index, 5);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);

    /* NaN input: the query is checked first. */
    layer = fixture_layer();
    cache = cache_for(pool, layer, 1, CAPACITY);
    ticket = kvpt_ticket(cache);
    double nan_row[D] = {NAN, 0.0, 0.0, 0.0};
    kvp_tensor nan_input = kvp_tensor3(nan_row, 1, 1, D);
    expect_failure(layer, &nan_input, cache, pool, ticket, KVP_NONFINITE_PROJECTION,
                   "incremental Q/K/V projection: query at flat index 0 must be finite, got NaN",
                   &err);
    assert_string_equal(err.what, "query");
    assert_true(isnan(err.value));
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

static void test_attention_nonfinite_score_and_output(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 16);
    kvp_layer *layer = fixture_layer();
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;
    double huge[D] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, D);

    /* The seed's case: finite projections, overflowing scores, on an empty cache. */
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = kvpt_ticket(cache);
    expect_failure(layer, &overflowing, cache, pool, ticket, KVP_NONFINITE_SCORE,
                   "incremental softmax: attention score at flat index 0 must be finite, got inf",
                   &err);
    assert_int_equal(err.index, 0);
    assert_true(isinf(err.value));
    assert_int_equal(kvp_cache_len(cache), 0);
    assert_int_equal(free_pages(pool), 16);

    /* At position 1 the rotated query overflows to inf, and inf * 0 against the
     * retained key [1, 0] gives NaN. */
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    forward_ok(layer, &x0, cache, pool, ticket);
    expect_failure(layer, &overflowing, cache, pool, ticket, KVP_NONFINITE_SCORE,
                   "incremental softmax: attention score at flat index 0 must be finite, got NaN",
                   &err);
    assert_true(isnan(err.value));
    /* A committed ticket whose next prepare fails computing holds no result. */
    kvp_attention_result result;
    assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);
    kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D);
    forward_ok(layer, &x1, cache, pool, ticket);
    result = result_of(ticket);
    assert_seed_output(result.output, 1);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);

    /* Non-finite output: W_q = 0 keeps the scores at 0, W_o = 2 doubles 1e308. */
    double zero[D * D] = {0};
    double identity[D * D];
    double twos[D * D];
    fixture_matrix(identity, 0);
    for (size_t i = 0; i < D * D; i++) {
        twos[i] = 2.0;
    }
    const double *const w[KVP_PARAM_COUNT] = {zero, identity, identity, twos};
    kvp_layer *doubling = kvpt_layer_from_matrices(D, w, H, MAX_POSITIONS, ROPE_BASE);
    cache = cache_for(pool, doubling, 1, CAPACITY);
    ticket = kvpt_ticket(cache);
    double big[D] = {1e308, 0.0, 0.0, 0.0};
    kvp_tensor big_input = kvp_tensor3(big, 1, 1, D);
    expect_failure(doubling, &big_input, cache, pool, ticket, KVP_NONFINITE_OUTPUT,
                   "incremental output projection: output at flat index 0 must be finite, got "
                   "inf",
                   &err);
    assert_int_equal(err.index, 0);
    /* Half the input stays finite: 0.5e308 * 2 = 1e308 in every column; the value
     * row is kept as projected. */
    double half[D] = {0.5e308, 0.0, 0.0, 0.0};
    kvp_tensor half_input = kvp_tensor3(half, 1, 1, D);
    forward_ok(doubling, &half_input, cache, pool, ticket);
    result = result_of(ticket);
    for (size_t f = 0; f < D; f++) {
        assert_true(result.output[f] == 1e308);
    }
    double values[H * HD];
    kvpt_assert_ok(kvp_cache_values(cache, values, KVPT_COUNT_OF(values), &err), &err);
    assert_true(values[0] == 0.5e308);

    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(doubling);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

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

/* ---- the ticket's life -------------------------------------------------------------- */

static void test_attention_ticket_stale_after_commit_or_reset(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 8, 1, CAPACITY);
    kvp_ticket *first = fx.ticket;
    kvp_ticket *second = kvpt_ticket(fx.cache);
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(fx.x[1], 1, 1, D);
    kvp_tensor x2 = kvp_tensor3(fx.x[2], 1, 1, D);
    kvp_error err;
    forward_ok(fx.layer, &x0, fx.cache, fx.pool, second);

    /* Mid-block: the first ticket reserved nothing. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(result_of(first).reserved_pages, 0);
    forward_ok(fx.layer, &x1, fx.cache, fx.pool, second);
    expect_commit_failure(first, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 1 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    assert_int_equal(err.prepared_len, 1);
    assert_int_equal(err.current_len, 2);
    /* Refused, the ticket keeps its row: it is still busy, and still stale. */
    kvp_attention_result kept = result_of(first);
    assert_int_equal(kept.committed, 0);
    expect_failure(fx.layer, &x2, fx.cache, fx.pool, first, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    expect_commit_failure(first, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 1 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);

    /* At a block boundary both tickets reserve a page; the stale one keeps its page
     * until it is discarded, and the audit accounts for it. */
    size_t free_before = free_pages(fx.pool);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x2, fx.cache, first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(result_of(first).reserved_pages, 1);
    assert_int_equal(free_pages(fx.pool), free_before - 1);
    forward_ok(fx.layer, &x2, fx.cache, fx.pool, second);
    assert_int_equal(free_pages(fx.pool), free_before - 2);
    expect_commit_failure(first, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 2 and the "
                          "cache has changed since (length 3 now)",
                          &err);
    assert_int_equal(result_of(first).reserved_pages, 1);
    kvp_pool_stats stats = kvpt_stats(fx.pool);
    assert_int_equal(stats.held_pages, 2 + 1);
    assert_int_equal(stats.attached_reservations, 1);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), free_before - 1);
    assert_int_equal(kvpt_stats(fx.pool).attached_reservations, 0);
    kvp_attention_result result;
    assert_int_equal(kvp_ticket_result(first, &result, &err), KVP_TICKET_EMPTY);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err); /* idempotent */
    kvpt_assert_pool_ok(fx.pool);

    /* A reset makes a prepared ticket stale too, pages and all. */
    kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x0, fx.cache, first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(result_of(first).reserved_pages, 1);
    forward_ok(fx.layer, &x0, fx.cache, fx.pool, second);
    forward_ok(fx.layer, &x1, fx.cache, fx.pool, second);
    kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_commit_failure(first, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 0 and the "
                          "cache has changed since (length 0 now)",
                          &err);
    assert_int_equal(err.prepared_len, 0);
    assert_int_equal(err.current_len, 0);
    assert_int_equal(free_pages(fx.pool), 8 - 1);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), 8);

    /* Even a reset of an empty cache invalidates what was prepared on it. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x0, fx.cache, first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_commit_failure(first, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 0 and the "
                          "cache has changed since (length 0 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(fx.pool);

    kvpt_destroy_ticket(second, fx.pool);
    fixture_close(&fx);
}

/*
 * Staleness, checked independently of the test above: the cache changes
 * through other doors (the internal append, a truncation as sequences undo
 * a failed prefill, a reset followed by appends back to the same length),
 * and a ticket prepared before is stale every time, even when the length it
 * was prepared at is the length again. A fresh ticket then commits.
 */
static void test_attention_ticket_stale_through_every_door(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 8, 1, CAPACITY);
    kvp_ticket *ticket = fx.ticket;
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(fx.x[1], 1, 1, D);
    double key_row[H * HD] = {0.5, -0.25, 1.0, 2.0};
    kvp_tensor row = kvp_tensor4(key_row, 1, H, 1, HD);
    kvp_error err;
    forward_ok(fx.layer, &x0, fx.cache, fx.pool, ticket); /* len 1 */

    /* An append that is not a ticket's commit. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, ticket, &err), &err);
    kvpt_assert_ok(kvpi_cache_append(fx.cache, &row, &row, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_commit_failure(ticket, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 1 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);

    /* A truncation back to the length the ticket was prepared at. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, ticket, &err), &err);
    kvpt_assert_ok(kvpi_cache_append(fx.cache, &row, &row, &err), &err);
    kvpi_cache_truncate_many(&fx.cache, 1, 2);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(kvp_cache_len(fx.cache), 2);
    expect_commit_failure(ticket, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 2 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);

    /* A reset, then appends back to the prepared length 2. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, ticket, &err), &err);
    kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
    kvpt_assert_ok(kvpi_cache_append(fx.cache, &row, &row, &err), &err);
    kvpt_assert_ok(kvpi_cache_append(fx.cache, &row, &row, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_commit_failure(ticket, fx.cache, fx.pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 2 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    assert_int_equal(err.prepared_len, 2);
    assert_int_equal(err.current_len, 2);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);

    /* Prepared on the current state, the same ticket commits. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, ticket, &err), &err);
    kvpt_assert_ok(kvp_ticket_commit(ticket, fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(kvp_cache_len(fx.cache), 3);
    fixture_close(&fx);
}

static void test_attention_ticket_refuses_a_foreign_cache_and_keeps_its_row(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 8, 1, CAPACITY);
    kvp_cache *a = fx.cache;
    kvp_cache *b = cache_for(fx.pool, fx.layer, 1, CAPACITY);
    kvp_error err;
    for (size_t t = 0; t < STEPS; t++) {
        kvp_tensor input = kvp_tensor3(fx.x[t], 1, 1, D);
        kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, a, fx.ticket, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        size_t reserved = t % BT == 0 ? 1 : 0;
        assert_int_equal(result_of(fx.ticket).reserved_pages, reserved);
        /* B has the same geometry and the same length, but is another cache. */
        assert_int_equal(kvp_cache_len(b), kvp_cache_len(a));
        expect_commit_failure(fx.ticket, b, fx.pool, KVP_TICKET_FOREIGN_CACHE,
                              "attention ticket was prepared for another KV cache", &err);
        assert_int_equal(result_of(fx.ticket).reserved_pages, reserved);
        assert_int_equal(kvp_cache_len(a), t);
        /* ... and the row still commits to its own cache. */
        kvpt_assert_ok(kvp_ticket_commit(fx.ticket, a, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
        kvp_attention_result result = result_of(fx.ticket);
        assert_seed_output(result.output, t);
        /* Keep B level with A through its own ticket. */
        kvp_ticket *own = kvpt_ticket(b);
        forward_ok(fx.layer, &input, b, fx.pool, own);
        kvpt_destroy_ticket(own, fx.pool);
        assert_int_equal(kvp_cache_len(a), t + 1);
    }
    /* A committed ticket is empty for every cache. */
    expect_commit_failure(fx.ticket, a, fx.pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    expect_commit_failure(fx.ticket, b, fx.pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    double ka[H * STEPS * HD];
    double kb[H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_keys(a, ka, KVPT_COUNT_OF(ka), &err), &err);
    kvpt_assert_ok(kvp_cache_keys(b, kb, KVPT_COUNT_OF(kb), &err), &err);
    assert_memory_equal(ka, kb, sizeof ka);

    kvpt_destroy_cache(b, fx.pool);
    fixture_close(&fx);
}

static void test_attention_ticket_empty_and_busy(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 8, 1, CAPACITY);
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(fx.x[1], 1, 1, D);
    kvp_error err;

    /* A fresh ticket holds nothing. */
    kvp_attention_result result;
    memset(&result, 0x5A, sizeof result);
    kvp_attention_result untouched;
    memcpy(&untouched, &result, sizeof result);
    assert_int_equal(kvp_ticket_result(fx.ticket, &result, &err), KVP_TICKET_EMPTY);
    assert_int_equal(err.status, KVP_TICKET_EMPTY);
    kvpt_assert_error_text(&err, "attention ticket holds no prepared row");
    assert_memory_equal(&result, &untouched, sizeof result);
    expect_commit_failure(fx.ticket, fx.cache, fx.pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);

    /* Busy: a second prepare is refused; the first row, its pages and its result stay. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x0, fx.cache, fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvp_attention_result first = result_of(fx.ticket);
    double output[D];
    memcpy(output, first.output, sizeof output);
    assert_int_equal(first.reserved_pages, 1);
    expect_failure(fx.layer, &x1, fx.cache, fx.pool, fx.ticket, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    result = result_of(fx.ticket);
    assert_int_equal(result.reserved_pages, 1);
    assert_int_equal(result.committed, 0);
    assert_memory_equal(result.output, output, sizeof output);
    assert_int_equal(free_pages(fx.pool), 7);

    /* Commit, then commit again: empty. */
    kvpt_assert_ok(kvp_ticket_commit(fx.ticket, fx.cache, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), 7);
    expect_commit_failure(fx.ticket, fx.cache, fx.pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    assert_int_equal(kvp_cache_len(fx.cache), 1);
    assert_int_equal(result_of(fx.ticket).committed, 1); /* the result stays readable */

    /* Discard, then commit: empty, and the cache never saw the row. */
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x1, fx.cache, fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_ticket_discard(fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    expect_commit_failure(fx.ticket, fx.cache, fx.pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    assert_int_equal(kvp_cache_len(fx.cache), 1);
    assert_int_equal(kvp_ticket_result(fx.ticket, &result, &err), KVP_TICKET_EMPTY);

    /* A discarded page-holding prepare gives its page back. */
    forward_ok(fx.layer, &x1, fx.cache, fx.pool, fx.ticket);
    kvp_tensor x2 = kvp_tensor3(fx.x[2], 1, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(fx.layer, &x2, fx.cache, fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), 6);
    kvpt_assert_pool_ok(fx.pool);
    kvpt_assert_ok(kvp_ticket_discard(fx.ticket, &err), &err);
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(free_pages(fx.pool), 7);
    forward_ok(fx.layer, &x2, fx.cache, fx.pool, fx.ticket);
    result = result_of(fx.ticket);
    assert_seed_output(result.output, 2);

    /* NULL arguments are typed errors. */
    assert_int_equal(kvp_ticket_commit(NULL, fx.cache, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_commit(fx.ticket, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_ticket_discard(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_ticket_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_ticket_result(NULL, &result, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_result(fx.ticket, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvp_tensor no_data = kvp_tensor3(NULL, 1, 1, D);
    static const char *const args[] = {"layer", "input", "input", "cache", "ticket"};
    for (int forward = 0; forward < 2; forward++) {
        for (size_t i = 0; i < KVPT_COUNT_OF(args); i++) {
            const kvp_layer *l = i == 0 ? NULL : fx.layer;
            const kvp_tensor *in = i == 1 ? NULL : (i == 2 ? &no_data : &x0);
            kvp_cache *c = i == 3 ? NULL : fx.cache;
            kvp_ticket *t = i == 4 ? NULL : fx.ticket;
            kvp_status status = forward ? kvp_attention_forward(l, in, c, t, &err)
                                        : kvp_attention_prepare(l, in, c, t, &err);
            assert_int_equal(status, KVP_NULL_ARGUMENT);
            assert_string_equal(err.argument, args[i]);
        }
    }
    kvpt_assert_pool_ok(fx.pool);
    assert_int_equal(kvp_cache_len(fx.cache), 3);

    fixture_close(&fx);
}

static void test_attention_ticket_geometry_must_fit_the_cache(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 16, 1, CAPACITY);
    kvp_tensor x0 = kvp_tensor3(fx.x[0], 1, 1, D);
    kvp_error err;
    forward_ok(fx.layer, &x0, fx.cache, fx.pool, fx.ticket);
    kvp_tensor x1 = kvp_tensor3(fx.x[1], 1, 1, D);

    /* A smaller capacity. */
    kvp_cache *short_cache = cache_for(fx.pool, fx.layer, 1, 2);
    kvp_ticket *short_ticket = kvpt_ticket(short_cache);
    expect_failure(fx.layer, &x1, fx.cache, fx.pool, short_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 2 heads, head width 2 and capacity 2 does not "
                   "fit this KV cache",
                   &err);
    assert_int_equal(err.batch_size, 1);
    assert_int_equal(err.heads, 2);
    assert_int_equal(err.head_width, 2);
    assert_int_equal(err.capacity, 2);

    /* Another batch. */
    kvp_cache *pair_cache = cache_for(fx.pool, fx.layer, 2, CAPACITY);
    kvp_ticket *pair_ticket = kvpt_ticket(pair_cache);
    expect_failure(fx.layer, &x1, fx.cache, fx.pool, pair_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 2, 2 heads, head width 2 and capacity 4 does not "
                   "fit this KV cache",
                   &err);
    assert_int_equal(err.batch_size, 2);

    /* Other heads (same model width). */
    kvp_layer *one_head = kvpt_random_layer(D, 1, MAX_POSITIONS, ROPE_BASE, 38);
    kvp_pool *one_pool = kvpt_pool(BT, 1, D, 2);
    kvp_cache *one_cache = cache_for(one_pool, one_head, 1, CAPACITY);
    kvp_ticket *one_ticket = kvpt_ticket(one_cache);
    expect_failure(fx.layer, &x1, fx.cache, fx.pool, one_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 1 heads, head width 4 and capacity 4 does not "
                   "fit this KV cache",
                   &err);

    /* A larger capacity fits, and gives the same numbers as the cache's own. */
    kvp_cache *long_cache = cache_for(fx.pool, fx.layer, 1, MAX_POSITIONS);
    kvp_ticket *long_ticket = kvpt_ticket(long_cache);
    forward_ok(fx.layer, &x1, fx.cache, fx.pool, long_ticket);
    kvp_attention_result result = result_of(long_ticket);
    assert_seed_output(result.output, 1);
    /* The short ticket still works for its own cache. */
    forward_ok(fx.layer, &x0, short_cache, fx.pool, short_ticket);

    kvpt_destroy_ticket(long_ticket, fx.pool);
    kvpt_destroy_cache(long_cache, fx.pool);
    kvpt_destroy_ticket(one_ticket, one_pool);
    kvpt_destroy_cache(one_cache, one_pool);
    kvpt_destroy_pool(one_pool);
    kvpt_destroy_layer(one_head);
    kvpt_destroy_ticket(pair_ticket, fx.pool);
    kvpt_destroy_cache(pair_cache, fx.pool);
    kvpt_destroy_ticket(short_ticket, fx.pool);
    kvpt_destroy_cache(short_cache, fx.pool);
    fixture_close(&fx);
}

/* ---- reset and replay ----------------------------------------------------------------- */

/*
 * A random run, reset, and a replay of the same inputs: identical outputs and
 * weights, the same physical pages, and no heap allocation or free from the
 * reset to the end of the replay. Inputs are prepared beforehand and results
 * stored into preallocated buffers, so nothing between the counter reads
 * allocates but the library.
 */
static void test_attention_reset_and_replay_are_identical_and_allocation_free(void **state)
{
    (void)state;
    enum { B = 2, RH = 2, RHD = 4, RD = RH * RHD, RBT = 3, C = 10, BLOCKS = 4 };
    kvp_pool *pool = kvpt_pool(RBT, RH, RHD, B * BLOCKS + 1);
    kvp_layer *layer = kvpt_random_layer(RD, RH, C, ROPE_BASE, 4242);
    kvp_error err;
    kvp_cache *cache = cache_for(pool, layer, B, C);
    kvp_ticket *ticket = kvpt_ticket(cache);
    /* Another cache takes a page first, so this cache's pages are not 0, 1, 2, ... */
    kvp_cache *other = cache_for(pool, layer, 1, C);

    double inputs[C][B * RD];
    kvpt_fill_random(&inputs[0][0], C * B * RD, 99);
    kvp_tensor views[C];
    for (size_t t = 0; t < C; t++) {
        views[t] = kvp_tensor3(inputs[t], B, 1, RD);
    }
    kvp_tensor other_input = kvp_tensor3(inputs[0], 1, 1, RD);
    kvp_ticket *other_ticket = kvpt_ticket(other);
    forward_ok(layer, &other_input, other, pool, other_ticket);

    static double outputs[2][C][B * RD];
    static double weights[2][C][B * RH * C];
    uint32_t pages[2][B][BLOCKS];
    for (size_t t = 0; t < C; t++) {
        forward_ok(layer, &views[t], cache, pool, ticket);
        kvp_attention_result result = result_of(ticket);
        memcpy(outputs[0][t], result.output, sizeof outputs[0][t]);
        memcpy(weights[0][t], result.weights, B * RH * (t + 1) * sizeof(double));
    }
    read_pages(cache, B, BLOCKS, &pages[0][0][0]);
    size_t kv = B * RH * C * RHD;
    double *keys_before = kvpt_doubles(kv);
    double *keys_after = kvpt_doubles(kv);
    kvpt_assert_ok(kvp_cache_keys(cache, keys_before, kv, &err), &err);
    kvp_pool_stats stats_before = kvpt_stats(pool);
    kvp_cache_info info_before;
    kvp_cache_info_init(&info_before);
    kvpt_assert_ok(kvp_cache_info_get(cache, &info_before, &err), &err);

    kvp_status statuses[1 + 2 * C];
    kvp_attention_result results[C];
    kvpt_heap_window heap;
    kvpt_heap_window_open(&heap);
    statuses[0] = kvp_cache_reset(cache, &err);
    for (size_t t = 0; t < C; t++) {
        statuses[1 + 2 * t] = kvp_attention_forward(layer, &views[t], cache, ticket, &err);
        statuses[2 + 2 * t] = kvp_ticket_result(ticket, &results[t], &err);
        memcpy(outputs[1][t], results[t].output, sizeof outputs[1][t]);
        memcpy(weights[1][t], results[t].weights, B * RH * (t + 1) * sizeof(double));
    }
    kvpt_heap_window_close(&heap);

    for (size_t i = 0; i < KVPT_COUNT_OF(statuses); i++) {
        assert_int_equal(statuses[i], KVP_OK);
    }
    kvpt_assert_no_heap_traffic(&heap);
    kvpt_assert_pool_ok(pool);
    assert_memory_equal(outputs[0], outputs[1], sizeof outputs[0]);
    assert_memory_equal(weights[0], weights[1], sizeof weights[0]);
    read_pages(cache, B, BLOCKS, &pages[1][0][0]);
    assert_memory_equal(pages[0], pages[1], sizeof pages[0]);
    assert_true(pages[0][0][0] != 0); /* the other cache holds page 0 */
    kvpt_assert_ok(kvp_cache_keys(cache, keys_after, kv, &err), &err);
    assert_memory_equal(keys_before, keys_after, kv * sizeof(double));
    kvp_pool_stats stats_after = kvpt_stats(pool);
    assert_int_equal(stats_after.slab_address, stats_before.slab_address);
    assert_int_equal(stats_after.held_pages, stats_before.held_pages);
    assert_int_equal(stats_after.acquires, stats_before.acquires + B * BLOCKS);
    assert_int_equal(stats_after.releases, stats_before.releases + B * BLOCKS);
    kvp_cache_info info_after;
    kvp_cache_info_init(&info_after);
    kvpt_assert_ok(kvp_cache_info_get(cache, &info_after, &err), &err);
    assert_int_equal(info_after.tables_address, info_before.tables_address);
    assert_memory_equal(&info_after.binding, &info_before.binding, sizeof info_after.binding);

    free(keys_before);
    free(keys_after);
    kvpt_destroy_ticket(other_ticket, pool);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(other, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

/*
 * Prepare, commit, forward, discard, result and reset reach no allocation
 * site at all: an armed fault never fires.
 */
static void test_attention_steady_state_makes_no_allocation_call(void **state)
{
    (void)state;
    fixture fx;
    fixture_open(&fx, 4, 1, CAPACITY);
    kvp_error err;
    double huge[D] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, D);

    kvpi_fault_arm(1); /* would fail the very first allocation call */
    for (int cycle = 0; cycle < 2; cycle++) {
        for (size_t t = 0; t < CAPACITY; t++) {
            kvp_tensor input = kvp_tensor3(fx.x[t % STEPS], 1, 1, D);
            kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, fx.ticket, &err),
                           &err);
            kvpt_assert_pool_ok(fx.pool);
            kvpt_assert_ok(kvp_ticket_discard(fx.ticket, &err), &err);
            kvpt_assert_pool_ok(fx.pool);
            kvpt_assert_ok(kvp_attention_prepare(fx.layer, &input, fx.cache, fx.ticket, &err),
                           &err);
            kvpt_assert_pool_ok(fx.pool);
            kvp_attention_result result;
            kvpt_assert_ok(kvp_ticket_result(fx.ticket, &result, &err), &err);
            kvpt_assert_ok(kvp_ticket_commit(fx.ticket, fx.cache, &err), &err);
            kvpt_assert_pool_ok(fx.pool);
            assert_int_equal(kvp_attention_forward(fx.layer, &overflowing, fx.cache, fx.ticket,
                                                   &err),
                             t + 1 == CAPACITY ? KVP_FULL : KVP_NONFINITE_SCORE);
            kvpt_assert_pool_ok(fx.pool);
        }
        kvpt_assert_ok(kvp_cache_reset(fx.cache, &err), &err);
        kvpt_assert_pool_ok(fx.pool);
    }
    assert_int_equal(kvpi_fault_calls(), 0);
    assert_false(kvpi_fault_fired());
    kvpi_fault_arm(0);

    fixture_close(&fx);
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
        cmocka_unit_test(test_attention_rope_and_ticket_fit_each_part),
        cmocka_unit_test(test_attention_reference_nonfinite_errors_match_incremental),
        cmocka_unit_test(test_attention_fixture_matches_seed_trace),
        cmocka_unit_test(test_attention_prepare_changes_nothing_until_commit),
        cmocka_unit_test(test_attention_random_geometries_match_reference),
        cmocka_unit_test(test_attention_validation_errors_with_exact_details),
        cmocka_unit_test(test_attention_validation_order),
        cmocka_unit_test(test_attention_in_place_update_makes_cache_stale_for_good),
        cmocka_unit_test(test_attention_pool_exhausted_changes_nothing_but_the_counter),
        cmocka_unit_test(test_attention_nonfinite_projection_names_the_projection),
        cmocka_unit_test(test_attention_nonfinite_score_and_output),
        cmocka_unit_test(test_attention_rope_by_hand),
        cmocka_unit_test(test_attention_ticket_stale_after_commit_or_reset),
        cmocka_unit_test(test_attention_ticket_stale_through_every_door),
        cmocka_unit_test(test_attention_ticket_refuses_a_foreign_cache_and_keeps_its_row),
        cmocka_unit_test(test_attention_ticket_empty_and_busy),
        cmocka_unit_test(test_attention_ticket_geometry_must_fit_the_cache),
        cmocka_unit_test(test_attention_reset_and_replay_are_identical_and_allocation_free),
        cmocka_unit_test_teardown(test_attention_steady_state_makes_no_allocation_call,
                                  kvpt_disarm),
        cmocka_unit_test_teardown(test_attention_reference_errors_write_nothing, kvpt_disarm),
        cmocka_unit_test(test_attention_grouped_match_reference_across_blocks),
        cmocka_unit_test(test_attention_grouped_equals_mha_with_repeated_heads),
        cmocka_unit_test(test_attention_grouped_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
