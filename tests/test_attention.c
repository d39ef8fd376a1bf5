/*
 * test_attention.c: incremental attention through the paged cache — the
 * seed's fixture (outputs, attention weights, logical rotated keys and
 * unrotated values, work counts, zero difference from the full-prefix
 * reference); prepare changing nothing until commit, and the pages a prepare
 * reserves; randomized geometries (batch, heads, head width, block size,
 * capacity) checked step by step against the full-prefix reference.
 * The family's other programs: test_attention_errors.c (validation, stale
 * caches, exhaustion, non-finite values), test_attention_ticket.c (the
 * ticket's life, reset and replay), test_attention_reference.c (RoPE by hand,
 * the reference's own errors) and test_attention_grouped.c (grouped-query
 * heads); their shared fixture is attention_support.h. Unit test (ctest
 * test_attention, and memcheck.test_attention in release): uses internal
 * headers (pager/alloc.h, pager/cache_internal.h).
 */
#include "attention_support.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_fixture_matches_seed_trace),
        cmocka_unit_test(test_attention_prepare_changes_nothing_until_commit),
        cmocka_unit_test(test_attention_random_geometries_match_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
