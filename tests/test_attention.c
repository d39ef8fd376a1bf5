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
 * same pages with no heap traffic; and the reference's own errors. Unit test:
 * uses internal headers (pager/alloc.h, pager/cache_internal.h).
 */
#include "support.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <valgrind/valgrind.h>

#include "pager/alloc.h"
#include "pager/cache_internal.h"

#define CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#define COUNT_OF(a) (sizeof(a) / sizeof((a)[0]))

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

#define assert_error_text(e, text) assert_error_text_at((e), (text), __FILE__, __LINE__)
static void assert_error_text_at(const kvp_error *e, const char *text, const char *file, int line)
{
    char buf[512];
    size_t n = kvp_error_format(e, buf, sizeof buf);
    if (strcmp(buf, text) != 0 || n != strlen(text)) {
        print_error("%s:%d: rendered \"%s\", expected \"%s\"\n", file, line, buf, text);
        fail();
    }
}

#define assert_close(actual, expected, tolerance) \
    assert_close_at((actual), (expected), (tolerance), __FILE__, __LINE__)
static void assert_close_at(double actual, double expected, double tolerance, const char *file,
                            int line)
{
    if (!(fabs(actual - expected) <= tolerance)) {
        print_error("%s:%d: %.17g differs from %.17g by more than %g\n", file, line, actual,
                    expected, tolerance);
        fail();
    }
}

static double max_abs_diff(const double *a, const double *b, size_t n)
{
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        double diff = fabs(a[i] - b[i]);
        worst = diff > worst || isnan(diff) ? diff : worst;
    }
    return worst;
}

/* Every test leaves the fault injector disarmed, even when an assertion fails. */
static int disarm(void **state)
{
    (void)state;
    kvpi_fault_arm(0);
    return 0;
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

/* A fixture-shaped layer over the given W_q, W_k, W_v, W_o matrices. */
static kvp_layer *layer_from_matrices(const double *const w[KVP_PARAM_COUNT], size_t heads,
                                      size_t max_positions, double base)
{
    kvp_param *params[KVP_PARAM_COUNT];
    kvp_error err;
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        kvpt_assert_ok(kvp_param_create(D, w[i], &params[i], &err), &err);
    }
    kvp_layer *layer = NULL;
    kvpt_assert_ok(kvp_layer_create(params[0], params[1], params[2], params[3], heads,
                                    max_positions, base, &layer, &err),
                   &err);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        kvpt_assert_ok(kvp_param_release(params[i], &err), &err);
    }
    return layer;
}

/* The seed's fixture layer, with fresh parameter nodes every call. */
static kvp_layer *fixture_layer(void)
{
    double identity[D * D];
    double swap[D * D];
    fixture_matrix(identity, 0);
    fixture_matrix(swap, 1);
    const double *const w[KVP_PARAM_COUNT] = {identity, identity, identity, swap};
    return layer_from_matrices(w, H, MAX_POSITIONS, ROPE_BASE);
}

/* The seed's from_parameters: a layer over `layer`'s own nodes. */
static kvp_layer *layer_sharing(const kvp_layer *layer, size_t max_positions, double base)
{
    kvp_layer *out = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param(layer, 0), kvp_layer_param(layer, 1),
                                    kvp_layer_param(layer, 2), kvp_layer_param(layer, 3), H,
                                    max_positions, base, &out, &err),
                   &err);
    return out;
}

static kvp_cache *cache_from_binding(kvp_pool *pool, const kvp_binding *binding, size_t batch,
                                     size_t capacity)
{
    kvp_cache *cache = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_create(pool, binding, batch, capacity, &cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    return cache;
}

static kvp_cache *cache_for(kvp_pool *pool, const kvp_layer *layer, size_t batch,
                            size_t capacity)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding(layer, &binding, &err), &err);
    return cache_from_binding(pool, &binding, batch, capacity);
}

static kvp_ticket *ticket_for(const kvp_cache *cache)
{
    kvp_ticket *ticket = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_create(cache, &ticket, &err), &err);
    return ticket;
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

