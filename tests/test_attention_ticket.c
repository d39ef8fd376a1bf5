/*
 * test_attention_ticket.c: the ticket's life — stale after commit or reset
 * and through every other door, refusing a foreign cache while keeping its
 * row, empty and busy, geometry that must fit the cache, pages held until
 * discard; reset and replay onto the same physical pages with identical
 * results and no heap traffic, and a steady state that makes no allocation
 * call. Invariant checked throughout: a refused commit or prepare changes
 * nothing. Shares the seed's fixture with the other test_attention*.c
 * programs (attention_support.h). Unit test (ctest test_attention_ticket,
 * memcheck.test_attention_ticket in release): uses internal headers
 * (pager/alloc.h, pager/cache_internal.h).
 */
#include "attention_support.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_ticket_stale_after_commit_or_reset),
        cmocka_unit_test(test_attention_ticket_stale_through_every_door),
        cmocka_unit_test(test_attention_ticket_refuses_a_foreign_cache_and_keeps_its_row),
        cmocka_unit_test(test_attention_ticket_empty_and_busy),
        cmocka_unit_test(test_attention_ticket_geometry_must_fit_the_cache),
        cmocka_unit_test(test_attention_reset_and_replay_are_identical_and_allocation_free),
        cmocka_unit_test_teardown(test_attention_steady_state_makes_no_allocation_call,
                                  kvpt_disarm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
