/*
 * test_sequence_pages.c: a sequence's pages — reset and allocation-free
 * replay onto the same physical pages; promises consumed by steps and
 * returned; kvp_pool_admit at its boundaries; the page arithmetic of
 * kvp_sequence_pages_for; and the allocator-only append, all or nothing.
 * Invariant: every refusal leaves the sequence and the pool as they were.
 * Shares helpers with the other test_sequence*.c programs
 * (sequence_support.h). Unit test (ctest test_sequence_pages, and
 * memcheck.test_sequence_pages in release): uses pager/alloc.h and
 * serve/sequence_internal.h.
 */
#include "sequence_support.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_sequence_reset_replays_same_pages_without_allocation,
                                  kvpt_disarm),
        cmocka_unit_test(test_sequence_promise_consumed_by_steps_and_returned),
        cmocka_unit_test(test_sequence_pool_admit_boundaries),
        cmocka_unit_test(test_sequence_pages_for),
        cmocka_unit_test(test_sequence_append_uncomputed_all_or_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