static void destroy_cache(kvp_cache *cache, kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_ok(kvp_cache_destroy(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
}

/* Destroys a ticket, returning any pages it holds to `pool`. */
static void destroy_ticket(kvp_ticket *ticket, kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_ok(kvp_ticket_destroy(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
}

static void destroy_layer(kvp_layer *layer)
{
    kvp_error err;
    kvpt_assert_ok(kvp_layer_destroy(layer, &err), &err);
}

static void destroy_pool(kvp_pool *pool)
{
    kvp_error err;
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

static size_t free_pages(kvp_pool *pool)
{
    return kvpt_stats(pool).free_pages;
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
    kvpt_state after;
    kvpt_state_capture(cache, pool, &before);
    kvp_attention_result held;
    int was_prepared = kvp_ticket_result(ticket, &held, NULL) == KVP_OK && !held.committed;
    for (int forward = 0; forward < 2; forward++) {
        memset(err, 0x5A, sizeof *err);
        kvp_status got = forward ? kvp_attention_forward(layer, input, cache, ticket, err)
                                 : kvp_attention_prepare(layer, input, cache, ticket, err);
        assert_int_equal(got, status);
        assert_int_equal(err->status, status);
        assert_error_text(err, text);
        kvpt_assert_pool_ok(pool);
        kvpt_state_capture(cache, pool, &after);
        assert_int_equal(after.stats.exhaustions, before.stats.exhaustions + exhaustions);
        before.stats.exhaustions = after.stats.exhaustions;
        kvpt_assert_state_equal(&before, &after);
        kvpt_state_free(&after);
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
        kvpt_assert_pool_ok(pool);
        kvpt_state_capture(cache, pool, &after);
        kvpt_assert_state_equal(&before, &after);
        kvpt_state_free(&after);
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
    kvpt_state after;
    kvpt_state_capture(cache, pool, &before);
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_ticket_commit(ticket, cache, err), status);
    assert_int_equal(err->status, status);
    assert_error_text(err, text);
    kvpt_assert_pool_ok(pool);
    kvpt_state_capture(cache, pool, &after);
    kvpt_assert_state_equal(&before, &after);
    kvpt_state_free(&before);
    kvpt_state_free(&after);
}

/* ---- the seed's fixture ----------------------------------------------------- */

static void test_attention_fixture_matches_seed_trace(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 16);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;

    size_t full = 0;
    size_t incremental = 0;
    size_t reused = 0;
    for (size_t t = 0; t < STEPS; t++) {
        kvp_tensor input = kvp_tensor3(x[t], 1, 1, D);
        assert_int_equal(kvp_cache_len(cache), t);
        /* Success leaves the error detail alone. */
        memset(&err, 0x5A, sizeof err);
        kvp_error untouched;
        memcpy(&untouched, &err, sizeof err);
        kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_memory_equal(&err, &untouched, sizeof err);
        assert_int_equal(kvp_cache_len(cache), t + 1);

        kvp_attention_result result = result_of(ticket);
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

        for (size_t f = 0; f < D; f++) {
            assert_close(result.output[f], seed_outputs[t][f], 1e-9);
        }
        for (size_t h = 0; h < H; h++) {
            for (size_t k = 0; k <= t; k++) {
                assert_close(result.weights[h * result.keys + k], seed_weights[t][h][k], 1e-12);
            }
        }

        /* The full-prefix reference over positions 0..t agrees exactly. */
        double reference[STEPS * D];
        kvp_tensor prefix = kvp_tensor3(&x[0][0], 1, t + 1, D);
        kvpt_assert_ok(kvp_attention_reference(layer, &prefix, reference, STEPS * D, NULL, NULL,
                                               0, &err),
                       &err);
        double diff = max_abs_diff(result.output, reference + t * D, D);
        assert_true(diff <= 1e-12);
        assert_true(diff == 0.0);

        /* The logical snapshot [1, H, t + 1, d_h] holds the seed's rows. */
        double keys[H * STEPS * HD];
        double values[H * STEPS * HD];
        kvpt_assert_ok(kvp_cache_keys(cache, keys, COUNT_OF(keys), &err), &err);
        kvpt_assert_ok(kvp_cache_values(cache, values, COUNT_OF(values), &err), &err);
        for (size_t h = 0; h < H; h++) {
            for (size_t p = 0; p <= t; p++) {
                for (size_t f = 0; f < HD; f++) {
                    size_t at = (h * (t + 1) + p) * HD + f;
                    assert_close(keys[at], seed_keys[h][p][f], 1e-9);
                    assert_close(values[at], seed_values[h][p][f], 1e-9);
                    /* W_v = I: the values are the inputs' head slices, bit for bit. */
                    assert_memory_equal(&values[at], &x[p][h * HD + f], sizeof(double));
                }
            }
        }
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, CEIL_DIV(t + 1, BT));
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
    kvp_tensor all = kvp_tensor3(&x[0][0], 1, STEPS, D);
    kvpt_assert_ok(kvp_attention_reference(layer, &all, reference, COUNT_OF(reference), ref_keys,
                                           ref_values, COUNT_OF(ref_keys), &err),
                   &err);
    double keys[H * STEPS * HD];
    double values[H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_keys(cache, keys, COUNT_OF(keys), &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, values, COUNT_OF(values), &err), &err);
    assert_memory_equal(keys, ref_keys, sizeof keys);
    assert_memory_equal(values, ref_values, sizeof values);
    for (size_t t = 0; t < STEPS; t++) {
        for (size_t f = 0; f < D; f++) {
            assert_close(reference[t * D + f], seed_outputs[t][f], 1e-9);
        }
    }

    /* Three positions on two pages: lane 0 maps pages 0 and 1 of the fresh pool. */
    uint32_t page = 0;
    kvpt_assert_ok(kvp_cache_page(cache, 0, 0, &page, &err), &err);
    assert_int_equal(page, 0);
    kvpt_assert_ok(kvp_cache_page(cache, 0, 1, &page, &err), &err);
    assert_int_equal(page, 1);
    assert_int_equal(free_pages(pool), 14);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

/*
 * Prepare computes the result and reserves the new block's pages, but the
 * cache does not change until commit; mid-block a prepare reserves nothing.
 */
static void test_attention_prepare_changes_nothing_until_commit(void **state)
{
    (void)state;
    enum { B = 2 };
    kvp_pool *pool = kvpt_pool(BT, H, HD, 8);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, B, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    kvp_ticket *other = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;

    for (size_t t = 0; t < STEPS; t++) {
        /* Lane 0 runs the fixture; lane 1 the same rows scaled by 1/2. */
        double rows[B * D];
        for (size_t f = 0; f < D; f++) {
            rows[f] = x[t][f];
            rows[D + f] = 0.5 * x[t][f];
        }
        kvp_tensor input = kvp_tensor3(rows, B, 1, D);
        kvpt_state before;
        kvpt_state after;
        kvpt_state_capture(cache, pool, &before);
        kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_state_capture(cache, pool, &after);

        size_t reserved = t % BT == 0 ? B : 0;
        kvp_attention_result result = result_of(ticket);
        assert_int_equal(result.reserved_pages, reserved);
        assert_int_equal(result.committed, 0);
        assert_int_equal(result.keys, t + 1);
        assert_int_equal(result.batch_size, B);
        assert_int_equal(result.work.position, t);
        for (size_t f = 0; f < D; f++) {
            assert_close(result.output[f], seed_outputs[t][f], 1e-9);
        }
        /* Only the reservation shows: the pages are held, by the ticket. */
        assert_int_equal(after.stats.held_pages, before.stats.held_pages + reserved);
        assert_int_equal(after.stats.free_pages, before.stats.free_pages - reserved);
        assert_int_equal(after.stats.attached_reservations, reserved != 0);
        assert_int_equal(after.stats.acquires, before.stats.acquires + reserved);
        after.stats = before.stats;
        kvpt_assert_state_equal(&before, &after);
        kvpt_state_free(&after);

        /* Another ticket prepared on the same state computes the same row. */
        kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, other, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_attention_result second = result_of(other);
        assert_memory_equal(second.output, result.output, B * D * sizeof(double));
        assert_memory_equal(second.weights, result.weights, B * H * (t + 1) * sizeof(double));
        assert_int_equal(free_pages(pool), before.stats.free_pages - 2 * reserved);
        kvpt_assert_ok(kvp_ticket_discard(other, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(free_pages(pool), before.stats.free_pages - reserved);
        assert_int_equal(kvp_ticket_result(other, &second, &err), KVP_TICKET_EMPTY);
        assert_error_text(&err, "attention ticket holds no prepared row");

        kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(kvp_cache_len(cache), t + 1);
        kvp_attention_result committed = result_of(ticket);
        assert_int_equal(committed.committed, 1);
        assert_int_equal(committed.reserved_pages, 0);
        assert_ptr_equal(committed.output, result.output);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, B * CEIL_DIV(t + 1, BT));
        assert_int_equal(stats.attached_reservations, 0);
        kvpt_state_free(&before);
    }
    /* Lane 1's values are the lane-0 rows halved; its keys were rotated alike. */
    double values[B * H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_values(cache, values, COUNT_OF(values), &err), &err);
    for (size_t i = 0; i < H * STEPS * HD; i++) {
        assert_true(values[H * STEPS * HD + i] == 0.5 * values[i]);
    }
    /* Discard after commit is a no-op on the cache and the pool. */
    kvp_pool_stats before = kvpt_stats(pool);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(kvp_cache_len(cache), STEPS);

    /* Destroying a ticket that holds pages returns them. */
    double rows[B * D] = {0};
    kvp_tensor input = kvp_tensor3(rows, B, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, other, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(result_of(other).reserved_pages, 0); /* position 3 is mid-block */
    destroy_ticket(other, pool);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    other = ticket_for(cache);
    kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, other, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(result_of(other).reserved_pages, B);
    assert_int_equal(free_pages(pool), 8 - B);
    destroy_ticket(other, pool);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), 8);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    size_t total = b_count * CEIL_DIV(c, bt);
    kvp_error err;
    kvp_pool *pool = kvpt_pool(bt, heads, hd, total);
    kvp_layer *layer = NULL;
    double base = rc->seed % 2 ? ROPE_BASE : 500.0;
    kvpt_assert_ok(kvp_layer_create_random(d, heads, c + rc->seed % 3, base, rc->seed, &layer,
                                           &err),
                   &err);
    kvp_cache *cache = cache_for(pool, layer, b_count, c);
    kvp_ticket *ticket = ticket_for(cache);

    size_t rows = b_count * c * d;
    size_t kv = b_count * heads * c * hd;
    double *sequence = malloc(rows * sizeof(double)); /* [B, C, D] */
    double *steps = malloc(rows * sizeof(double));    /* [C][B * D] */
    double *ref_out = malloc(rows * sizeof(double));
    double *ref_keys = malloc(kv * sizeof(double));
    double *ref_values = malloc(kv * sizeof(double));
    double *keys = malloc(kv * sizeof(double));
    double *values = malloc(kv * sizeof(double));
    double *expected = malloc(b_count * d * sizeof(double));
    assert_true(sequence && steps && ref_out && ref_keys && ref_values && keys && values &&
                expected);
    uint64_t rng = rc->seed * 7919 + 1;
    for (size_t i = 0; i < rows; i++) {
        sequence[i] = kvpt_rand_unit(&rng);
    }
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
        double diff = max_abs_diff(result.output, expected, b_count * d);
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
            assert_close(sum, 1.0, 1e-12);
        }
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, b_count * CEIL_DIV(t + 1, bt));
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
        for (size_t block = 0; block < CEIL_DIV(c, bt); block++) {
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
    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
        for (size_t i = 0; i < COUNT_OF(head_widths); i++) {
            for (size_t j = 0; j < COUNT_OF(blocks); j++) {
                size_t k = i * COUNT_OF(blocks) + j;
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
    kvp_pool *pool = kvpt_pool(BT, H, HD, 32);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor single = kvp_tensor3(x[0], 1, 1, D);
    forward_ok(layer, &single, cache, pool, ticket);
    kvp_tensor next = kvp_tensor3(x[1], 1, 1, D);
    kvp_error err;

    /* InputRank. */
    kvp_tensor rank2 = {x[0], {2, {1, D}}};
    expect_failure(layer, &rank2, cache, pool, ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 2",
                   &err);
    assert_int_equal(err.rank, 2);
    kvp_tensor rank4 = kvp_tensor4(x[0], 1, 1, 1, D);
    expect_failure(layer, &rank4, cache, pool, ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 4",
                   &err);
    assert_int_equal(err.rank, 4);
    kvp_tensor rank0 = {x[0], {0, {0}}};
    expect_failure(layer, &rank0, cache, pool, ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 0",
                   &err);

    /* SingleTokenRequired. */
    kvp_tensor two = kvp_tensor3(&x[0][0], 1, 2, D);
    expect_failure(layer, &two, cache, pool, ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 2", &err);
    assert_int_equal(err.tokens, 2);
    kvp_tensor none = kvp_tensor3(x[0], 1, 0, D);
    expect_failure(layer, &none, cache, pool, ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 0", &err);
    assert_int_equal(err.tokens, 0);

    /* InputBatchMismatch. */
    kvp_tensor batch2 = kvp_tensor3(&x[0][0], 2, 1, D);
    expect_failure(layer, &batch2, cache, pool, ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 2 must match cache batch 1", &err);
    assert_int_equal(err.expected_size, 1);
    assert_int_equal(err.actual_size, 2);
    kvp_tensor batch0 = kvp_tensor3(x[0], 0, 1, D);
    expect_failure(layer, &batch0, cache, pool, ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 0 must match cache batch 1", &err);

    /* InputWidthMismatch. */
    kvp_tensor narrow = kvp_tensor3(x[0], 1, 1, 3);
    expect_failure(layer, &narrow, cache, pool, ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 3", &err);
    assert_int_equal(err.expected_size, 4);
    assert_int_equal(err.actual_size, 3);
    kvp_tensor wide = kvp_tensor3(&x[0][0], 1, 1, 8);
    expect_failure(layer, &wide, cache, pool, ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 8", &err);

    /* CacheModelWidthMismatch: a cache of the seed's "wider" layer (D = 8, 2 heads). */
    kvp_layer *wider = NULL;
    kvpt_assert_ok(kvp_layer_create_random(8, 2, MAX_POSITIONS, ROPE_BASE, 37, &wider, &err),
                   &err);
    kvp_pool *wide_pool = kvpt_pool(BT, 2, 4, 4);
    kvp_cache *wide_cache = cache_for(wide_pool, wider, 1, CAPACITY);
    kvp_ticket *wide_ticket = ticket_for(wide_cache);
    double eight[8] = {0.5, -0.5, 0.25, 1.0, -1.0, 0.0, 0.75, 0.125};
    kvp_tensor wide_row = kvp_tensor3(eight, 1, 1, 8);
    forward_ok(wider, &wide_row, wide_cache, wide_pool, wide_ticket);
    expect_failure(layer, &single, wide_cache, wide_pool, wide_ticket,
                   KVP_CACHE_MODEL_WIDTH_MISMATCH,
                   "KV cache model width 8 must match attention layer width 4", &err);
    assert_int_equal(err.layer_size, 4);
    assert_int_equal(err.cache_size, 8);

    /* CacheHeadCountMismatch: the seed's one-head layer (D = 4, d_h = 4). */
    kvp_layer *one_head = NULL;
    kvpt_assert_ok(kvp_layer_create_random(D, 1, MAX_POSITIONS, ROPE_BASE, 38, &one_head, &err),
                   &err);
    kvp_pool *one_pool = kvpt_pool(BT, 1, 4, 4);
    kvp_cache *one_cache = cache_for(one_pool, one_head, 1, CAPACITY);
    kvp_ticket *one_ticket = ticket_for(one_cache);
    forward_ok(one_head, &single, one_cache, one_pool, one_ticket);
    expect_failure(layer, &single, one_cache, one_pool, one_ticket,
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
    kvp_cache *odd_cache = cache_from_binding(odd_pool, &odd, 1, CAPACITY);
    kvp_ticket *odd_ticket = ticket_for(odd_cache);
    odd_cache->binding.model_width = D;
    expect_failure(layer, &single, odd_cache, odd_pool, odd_ticket,
                   KVP_CACHE_HEAD_WIDTH_MISMATCH,
                   "KV cache head width 3 must match attention layer head width 2", &err);
    assert_int_equal(err.layer_size, 2);
    assert_int_equal(err.cache_size, 3);

    /* CacheLayerMismatch: a rebuilt layer, same shapes and values, new nodes. */
    kvp_binding inconsistent = odd;
    inconsistent.model_width = D;
    kvp_cache *refused = (kvp_cache *)0x1;
    assert_int_equal(kvp_cache_create(odd_pool, &inconsistent, 1, CAPACITY, &refused, &err),
                     KVP_INVALID_ARGUMENT);
    assert_error_text(&err, "argument `binding` is invalid: model_width must equal heads * "
                            "head_width");
    assert_ptr_equal(refused, (kvp_cache *)0x1);
    kvpt_assert_pool_ok(odd_pool);

    kvp_layer *rebuilt = fixture_layer();
    expect_failure(rebuilt, &next, cache, pool, ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    /* ... and one new node among four shared ones is enough. */
    kvp_layer *partly = NULL;
    kvpt_assert_ok(kvp_layer_create(kvp_layer_param(layer, 0), kvp_layer_param(layer, 1),
                                    kvp_layer_param(layer, 2), kvp_layer_param(rebuilt, 3), H,
                                    MAX_POSITIONS, ROPE_BASE, &partly, &err),
                   &err);
    expect_failure(partly, &next, cache, pool, ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    destroy_layer(partly);

    /* CacheRopeMismatch: the same nodes under another base, or more positions. */
    kvp_layer *other_base = layer_sharing(layer, MAX_POSITIONS, 2.0 * ROPE_BASE);
    expect_failure(other_base, &next, cache, pool, ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 20000.0)",
                   &err);
    assert_int_equal(err.cache_rope.feature_width, 2);
    assert_int_equal(err.cache_rope.max_positions, 8);
    assert_true(err.cache_rope.base == ROPE_BASE);
    assert_int_equal(err.layer_rope.feature_width, 2);
    assert_int_equal(err.layer_rope.max_positions, 8);
    assert_true(err.layer_rope.base == 2.0 * ROPE_BASE);
    kvp_layer *more_positions = layer_sharing(layer, MAX_POSITIONS + 1, ROPE_BASE);
    expect_failure(more_positions, &next, cache, pool, ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 9 positions, base 10000.0)",
                   &err);
    assert_int_equal(err.layer_rope.max_positions, 9);
    kvp_layer *fractional = layer_sharing(layer, MAX_POSITIONS, 12345.678);
    expect_failure(fractional, &next, cache, pool, ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 12345.678)",
                   &err);
    /* The base compares by bits: the next double up is a different configuration. */
    kvp_layer *next_base = layer_sharing(layer, MAX_POSITIONS, nextafter(ROPE_BASE, INFINITY));
    expect_failure(next_base, &next, cache, pool, ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base "
                   "10000.000000000002)",
                   &err);

    /* Full: the seed's one-row cache. */
    kvp_cache *small = cache_for(pool, layer, 1, 1);
    kvp_ticket *small_ticket = ticket_for(small);
    forward_ok(layer, &single, small, pool, small_ticket);
    expect_failure(layer, &single, small, pool, small_ticket, KVP_FULL,
                   "KV cache is full at capacity 1", &err);
    assert_int_equal(err.capacity, 1);

    /* The cache that took all of this still works, with the fixture's numbers. */
    forward_ok(layer, &next, cache, pool, ticket);
    kvp_attention_result result = result_of(ticket);
    for (size_t f = 0; f < D; f++) {
        assert_close(result.output[f], seed_outputs[1][f], 1e-9);
    }

    destroy_ticket(small_ticket, pool);
    destroy_cache(small, pool);
    destroy_layer(next_base);
    destroy_layer(fractional);
    destroy_layer(more_positions);
    destroy_layer(other_base);
    destroy_layer(rebuilt);
    destroy_ticket(odd_ticket, odd_pool);
    destroy_cache(odd_cache, odd_pool);
    destroy_pool(odd_pool);
    destroy_ticket(one_ticket, one_pool);
    destroy_cache(one_cache, one_pool);
    destroy_pool(one_pool);
    destroy_layer(one_head);
    destroy_ticket(wide_ticket, wide_pool);
    destroy_cache(wide_cache, wide_pool);
    destroy_pool(wide_pool);
    destroy_layer(wider);
    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

/* When several checks fail, the one earliest in the seed's order is reported. */
static void test_attention_validation_order(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 32);
    kvp_layer *layer = fixture_layer();
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor single = kvp_tensor3(x[0], 1, 1, D);
    double huge[2 * D] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, D);
    kvp_error err;

    kvp_cache *full = cache_for(pool, layer, 1, 1);
    kvp_ticket *ticket = ticket_for(full);
    forward_ok(layer, &single, full, pool, ticket);

    /* Rank before capacity; tokens before batch; batch before width. */
    kvp_tensor rank2 = {x[0], {2, {1, D}}};
    expect_failure(layer, &rank2, full, pool, ticket, KVP_INPUT_RANK,
                   "incremental attention input must have rank three [batch, 1, model_width], "
                   "got rank 2",
                   &err);
    kvp_tensor two_by_two = kvp_tensor3(huge, 2, 2, 2);
    expect_failure(layer, &two_by_two, full, pool, ticket, KVP_SINGLE_TOKEN_REQUIRED,
                   "incremental attention needs exactly one new token, got 2", &err);
    kvp_tensor batch_and_width = kvp_tensor3(huge, 2, 1, 3);
    expect_failure(layer, &batch_and_width, full, pool, ticket, KVP_INPUT_BATCH_MISMATCH,
                   "incremental attention input batch 2 must match cache batch 1", &err);

    /* Input width before the cache's model width. */
    kvp_layer *wider = NULL;
    kvpt_assert_ok(kvp_layer_create_random(8, 1, MAX_POSITIONS, ROPE_BASE, 5, &wider, &err),
                   &err);
    kvp_pool *wide_pool = kvpt_pool(BT, 1, 8, 2);
    kvp_cache *wide_cache = cache_for(wide_pool, wider, 1, CAPACITY);
    kvp_tensor narrow = kvp_tensor3(x[0], 1, 1, 3);
    expect_failure(layer, &narrow, wide_cache, wide_pool, ticket, KVP_INPUT_WIDTH_MISMATCH,
                   "incremental attention input width must equal model width 4, got 3", &err);
    /* Model width before head count (D = 8 with 1 head differs in both). */
    expect_failure(layer, &single, wide_cache, wide_pool, ticket, KVP_CACHE_MODEL_WIDTH_MISMATCH,
                   "KV cache model width 8 must match attention layer width 4", &err);

    /* Head count before identities and revisions: the fixture's own nodes, with
     * a stale revision, in a one-head binding. */
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding(layer, &binding, &err), &err);
    kvp_binding one_head = binding;
    one_head.heads = 1;
    one_head.head_width = D;
    one_head.rope_feature_width = D;
    one_head.params[KVP_PARAM_VALUE].revision = 5;
    kvp_pool *one_pool = kvpt_pool(BT, 1, D, 2);
    kvp_cache *one_cache = cache_from_binding(one_pool, &one_head, 1, CAPACITY);
    expect_failure(layer, &single, one_cache, one_pool, ticket, KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 1 must match attention layer head count 2", &err);
    one_head.params[KVP_PARAM_OUTPUT].node_id = 1;
    kvp_cache *one_cache_other_ids = cache_from_binding(one_pool, &one_head, 1, CAPACITY);
    expect_failure(layer, &single, one_cache_other_ids, one_pool, ticket,
                   KVP_CACHE_HEAD_COUNT_MISMATCH,
                   "KV cache head count 1 must match attention layer head count 2", &err);

    /* Head width before identities (kvpt_binding's ids are not the layer's). */
    kvp_pool *odd_pool = kvpt_pool(BT, H, 3, 2);
    kvp_binding odd = kvpt_binding(H, 3, MAX_POSITIONS);
    kvp_cache *odd_cache = cache_from_binding(odd_pool, &odd, 1, CAPACITY);
    odd_cache->binding.model_width = D;
    expect_failure(layer, &single, odd_cache, odd_pool, ticket, KVP_CACHE_HEAD_WIDTH_MISMATCH,
                   "KV cache head width 3 must match attention layer head width 2", &err);

    /* All four identities before any revision: a stale revision at index 0 and a
     * foreign node at index 3 report the identity. */
    kvp_binding forged = binding;
    forged.params[KVP_PARAM_QUERY].revision = 7;
    forged.params[KVP_PARAM_OUTPUT].node_id = binding.params[KVP_PARAM_OUTPUT].node_id + 1000;
    kvp_cache *forged_cache = cache_from_binding(pool, &forged, 1, CAPACITY);
    expect_failure(layer, &single, forged_cache, pool, ticket, KVP_CACHE_LAYER_MISMATCH,
                   "KV cache parameter identity does not match this attention layer", &err);
    destroy_cache(forged_cache, pool);

    /* Revisions in stable order, before RoPE and capacity. */
    forged = binding;
    forged.params[KVP_PARAM_KEY].revision = 3;
    forged.params[KVP_PARAM_OUTPUT].revision = 9;
    double other_base = 20000.0;
    memcpy(&forged.rope_base_bits, &other_base, sizeof other_base);
    forged_cache = cache_from_binding(pool, &forged, 1, CAPACITY);
    expect_failure(layer, &single, forged_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 3 at stable index 1 does not match layer "
                   "revision 0",
                   &err);
    assert_int_equal(err.parameter, 1);
    assert_int_equal(err.cache_revision, 3);
    assert_int_equal(err.layer_revision, 0);
    destroy_cache(forged_cache, pool);

    /* RoPE before capacity: the full cache under another base. */
    kvp_layer *rope_layer = layer_sharing(layer, MAX_POSITIONS, other_base);
    expect_failure(rope_layer, &single, full, pool, ticket, KVP_CACHE_ROPE_MISMATCH,
                   "KV cache RoPE configuration (2 features, 8 positions, base 10000.0) does "
                   "not match layer configuration (2 features, 8 positions, base 20000.0)",
                   &err);

    /* Capacity before the ticket and before any computation. */
    kvp_cache *open = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *busy = ticket_for(open);
    kvpt_assert_ok(kvp_attention_prepare(layer, &single, open, busy, &err), &err);
    kvpt_assert_pool_ok(pool);
    expect_failure(layer, &single, full, pool, busy, KVP_FULL, "KV cache is full at capacity 1",
                   &err);
    expect_failure(layer, &overflowing, full, pool, ticket, KVP_FULL,
                   "KV cache is full at capacity 1", &err);

    /* A busy ticket before its geometry; geometry before any computation. */
    kvp_cache *batch2 = cache_for(pool, layer, 2, CAPACITY);
    kvp_tensor pair = kvp_tensor3(huge, 2, 1, D);
    expect_failure(layer, &pair, batch2, pool, busy, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    expect_failure(layer, &pair, batch2, pool, ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 2 heads, head width 2 and capacity 1 does "
                   "not fit this KV cache",
                   &err);
    kvpt_assert_ok(kvp_ticket_discard(busy, &err), &err);
    kvpt_assert_pool_ok(pool);

    /* Computation before the page reservation: on an exhausted pool a row that
     * would open a block fails on its score, and no exhaustion is counted. */
    kvp_pool *tight = kvpt_pool(BT, H, HD, 1);
    kvp_cache *tight_cache = cache_for(tight, layer, 1, CAPACITY);
    kvp_cache *hog = cache_for(tight, layer, 1, CAPACITY);
    kvp_ticket *hog_ticket = ticket_for(hog);
    forward_ok(layer, &single, hog, tight, hog_ticket);
    assert_int_equal(free_pages(tight), 0);
    expect_failure(layer, &overflowing, tight_cache, tight, busy, KVP_NONFINITE_SCORE,
                   "incremental softmax: attention score at flat index 0 must be finite, got inf",
                   &err);
    expect_failure_counting(layer, &single, tight_cache, tight, busy, KVP_POOL_EXHAUSTED,
                            "page pool exhausted: 1 pages needed, 0 free", 1, &err);

    destroy_ticket(hog_ticket, tight);
    destroy_cache(hog, tight);
    destroy_cache(tight_cache, tight);
    destroy_pool(tight);
    destroy_cache(batch2, pool);
    destroy_ticket(busy, pool);
    destroy_cache(open, pool);
    destroy_layer(rope_layer);
    destroy_cache(odd_cache, odd_pool);
    destroy_pool(odd_pool);
    destroy_cache(one_cache_other_ids, one_pool);
    destroy_cache(one_cache, one_pool);
    destroy_pool(one_pool);
    destroy_cache(wide_cache, wide_pool);
    destroy_pool(wide_pool);
    destroy_layer(wider);
    destroy_ticket(ticket, pool);
    destroy_cache(full, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    kvp_pool *pool = kvpt_pool(BT, H, HD, 16);
    kvp_layer *layer = fixture_layer();
    kvp_cache *old_cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(old_cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D);
    kvp_error err;
    forward_ok(layer, &x0, old_cache, pool, ticket);

    /* The same values written back: the revision still advances. */
    kvp_param *w_value = kvp_layer_param(layer, KVP_PARAM_VALUE);
    double same[D * D];
    memcpy(same, kvp_param_values(w_value), sizeof same);
    kvpt_assert_ok(kvp_param_update_with(w_value, copy_values, same, &err), &err);
    assert_int_equal(kvp_param_revision(w_value), 1);
    expect_failure(layer, &x1, old_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 2 does not match layer "
                   "revision 1",
                   &err);
    assert_int_equal(err.parameter, 2);
    assert_int_equal(err.cache_revision, 0);
    assert_int_equal(err.layer_revision, 1);

    /* Reset clears the rows but not the binding. */
    kvpt_assert_ok(kvp_cache_reset(old_cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    expect_failure(layer, &x0, old_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 2 does not match layer "
                   "revision 1",
                   &err);

    /* A new cache of the updated layer reproduces the first output exactly. */
    kvp_cache *new_cache = cache_for(pool, layer, 1, CAPACITY);
    forward_ok(layer, &x0, new_cache, pool, ticket);
    kvp_attention_result result = result_of(ticket);
    assert_memory_equal(result.output, seed_outputs[0], sizeof seed_outputs[0]);

    /* Two more updates: the lowest stale index is reported, with both revisions. */
    kvp_param *w_key = kvp_layer_param(layer, KVP_PARAM_KEY);
    kvp_param *w_output = kvp_layer_param(layer, KVP_PARAM_OUTPUT);
    memcpy(same, kvp_param_values(w_output), sizeof same);
    kvpt_assert_ok(kvp_param_update(w_output, same, &err), &err);
    kvpt_assert_ok(kvp_param_update(w_output, same, &err), &err);
    expect_failure(layer, &x1, new_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 3 does not match layer "
                   "revision 2",
                   &err);
    memcpy(same, kvp_param_values(w_key), sizeof same);
    kvpt_assert_ok(kvp_param_update(w_key, same, &err), &err);
    expect_failure(layer, &x1, new_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 1 does not match layer "
                   "revision 1",
                   &err);
    /* The old cache still reports its own first stale index. */
    expect_failure(layer, &x0, old_cache, pool, ticket, KVP_CACHE_LAYER_REVISION_MISMATCH,
                   "KV cache parameter revision 0 at stable index 1 does not match layer "
                   "revision 1",
                   &err);

    destroy_ticket(ticket, pool);
    destroy_cache(new_cache, pool);
    destroy_cache(old_cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

/* ---- pool exhaustion and non-finite values --------------------------------------- */

static void test_attention_pool_exhausted_changes_nothing_but_the_counter(void **state)
{
    (void)state;
    enum { B = 2 };
    /* Four pages: another cache takes one, this cache's first block two. */
    kvp_pool *pool = kvpt_pool(BT, H, HD, 4);
    kvp_layer *layer = fixture_layer();
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_cache *other = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *other_ticket = ticket_for(other);
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    forward_ok(layer, &x0, other, pool, other_ticket);
    kvp_cache *cache = cache_for(pool, layer, B, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double rows[STEPS][B * D];
    for (size_t t = 0; t < STEPS; t++) {
        memcpy(rows[t], x[t], sizeof x[t]);
        memcpy(rows[t] + D, x[t], sizeof x[t]);
    }
    kvp_tensor r0 = kvp_tensor3(rows[0], B, 1, D);
    kvp_tensor r1 = kvp_tensor3(rows[1], B, 1, D);
    kvp_tensor r2 = kvp_tensor3(rows[2], B, 1, D);
    forward_ok(layer, &r0, cache, pool, ticket);
    forward_ok(layer, &r1, cache, pool, ticket);
    assert_int_equal(free_pages(pool), 1);

    kvp_error err;
    uint64_t exhaustions = kvpt_stats(pool).exhaustions;
    expect_failure_counting(layer, &r2, cache, pool, ticket, KVP_POOL_EXHAUSTED,
                            "page pool exhausted: 2 pages needed, 1 free", 1, &err);
    assert_int_equal(err.needed, 2);
    assert_int_equal(err.available, 1);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.exhaustions, exhaustions + 2); /* prepare and forward */
    assert_int_equal(stats.attached_reservations, 0);
    kvp_attention_result result;
    assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);

    /* With the other cache gone, the same row goes through, with the seed's output
     * in both lanes. */
    destroy_ticket(other_ticket, pool);
    destroy_cache(other, pool);
    forward_ok(layer, &r2, cache, pool, ticket);
    result = result_of(ticket);
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t f = 0; f < D; f++) {
            assert_close(result.output[lane * D + f], seed_outputs[2][f], 1e-9);
        }
    }
    assert_int_equal(free_pages(pool), 0);
    assert_int_equal(kvpt_stats(pool).exhaustions, exhaustions + 2);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    return layer_from_matrices(w, H, MAX_POSITIONS, ROPE_BASE);
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
        kvp_ticket *ticket = ticket_for(cache);
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
        destroy_ticket(ticket, pool);
        destroy_cache(cache, pool);
        destroy_layer(layer);
    }

    /* -DBL_MAX gives -inf; in lane 1 the flat index counts lane 0's row. */
    kvp_layer *layer = layer_with_column(KVP_PARAM_VALUE, -DBL_MAX);
    kvp_cache *cache = cache_for(pool, layer, 2, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double rows[2 * D] = {0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0};
    kvp_tensor pair = kvp_tensor3(rows, 2, 1, D);
    expect_failure(layer, &pair, cache, pool, ticket, KVP_NONFINITE_PROJECTION,
                   "incremental Q/K/V projection: value at flat index 5 must be finite, got -inf",
                   &err);
    assert_int_equal(err.index, 5);
    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);

    /* NaN input: the query is checked first. */
    layer = fixture_layer();
    cache = cache_for(pool, layer, 1, CAPACITY);
    ticket = ticket_for(cache);
    double nan_row[D] = {NAN, 0.0, 0.0, 0.0};
    kvp_tensor nan_input = kvp_tensor3(nan_row, 1, 1, D);
    expect_failure(layer, &nan_input, cache, pool, ticket, KVP_NONFINITE_PROJECTION,
                   "incremental Q/K/V projection: query at flat index 0 must be finite, got NaN",
                   &err);
    assert_string_equal(err.what, "query");
    assert_true(isnan(err.value));
    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    kvp_ticket *ticket = ticket_for(cache);
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
    for (size_t f = 0; f < D; f++) {
        assert_close(result.output[f], seed_outputs[1][f], 1e-9);
    }
    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);

    /* Non-finite output: W_q = 0 keeps the scores at 0, W_o = 2 doubles 1e308. */
    double zero[D * D] = {0};
    double identity[D * D];
    double twos[D * D];
    fixture_matrix(identity, 0);
    for (size_t i = 0; i < D * D; i++) {
        twos[i] = 2.0;
    }
    const double *const w[KVP_PARAM_COUNT] = {zero, identity, identity, twos};
    kvp_layer *doubling = layer_from_matrices(w, H, MAX_POSITIONS, ROPE_BASE);
    cache = cache_for(pool, doubling, 1, CAPACITY);
    ticket = ticket_for(cache);
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
    kvpt_assert_ok(kvp_cache_values(cache, values, COUNT_OF(values), &err), &err);
    assert_true(values[0] == 0.5e308);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(doubling);
    destroy_layer(layer);
    destroy_pool(pool);
}

/* ---- the ticket's life -------------------------------------------------------------- */

static void test_attention_ticket_stale_after_commit_or_reset(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 8);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *first = ticket_for(cache);
    kvp_ticket *second = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D);
    kvp_tensor x2 = kvp_tensor3(x[2], 1, 1, D);
    kvp_error err;
    forward_ok(layer, &x0, cache, pool, second);

    /* Mid-block: the first ticket reserved nothing. */
    kvpt_assert_ok(kvp_attention_prepare(layer, &x1, cache, first, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(result_of(first).reserved_pages, 0);
    forward_ok(layer, &x1, cache, pool, second);
    expect_commit_failure(first, cache, pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 1 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    assert_int_equal(err.prepared_len, 1);
    assert_int_equal(err.current_len, 2);
    /* Refused, the ticket keeps its row: it is still busy, and still stale. */
    kvp_attention_result kept = result_of(first);
    assert_int_equal(kept.committed, 0);
    expect_failure(layer, &x2, cache, pool, first, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    expect_commit_failure(first, cache, pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 1 and the "
                          "cache has changed since (length 2 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(pool);

    /* At a block boundary both tickets reserve a page; the stale one keeps its page
     * until it is discarded, and the audit accounts for it. */
    size_t free_before = free_pages(pool);
    kvpt_assert_ok(kvp_attention_prepare(layer, &x2, cache, first, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(result_of(first).reserved_pages, 1);
    assert_int_equal(free_pages(pool), free_before - 1);
    forward_ok(layer, &x2, cache, pool, second);
    assert_int_equal(free_pages(pool), free_before - 2);
    expect_commit_failure(first, cache, pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 2 and the "
                          "cache has changed since (length 3 now)",
                          &err);
    assert_int_equal(result_of(first).reserved_pages, 1);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.held_pages, 2 + 1);
    assert_int_equal(stats.attached_reservations, 1);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), free_before - 1);
    assert_int_equal(kvpt_stats(pool).attached_reservations, 0);
    kvp_attention_result result;
    assert_int_equal(kvp_ticket_result(first, &result, &err), KVP_TICKET_EMPTY);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err); /* idempotent */
    kvpt_assert_pool_ok(pool);

    /* A reset makes a prepared ticket stale too, pages and all. */
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_attention_prepare(layer, &x0, cache, first, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(result_of(first).reserved_pages, 1);
    forward_ok(layer, &x0, cache, pool, second);
    forward_ok(layer, &x1, cache, pool, second);
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    expect_commit_failure(first, cache, pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 0 and the "
                          "cache has changed since (length 0 now)",
                          &err);
    assert_int_equal(err.prepared_len, 0);
    assert_int_equal(err.current_len, 0);
    assert_int_equal(free_pages(pool), 8 - 1);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), 8);

    /* Even a reset of an empty cache invalidates what was prepared on it. */
    kvpt_assert_ok(kvp_attention_prepare(layer, &x0, cache, first, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    expect_commit_failure(first, cache, pool, KVP_TICKET_STALE,
                          "attention ticket is stale: it was prepared at cache length 0 and the "
                          "cache has changed since (length 0 now)",
                          &err);
    kvpt_assert_ok(kvp_ticket_discard(first, &err), &err);
    kvpt_assert_pool_ok(pool);

    destroy_ticket(first, pool);
    destroy_ticket(second, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

static void test_attention_ticket_refuses_a_foreign_cache_and_keeps_its_row(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 8);
    kvp_layer *layer = fixture_layer();
    kvp_cache *a = cache_for(pool, layer, 1, CAPACITY);
    kvp_cache *b = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(a);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;
    for (size_t t = 0; t < STEPS; t++) {
        kvp_tensor input = kvp_tensor3(x[t], 1, 1, D);
        kvpt_assert_ok(kvp_attention_prepare(layer, &input, a, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
        size_t reserved = t % BT == 0 ? 1 : 0;
        assert_int_equal(result_of(ticket).reserved_pages, reserved);
        /* B has the same geometry and the same length, but is another cache. */
        assert_int_equal(kvp_cache_len(b), kvp_cache_len(a));
        expect_commit_failure(ticket, b, pool, KVP_TICKET_FOREIGN_CACHE,
                              "attention ticket was prepared for another KV cache", &err);
        assert_int_equal(result_of(ticket).reserved_pages, reserved);
        assert_int_equal(kvp_cache_len(a), t);
        /* ... and the row still commits to its own cache. */
        kvpt_assert_ok(kvp_ticket_commit(ticket, a, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_attention_result result = result_of(ticket);
        for (size_t f = 0; f < D; f++) {
            assert_close(result.output[f], seed_outputs[t][f], 1e-9);
        }
        /* Keep B level with A through its own ticket. */
        kvp_ticket *own = ticket_for(b);
        forward_ok(layer, &input, b, pool, own);
        destroy_ticket(own, pool);
        assert_int_equal(kvp_cache_len(a), t + 1);
    }
    /* A committed ticket is empty for every cache. */
    expect_commit_failure(ticket, a, pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    expect_commit_failure(ticket, b, pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    double ka[H * STEPS * HD];
    double kb[H * STEPS * HD];
    kvpt_assert_ok(kvp_cache_keys(a, ka, COUNT_OF(ka), &err), &err);
    kvpt_assert_ok(kvp_cache_keys(b, kb, COUNT_OF(kb), &err), &err);
    assert_memory_equal(ka, kb, sizeof ka);

    destroy_ticket(ticket, pool);
    destroy_cache(a, pool);
    destroy_cache(b, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

static void test_attention_ticket_empty_and_busy(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 8);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D);
    kvp_error err;

    /* A fresh ticket holds nothing. */
    kvp_attention_result result;
    memset(&result, 0x5A, sizeof result);
    kvp_attention_result untouched;
    memcpy(&untouched, &result, sizeof result);
    assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);
    assert_int_equal(err.status, KVP_TICKET_EMPTY);
    assert_error_text(&err, "attention ticket holds no prepared row");
    assert_memory_equal(&result, &untouched, sizeof result);
    expect_commit_failure(ticket, cache, pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);

    /* Busy: a second prepare is refused; the first row, its pages and its result stay. */
    kvpt_assert_ok(kvp_attention_prepare(layer, &x0, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_attention_result first = result_of(ticket);
    double output[D];
    memcpy(output, first.output, sizeof output);
    assert_int_equal(first.reserved_pages, 1);
    expect_failure(layer, &x1, cache, pool, ticket, KVP_TICKET_BUSY,
                   "attention ticket already holds a prepared row; commit or discard it first",
                   &err);
    result = result_of(ticket);
    assert_int_equal(result.reserved_pages, 1);
    assert_int_equal(result.committed, 0);
    assert_memory_equal(result.output, output, sizeof output);
    assert_int_equal(free_pages(pool), 7);

    /* Commit, then commit again: empty. */
    kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), 7);
    expect_commit_failure(ticket, cache, pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    assert_int_equal(kvp_cache_len(cache), 1);
    assert_int_equal(result_of(ticket).committed, 1); /* the result stays readable */

    /* Discard, then commit: empty, and the cache never saw the row. */
    kvpt_assert_ok(kvp_attention_prepare(layer, &x1, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    expect_commit_failure(ticket, cache, pool, KVP_TICKET_EMPTY,
                          "attention ticket holds no prepared row", &err);
    assert_int_equal(kvp_cache_len(cache), 1);
    assert_int_equal(kvp_ticket_result(ticket, &result, &err), KVP_TICKET_EMPTY);

    /* A discarded page-holding prepare gives its page back. */
    forward_ok(layer, &x1, cache, pool, ticket);
    kvp_tensor x2 = kvp_tensor3(x[2], 1, 1, D);
    kvpt_assert_ok(kvp_attention_prepare(layer, &x2, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), 6);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(free_pages(pool), 7);
    forward_ok(layer, &x2, cache, pool, ticket);
    result = result_of(ticket);
    for (size_t f = 0; f < D; f++) {
        assert_close(result.output[f], seed_outputs[2][f], 1e-9);
    }

    /* NULL arguments are typed errors. */
    assert_int_equal(kvp_ticket_commit(NULL, cache, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_commit(ticket, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_ticket_discard(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_destroy(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_result(NULL, &result, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "ticket");
    assert_int_equal(kvp_ticket_result(ticket, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvp_tensor no_data = kvp_tensor3(NULL, 1, 1, D);
    static const char *const args[] = {"layer", "input", "input", "cache", "ticket"};
    for (int forward = 0; forward < 2; forward++) {
        for (size_t i = 0; i < COUNT_OF(args); i++) {
            const kvp_layer *l = i == 0 ? NULL : layer;
            const kvp_tensor *in = i == 1 ? NULL : (i == 2 ? &no_data : &x0);
            kvp_cache *c = i == 3 ? NULL : cache;
            kvp_ticket *t = i == 4 ? NULL : ticket;
            kvp_status status = forward ? kvp_attention_forward(l, in, c, t, &err)
                                        : kvp_attention_prepare(l, in, c, t, &err);
            assert_int_equal(status, KVP_NULL_ARGUMENT);
            assert_string_equal(err.argument, args[i]);
        }
    }
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_len(cache), 3);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

static void test_attention_ticket_geometry_must_fit_the_cache(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 16);
    kvp_layer *layer = fixture_layer();
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_tensor x0 = kvp_tensor3(x[0], 1, 1, D);
    kvp_error err;
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *own = ticket_for(cache);
    forward_ok(layer, &x0, cache, pool, own);
    kvp_tensor x1 = kvp_tensor3(x[1], 1, 1, D);

    /* A smaller capacity. */
    kvp_cache *short_cache = cache_for(pool, layer, 1, 2);
    kvp_ticket *short_ticket = ticket_for(short_cache);
    expect_failure(layer, &x1, cache, pool, short_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 2 heads, head width 2 and capacity 2 does not "
                   "fit this KV cache",
                   &err);
    assert_int_equal(err.batch_size, 1);
    assert_int_equal(err.heads, 2);
    assert_int_equal(err.head_width, 2);
    assert_int_equal(err.capacity, 2);

    /* Another batch. */
    kvp_cache *pair_cache = cache_for(pool, layer, 2, CAPACITY);
    kvp_ticket *pair_ticket = ticket_for(pair_cache);
    expect_failure(layer, &x1, cache, pool, pair_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 2, 2 heads, head width 2 and capacity 4 does not "
                   "fit this KV cache",
                   &err);
    assert_int_equal(err.batch_size, 2);

    /* Other heads (same model width). */
    kvp_layer *one_head = NULL;
    kvpt_assert_ok(kvp_layer_create_random(D, 1, MAX_POSITIONS, ROPE_BASE, 38, &one_head, &err),
                   &err);
    kvp_pool *one_pool = kvpt_pool(BT, 1, D, 2);
    kvp_cache *one_cache = cache_for(one_pool, one_head, 1, CAPACITY);
    kvp_ticket *one_ticket = ticket_for(one_cache);
    expect_failure(layer, &x1, cache, pool, one_ticket, KVP_TICKET_GEOMETRY_MISMATCH,
                   "attention ticket for batch 1, 1 heads, head width 4 and capacity 4 does not "
                   "fit this KV cache",
                   &err);

    /* A larger capacity fits, and gives the same numbers as the cache's own. */
    kvp_cache *long_cache = cache_for(pool, layer, 1, MAX_POSITIONS);
    kvp_ticket *long_ticket = ticket_for(long_cache);
    forward_ok(layer, &x1, cache, pool, long_ticket);
    kvp_attention_result result = result_of(long_ticket);
    for (size_t f = 0; f < D; f++) {
        assert_close(result.output[f], seed_outputs[1][f], 1e-9);
    }
    /* The short ticket still works for its own cache. */
    forward_ok(layer, &x0, short_cache, pool, short_ticket);

    destroy_ticket(long_ticket, pool);
    destroy_cache(long_cache, pool);
    destroy_ticket(one_ticket, one_pool);
    destroy_cache(one_cache, one_pool);
    destroy_pool(one_pool);
    destroy_layer(one_head);
    destroy_ticket(pair_ticket, pool);
    destroy_cache(pair_cache, pool);
    destroy_ticket(short_ticket, pool);
    destroy_cache(short_cache, pool);
    destroy_ticket(own, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random(RD, RH, C, ROPE_BASE, 4242, &layer, &err), &err);
    kvp_cache *cache = cache_for(pool, layer, B, C);
    kvp_ticket *ticket = ticket_for(cache);
    /* Another cache takes a page first, so this cache's pages are not 0, 1, 2, ... */
    kvp_cache *other = cache_for(pool, layer, 1, C);

    double inputs[C][B * RD];
    uint64_t rng = 99;
    for (size_t t = 0; t < C; t++) {
        for (size_t i = 0; i < B * RD; i++) {
            inputs[t][i] = kvpt_rand_unit(&rng);
        }
    }
    kvp_tensor views[C];
    for (size_t t = 0; t < C; t++) {
        views[t] = kvp_tensor3(inputs[t], B, 1, RD);
    }
    kvp_tensor other_input = kvp_tensor3(inputs[0], 1, 1, RD);
    kvp_ticket *other_ticket = ticket_for(other);
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
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t block = 0; block < BLOCKS; block++) {
            kvpt_assert_ok(kvp_cache_page(cache, lane, block, &pages[0][lane][block], &err),
                           &err);
        }
    }
    size_t kv = B * RH * C * RHD;
    double *keys_before = calloc(kv, sizeof(double));
    double *keys_after = calloc(kv, sizeof(double));
    assert_true(keys_before != NULL && keys_after != NULL);
    kvpt_assert_ok(kvp_cache_keys(cache, keys_before, kv, &err), &err);
    kvp_pool_stats stats_before = kvpt_stats(pool);
    kvp_cache_info info_before;
    kvpt_assert_ok(kvp_cache_info_get(cache, &info_before, &err), &err);

    int counted = kvpt_malloc_is_counted();
#if !defined(__SANITIZE_ADDRESS__)
    /* Natively jemalloc serves malloc; only Valgrind replaces it here. */
    if (!RUNNING_ON_VALGRIND) {
        assert_true(counted);
    }
#endif
    kvp_status statuses[1 + 2 * C];
    kvp_attention_result results[C];
    (void)kvpt_thread_allocated();
    (void)kvpt_thread_deallocated();

    uint64_t allocated_before = kvpt_thread_allocated();
    uint64_t deallocated_before = kvpt_thread_deallocated();
    statuses[0] = kvp_cache_reset(cache, &err);
    for (size_t t = 0; t < C; t++) {
        statuses[1 + 2 * t] = kvp_attention_forward(layer, &views[t], cache, ticket, &err);
        statuses[2 + 2 * t] = kvp_ticket_result(ticket, &results[t], &err);
        memcpy(outputs[1][t], results[t].output, sizeof outputs[1][t]);
        memcpy(weights[1][t], results[t].weights, B * RH * (t + 1) * sizeof(double));
    }
    uint64_t allocated_after = kvpt_thread_allocated();
    uint64_t deallocated_after = kvpt_thread_deallocated();

    for (size_t i = 0; i < COUNT_OF(statuses); i++) {
        assert_int_equal(statuses[i], KVP_OK);
    }
    if (counted) {
        assert_int_equal(allocated_after - allocated_before, 0);
        assert_int_equal(deallocated_after - deallocated_before, 0);
        /* ... and the counters are live: an allocation does move them. */
        uint64_t probe_before = kvpt_thread_allocated();
        void *volatile probe = malloc(1024);
        uint64_t probe_after = kvpt_thread_allocated();
        free(probe);
        assert_true(probe_after - probe_before >= 1024);
    }
    kvpt_assert_pool_ok(pool);
    assert_memory_equal(outputs[0], outputs[1], sizeof outputs[0]);
    assert_memory_equal(weights[0], weights[1], sizeof weights[0]);
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t block = 0; block < BLOCKS; block++) {
            kvpt_assert_ok(kvp_cache_page(cache, lane, block, &pages[1][lane][block], &err),
                           &err);
        }
    }
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
    kvpt_assert_ok(kvp_cache_info_get(cache, &info_after, &err), &err);
    assert_int_equal(info_after.tables_address, info_before.tables_address);
    assert_memory_equal(&info_after.binding, &info_before.binding, sizeof info_after.binding);

    free(keys_before);
    free(keys_after);
    destroy_ticket(other_ticket, pool);
    destroy_ticket(ticket, pool);
    destroy_cache(other, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
}

/*
 * Prepare, commit, forward, discard, result and reset reach no allocation
 * site at all: an armed fault never fires.
 */
static void test_attention_steady_state_makes_no_allocation_call(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, H, HD, 4);
    kvp_layer *layer = fixture_layer();
    kvp_cache *cache = cache_for(pool, layer, 1, CAPACITY);
    kvp_ticket *ticket = ticket_for(cache);
    double x[STEPS][D];
    fixture_inputs(x);
    kvp_error err;
    double huge[D] = {DBL_MAX, DBL_MAX, DBL_MAX, DBL_MAX};
    kvp_tensor overflowing = kvp_tensor3(huge, 1, 1, D);

    kvpi_fault_arm(1); /* would fail the very first allocation call */
    for (int cycle = 0; cycle < 2; cycle++) {
        for (size_t t = 0; t < CAPACITY; t++) {
            kvp_tensor input = kvp_tensor3(x[t % STEPS], 1, 1, D);
            kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, ticket, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvpt_assert_ok(kvp_ticket_discard(ticket, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvpt_assert_ok(kvp_attention_prepare(layer, &input, cache, ticket, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvp_attention_result result;
            kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
            kvpt_assert_ok(kvp_ticket_commit(ticket, cache, &err), &err);
            kvpt_assert_pool_ok(pool);
            assert_int_equal(kvp_attention_forward(layer, &overflowing, cache, ticket, &err),
                             t + 1 == CAPACITY ? KVP_FULL : KVP_NONFINITE_SCORE);
            kvpt_assert_pool_ok(pool);
        }
        kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    assert_int_equal(kvpi_fault_calls(), 0);
    assert_false(kvpi_fault_fired());
    kvpi_fault_arm(0);

    destroy_ticket(ticket, pool);
    destroy_cache(cache, pool);
    destroy_layer(layer);
    destroy_pool(pool);
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
    for (size_t i = 0; i < COUNT_OF(shapes); i++) {
        kvp_tensor bad = {input, {shapes[i].rank, {shapes[i].dims[0], shapes[i].dims[1],
                                                   shapes[i].dims[2]}}};
        assert_int_equal(kvp_attention_reference(layer, &bad, out, COUNT_OF(out), NULL, NULL, 0,
                                                 &err),
                         KVP_REFERENCE_INPUT_SHAPE);
        assert_error_text(&err, shapes[i].text);
        assert_int_equal(err.model_width, D);
        assert_int_equal(err.actual.rank, shapes[i].rank);
    }

    /* More tokens than RoPE positions: the last position is out of range. */
    kvp_tensor too_long = kvp_tensor3(input, 1, 9, D);
    assert_int_equal(kvp_attention_reference(layer, &too_long, out, COUNT_OF(out), NULL, NULL, 0,
                                             &err),
                     KVP_ROPE_POSITION_OUT_OF_RANGE);
    assert_error_text(&err, "RoPE position 8 is out of range for 8 positions");
    assert_int_equal(err.position, 8);

    /* Buffers. */
    assert_int_equal(kvp_attention_reference(layer, &good, out, 11, NULL, NULL, 0, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_error_text(&err, "buffer `output` holds 11 values but 12 are needed");
    assert_int_equal(kvp_attention_reference(layer, &good, out, 12, keys, NULL, 10, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_error_text(&err, "buffer `keys` holds 10 values but 12 are needed");
    assert_int_equal(kvp_attention_reference(layer, &good, out, 12, NULL, keys, 0, &err),
                     KVP_BUFFER_TOO_SMALL);
    assert_error_text(&err, "buffer `values` holds 0 values but 12 are needed");

    /* An allocation failure, through the injector. */
    kvpi_fault_arm(1);
    kvp_status status = kvp_attention_reference(layer, &good, out, 12, NULL, NULL, 0, &err);
    int fired = kvpi_fault_fired();
    kvpi_fault_arm(0);
    assert_true(fired);
    assert_int_equal(status, KVP_ALLOCATION_FAILED);
    char text[128];
    snprintf(text, sizeof text, "cannot allocate full-prefix attention scratch (%zu bytes)",
             (3 * 12 + 3 + D) * sizeof(double));
    assert_error_text(&err, text);

    assert_memory_equal(out, sentinel, sizeof out);
    assert_memory_equal(keys, sentinel, sizeof keys);

    /* Exactly max_positions tokens are fine. */
    kvp_tensor eight = kvp_tensor3(input, 1, 8, D);
    kvpt_assert_ok(kvp_attention_reference(layer, &eight, out, 8 * D, NULL, NULL, 0, &err), &err);
    destroy_layer(layer);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_fixture_matches_seed_trace),
        cmocka_unit_test(test_attention_prepare_changes_nothing_until_commit),
        cmocka_unit_test(test_attention_random_geometries_match_reference),
        cmocka_unit_test(test_attention_validation_errors_with_exact_details),
        cmocka_unit_test(test_attention_validation_order),
        cmocka_unit_test(test_attention_in_place_update_makes_cache_stale_for_good),
        cmocka_unit_test(test_attention_pool_exhausted_changes_nothing_but_the_counter),
        cmocka_unit_test(test_attention_nonfinite_projection_names_the_projection),
        cmocka_unit_test(test_attention_nonfinite_score_and_output),
        cmocka_unit_test(test_attention_ticket_stale_after_commit_or_reset),
        cmocka_unit_test(test_attention_ticket_refuses_a_foreign_cache_and_keeps_its_row),
        cmocka_unit_test(test_attention_ticket_empty_and_busy),
        cmocka_unit_test(test_attention_ticket_geometry_must_fit_the_cache),
        cmocka_unit_test(test_attention_reset_and_replay_are_identical_and_allocation_free),
        cmocka_unit_test_teardown(test_attention_steady_state_makes_no_allocation_call, disarm),
        cmocka_unit_test_teardown(test_attention_reference_errors_write_nothing, disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
