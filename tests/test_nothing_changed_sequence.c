/*
 * test_nothing_changed_sequence.c: every failing call of sequence.h
 * (create, step, prefill, promise, the decoder) changes nothing (status.h's
 * contract), in the plain and the cached world; a failed prefill's counters
 * exactly; takes cancelled by a second call keeping cached pages; and the
 * documented exception (sequence.h, DESIGN.md "Sharing"): a prefill that
 * fails after writing rows leaves those bytes in pages it gave back and
 * loses only the cached blocks it wrote, its pages tentative until it
 * succeeds. Last, a scheduler step refused with DECODER_BUSY while another
 * thread holds the decoder (forced with a held callback, not timing).
 * The calls and their statuses are listed in the table of
 * test_nothing_changed.c; the world and its checks are in
 * nothing_changed_support.h. Unit test (ctest test_nothing_changed_sequence,
 * memcheck.* in release, label threads under tsan): uses pager/alloc.h and
 * pager/pool_internal.h.
 */
#include "nothing_changed_support.h"

/* ---- sequence.h ----------------------------------------------------------------------------- */

static kvp_status make_sequence(world *w, void **out, kvp_error *err)
{
    return kvp_sequence_create(w->model, w->pool, 2, 4, (kvp_sequence **)out, err);
}

static void destroy_sequence(world *w, void *object)
{
    kvpt_destroy_sequence((kvp_sequence *)object, w->pool);
}

static kvp_status make_decoder(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_decoder_create(3, (kvp_decoder **)out, err);
}

static void destroy_decoder(world *w, void *object)
{
    (void)w;
    kvp_error err;
    kvpt_assert_ok(kvp_decoder_destroy((kvp_decoder *)object, &err), &err);
}

static void test_nothing_changed_sequence_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_sequence *seq = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(NULL, w.pool, 1, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(w.model, NULL, 1, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_create(w.model, w.pool, 1, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_ZERO_BATCH_SIZE, 0, kvp_sequence_create(w.model, w.pool, 0, 1, &seq, &e));
    EXPECT_FAIL(&w, KVP_ZERO_CAPACITY, 0, kvp_sequence_create(w.model, w.pool, 1, 0, &seq, &e));
    EXPECT_FAIL(&w, KVP_CAPACITY_EXCEEDS_POSITIONS, 0,
                kvp_sequence_create(w.model, w.pool, 1, POSITIONS + 1, &seq, &e));
    kvp_model *wide = kvpt_random_model(1, 2 * D, HEADS, POSITIONS, BASE, 4);
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_sequence_create(wide, w.pool, 1, 1, &seq, &e));
    assert_ptr_equal(seq, SENTINEL);
    sweep_call sequence_call = {make_sequence, destroy_sequence};
    /* Probe cache (2), sequence, buffers, ticket (2), then cache (2) and ticket (2). */
    assert_int_equal(sweep(&w, &sequence_call, 10), 10);
    EXPECT_NOOP(&w, kvp_sequence_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_reset(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_promise(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_sequence_promise(w.seq, SIZE_MAX, &e));

    /* Steps. */
    double x[B * 4 * D];
    row_input(x, B, 4, 50);
    double out[B * 4 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    kvp_tensor one = kvp_tensor3(x, B, 1, D);
    kvp_tensor rank2 = one;
    rank2.shape.rank = 2;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(NULL, &one, NULL, NULL, out, 8, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(w.seq, NULL, NULL, NULL, out, 8, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_sequence_step(w.seq, &one, NULL, NULL, NULL, 8, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D - 1, &e));
    EXPECT_FAIL(&w, KVP_INPUT_RANK, 0,
                kvp_sequence_step(w.seq, &rank2, NULL, NULL, out, B * D, &e));
    double nan_x[B * D];
    memcpy(nan_x, x, sizeof nan_x);
    nan_x[D + 1] = NAN;
    kvp_tensor nan_one = kvp_tensor3(nan_x, B, 1, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_sequence_step(w.seq, &nan_one, NULL, NULL, out, B * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* Prefill: every refusal before the first token, and a NaN at token 2. */
    kvp_tensor prompt = kvp_tensor3(x, B, 4, D);
    kvp_tensor prompt_rank = prompt;
    prompt_rank.shape.rank = 4;
    kvp_tensor prompt_batch = kvp_tensor3(x, 1, 4, D);
    kvp_tensor prompt_width = kvp_tensor3(x, B, 2, D + 1);
    kvp_tensor empty = kvp_tensor3(x, B, 0, D);
    kvp_tensor too_long = kvp_tensor3(x, B, C - PREFILLED + 1, D);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_sequence_prefill(NULL, &prompt, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_sequence_prefill(w.seq, NULL, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_RANK, 0,
                kvp_sequence_prefill(w.seq, &prompt_rank, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_BATCH_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt_batch, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INPUT_WIDTH_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt_width, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_sequence_prefill(w.seq, &empty, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0,
                kvp_sequence_prefill(w.seq, &too_long, NULL, NULL, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 4 * D - 1, &e));
    double nan_prompt[B * 4 * D];
    memcpy(nan_prompt, x, sizeof nan_prompt);
    nan_prompt[(1 * 4 + 2) * D + 3] = NAN; /* lane 1, token 2 */
    kvp_tensor nan_view = kvp_tensor3(nan_prompt, B, 4, D);
    EXPECT_FAIL(&w, KVP_NONFINITE_PROJECTION, 0,
                kvp_sequence_prefill(w.seq, &nan_view, NULL, NULL, out, B * 4 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* A stale binding: layer 1's key updated in place; then restored by a second sequence. */
    kvp_param *key1 = kvp_model_param_mut(w.model, 1, KVP_PARAM_KEY);
    kvpt_assert_ok(kvp_param_update_with(key1, bump, NULL, &err), &err);
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 4 * D, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &e));
    /* Token 0's checks come first: the stale binding, not token 2's NaN, is reported. */
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_REVISION_MISMATCH, 0,
                kvp_sequence_prefill(w.seq, &nan_view, NULL, NULL, out, B * 4 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);

    /* Decoder. */
    kvp_decoder *decoder = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_create(1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_decoder_create(4097, &decoder, &e));
    assert_ptr_equal(decoder, SENTINEL);
    sweep_call decoder_call = {make_decoder, destroy_decoder};
    assert_int_equal(sweep(&w, &decoder_call, 2), 2);
    EXPECT_NOOP(&w, kvp_decoder_destroy(NULL, &e));
    kvpt_assert_ok(kvp_decoder_create(2, &decoder, &err), &err);
    kvp_decode_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    jobs[0].sequence = w.seq;
    jobs[0].input = one;
    jobs[0].output = out;
    jobs[0].output_len = B * D;
    jobs[0].status = (kvp_status)77;
    jobs[1] = jobs[0];
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(NULL, jobs, 1, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(decoder, NULL, 1, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &e));
    jobs[1].sequence = NULL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_decoder_step(decoder, jobs, 2, NULL, NULL, &e));
    assert_int_equal(jobs[0].status, 77); /* nothing ran */
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvpt_assert_ok(kvp_decoder_destroy(decoder, &err), &err);

    kvpt_destroy_model(wide);
    world_free(&w);
}

/*
 * The case and its neighbours on a pool close to full: POOL_EXHAUSTED
 * from a prefill and a step, and a prefill that fails at token 2 after
 * computing tokens 0 and 1 (a score that overflows): stats, promise, caches
 * and the audit are exactly as before; only free slab bytes differ.
 */
static void test_nothing_changed_failed_prefill_counters_exact(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    double x[B * 4 * D];
    row_input(x, B, 4, 60);
    kvp_tensor prompt = kvp_tensor3(x, B, 3, D); /* one new block: 4 pages of the 5 free */
    /* Token 2 of lane 0 is huge: projections stay finite, its scores overflow. */
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + 2 * D, huge, sizeof huge);
    kvpt_snapshot before = w.snap;
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(w.pool);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    assert_int_equal(err.layer, 0);
    /*
     * The failure is in the first block of tokens, which commits nothing:
     * no slab byte was written, and the pages borrowed from the LRU list (the
     * cached world) are back with their keys and places.
     */
    assert_prefix_unchanged(&prefix, w.pool);
    kvpt_snapshot now = before;
    kvpt_snapshot_take(&now);
    assert_int_equal(now.pool_digest, before.pool_digest);
    assert_memory_equal(&now.stats, &before.stats, sizeof now.stats);
    assert_memory_equal(now.seq_digest, before.seq_digest, sizeof now.seq_digest);
    assert_memory_equal(now.cache_digest, before.cache_digest, sizeof now.cache_digest);
    assert_int_equal(now.seq_len[0], PREFILLED);
    assert_int_equal(now.seq_promised[0], 2);
    assert_int_equal(now.stats.tentative_pages, 0);
    w.failures++;

    /* POOL_EXHAUSTED for a prefill and a step: only the exhaustions counter moves. */
    kvpt_assert_ok(kvp_ticket_discard(w.held, &err), &err);
    kvp_ticket *filler_ticket = NULL;
    kvp_cache *filler = fill_pool(&w, &filler_ticket);
    kvpt_snapshot_take(&w.snap);
    row_input(x, B, 4, 60);
    double out[B * 4 * D];
    kvpt_fill(out, KVPT_COUNT_OF(out), 7.0);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_sequence_prefill(w.seq, &prompt, NULL, NULL, out, B * 3 * D, &e));
    kvpt_assert_filled(out, KVPT_COUNT_OF(out), 7.0);
    kvp_tensor one = kvp_tensor3(x, B, 1, D);
    kvpt_assert_ok(kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &err), &err);
    kvpt_snapshot_take(&w.snap);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1,
                kvp_sequence_step(w.seq, &one, NULL, NULL, out, B * D, &e));
    kvpt_destroy_ticket(filler_ticket, w.pool);
    kvpt_destroy_cache(filler, w.pool);
    world_free(&w);
}

/*
 * Successful calls that together must leave everything as it was (a take
 * and its cancellation): the statements run between two snapshots.
 */
#define EXPECT_UNCHANGED_AFTER(w, exhaustions, ...)                                     \
    do {                                                                                \
        kvpt_snapshot before_ = (w)->snap;                                              \
        kvpt_snapshot_take(&before_);                                                   \
        prefix_state prefix_ = prefix_state_of((w)->pool);                              \
        __VA_ARGS__                                                                     \
        kvpt_assert_unchanged(&before_, (exhaustions));                                 \
        assert_prefix_unchanged(&prefix_, (w)->pool);                                   \
        (w)->failures++;                                                                \
    } while (0)

/* How many of the cached world's keys lookups find now (borrowed pages are hidden). */
static size_t keys_found(const world *w)
{
    size_t found = 0;
    kvpi_pool_lock(w->pool);
    for (size_t i = 0; i < w->lru_pages; i++) {
        found += kvpi_prefix_lookup_locked(w->pool, &w->lru_keys[i]) != KVPI_NO_PAGE;
    }
    kvpi_pool_unlock(w->pool);
    return found;
}

/*
 * Takes that are cancelled (issue 16): reserve then discard, a multi-layer
 * step whose second layer is refused POOL_EXHAUSTED after the first took its
 * pages (the scheduler's compute-off step), a copy-on-write reservation
 * discarded, and a ticket's page discarded after prepare or after a
 * TICKET_STALE commit. In the cached world every page they take is borrowed
 * from the LRU list: it must come back with its key, index slot and LRU
 * place, and evictions must not move.
 */
static void test_nothing_changed_cancelled_takes_keep_cached_pages(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    size_t available = kvpt_stats(w.pool).free_pages + kvpt_stats(w.pool).evictable_pages;
    assert_int_equal(available, 5);
    kvp_cache *a = kvpt_cache(w.pool, &w.ext, 2, POSITIONS);
    kvp_cache *b = kvpt_cache(w.pool, &w.ext, 2, POSITIONS);
    kvpt_snapshot_add_cache(&w.snap, a);
    kvpt_snapshot_add_cache(&w.snap, b);
    kvpt_snapshot_take(&w.snap);

    /* Reserve (two blocks, two lanes: 4 pages) then discard. */
    EXPECT_UNCHANGED_AFTER(&w, 0, {
        kvpt_assert_ok(kvp_cache_reserve_rows(a, BT + 1, &err), &err);
        kvpt_assert_pool_ok(w.pool);
        if (cached_world) {
            /* Borrowed: still indexed (cached), hidden from lookups, off the LRU list. */
            kvp_pool_stats mid = kvpt_stats(w.pool);
            assert_int_equal(mid.cached_pages, w.snap.stats.cached_pages);
            assert_int_equal(mid.evictable_pages, w.lru_pages - 4);
            assert_int_equal(mid.evictions, w.snap.stats.evictions);
            assert_int_equal(keys_found(&w), w.lru_pages - 4);
        }
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });
    if (cached_world) {
        assert_int_equal(keys_found(&w), w.lru_pages);
    }

    /* A step over two layers: layer 0 takes 4 pages, layer 1 is refused, layer 0 discards. */
    EXPECT_UNCHANGED_AFTER(&w, 1, {
        kvpt_assert_ok(kvp_cache_reserve_rows(a, BT + 1, &err), &err);
        kvp_error e;
        assert_int_equal(kvp_cache_reserve_rows(b, 1, &e), KVP_POOL_EXHAUSTED);
        assert_int_equal(e.needed, 2);
        assert_int_equal(e.available, 1);
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });

    /* Copy-on-write: a fork at a mid-block length; each side's reservation copies 2 pages. */
    double rows[2 * HEADS * HD];
    kvpt_fill_random(rows, KVPT_COUNT_OF(rows), 90);
    kvpt_assert_ok(kvp_cache_append_rows(a, rows, rows, 1, &err), &err);
    kvp_cache *child = NULL;
    kvpt_assert_ok(kvp_cache_fork(a, &child, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, child);
    kvpt_snapshot_take(&w.snap);
    assert_int_equal(kvp_cache_pages_for(child, 2), 2); /* the two copies, no new block */
    EXPECT_UNCHANGED_AFTER(&w, 0, {
        kvpt_assert_ok(kvp_cache_reserve_rows(child, 1, &err), &err);
        kvpt_assert_pool_ok(w.pool);
        kvpt_assert_ok(kvp_cache_discard_rows(child, &err), &err);
        kvpt_assert_ok(kvp_cache_reserve_rows(a, 1, &err), &err);
        kvpt_assert_ok(kvp_cache_discard_rows(a, &err), &err);
    });

    /*
     * Tickets: prepare takes the page of block 2 (counted in acquires, as
     * tickets' pages are); discard gives it back to its LRU place.
     */
    double x[CACHE_B * D];
    row_input(x, CACHE_B, 1, 91);
    kvp_tensor in = kvp_tensor3(x, CACHE_B, 1, D);
    kvp_ticket *fresh = kvpt_ticket(w.cache);
    prefix_state before_prepare = prefix_state_of(w.pool);
    size_t found = keys_found(&w);
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &in, w.cache, fresh, &err), &err);
    kvpt_assert_ok(kvp_ticket_discard(fresh, &err), &err);
    assert_prefix_unchanged(&before_prepare, w.pool);
    /* Prepared, made stale by the held ticket's commit, refused, then discarded. */
    kvpt_assert_ok(kvp_attention_prepare(w.layer, &in, w.cache, fresh, &err), &err);
    kvpt_assert_ok(kvp_ticket_commit(w.held, w.cache, &err), &err);
    kvpt_snapshot_add_ticket(&w.snap, fresh);
    kvpt_snapshot_take(&w.snap);
    prefix_state before_discard = prefix_state_of(w.pool);
    EXPECT_FAIL(&w, KVP_TICKET_STALE, 0, kvp_ticket_commit(fresh, w.cache, &e));
    kvpt_assert_ok(kvp_ticket_discard(fresh, &err), &err);
    kvpt_assert_pool_ok(w.pool);
    prefix_state after_discard = prefix_state_of(w.pool);
    assert_int_equal(after_discard.evictions, before_discard.evictions);
    assert_int_equal(after_discard.cached, before_discard.cached);
    assert_int_equal(after_discard.evictable, before_discard.evictable + cached_world);
    assert_int_equal(keys_found(&w), found);

    kvpt_destroy_ticket(fresh, w.pool);
    kvpt_destroy_cache(child, w.pool);
    kvpt_destroy_cache(b, w.pool);
    kvpt_destroy_cache(a, w.pool);
    world_free(&w);
}

static void residual_input(void *ctx, size_t layer, const double *input, const double *output,
                           size_t elements, double *next)
{
    (void)ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
}

/* A pool of `pages` pages whose free list is empty and whose LRU list holds them all, published. */
static kvp_pool *cached_pool(size_t block_tokens, size_t pages, kvp_block_key *keys)
{
    kvp_pool *pool = kvpt_pool(block_tokens, HEADS, HD, pages);
    kvp_binding eb;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, block_tokens, 3, 4, &err), &err);
    kvp_cache *publisher = kvpt_cache(pool, &eb, pages, block_tokens);
    size_t n = pages * HEADS * block_tokens * HD;
    double *rows = kvpt_doubles(n);
    kvpt_fill_random(rows, n, 92);
    kvpt_assert_ok(kvp_cache_append_rows(publisher, rows, rows, block_tokens, &err), &err);
    for (size_t lane = 0; lane < pages; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, publisher, &lane, sizeof lane, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_destroy_cache(publisher, pool);
    free(rows);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.free_pages, 0);
    assert_int_equal(s.evictable_pages, pages);
    return pool;
}

/*
 * A prefill of a forked sequence (copy-on-write) that fails at token 1, in
 * a pool whose free list is empty: its copies are borrowed from the LRU
 * list. In blocks (the residual stream) the failing block writes nothing:
 * everything is as before, slab bytes included. Token by token (a
 * next_input function), token 0 wrote its copies before token 1 failed:
 * those borrowed pages cannot hold their cached blocks again, so they are
 * evicted (counted) and go back free; nothing else changes (DESIGN.md,
 * Eviction: the one exception).
 */
static void test_nothing_changed_failed_prefill_of_a_fork_keeps_cached_pages(void **state)
{
    (void)state;
    enum { FBT = 4, SEQ_PAGES = L * B, LRU = 6 };
    kvp_block_key keys[SEQ_PAGES + LRU];
    kvp_pool *pool = kvpt_pool(FBT, HEADS, HD, SEQ_PAGES + LRU);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 11);
    kvp_sequence *parent = kvpt_sequence(model, pool, B, C);
    double x[B * 2 * D];
    row_input(x, B, 2, 93);
    kvp_tensor two = kvp_tensor3(x, B, 2, D);
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(parent, &two, NULL, NULL, NULL, 0, &err), &err);
    kvp_sequence *child = NULL;
    kvpt_assert_ok(kvp_sequence_fork(parent, &child, &err), &err);
    assert_int_equal(kvp_sequence_pages_for(child, 4), SEQ_PAGES); /* the copies */
    /* The rest of the pool: published and evictable. */
    kvp_binding eb;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, FBT, 3, 4, &err), &err);
    kvp_cache *publisher = kvpt_cache(pool, &eb, LRU, FBT);
    double rows[LRU * HEADS * FBT * HD];
    kvpt_fill_random(rows, KVPT_COUNT_OF(rows), 94);
    kvpt_assert_ok(kvp_cache_append_rows(publisher, rows, rows, FBT, &err), &err);
    for (size_t lane = 0; lane < LRU; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, publisher, &lane, sizeof lane, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(publisher, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_destroy_cache(publisher, pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 0);

    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, parent);
    kvpt_snapshot_add_sequence(&before, child);
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(pool);
    uint32_t order[LRU];
    assert_int_equal(kvpt_lru_order(pool, order), LRU);
    /* Token 1 of lane 0 is huge: its own score overflows. */
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + D, huge, sizeof huge);
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(child, &two, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 1);
    kvpt_assert_unchanged(&before, 0);
    assert_prefix_unchanged(&prefix, pool);

    /* Token by token: token 0's copies were written into the 4 oldest LRU pages. */
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_sequence_prefill(child, &two, residual_input, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 1);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats now = kvpt_stats(pool);
    kvp_pool_stats expected = before.stats;
    expected.evictions += SEQ_PAGES;
    expected.cached_pages -= SEQ_PAGES;
    expected.evictable_pages -= SEQ_PAGES;
    expected.free_pages += SEQ_PAGES;
    assert_memory_equal(&now, &expected, sizeof now);
    uint32_t after[LRU];
    assert_int_equal(kvpt_lru_order(pool, after), LRU - SEQ_PAGES);
    assert_memory_equal(after, order + SEQ_PAGES, (LRU - SEQ_PAGES) * sizeof *after);
    kvpi_pool_lock(pool);
    for (size_t i = 0; i < SEQ_PAGES; i++) {
        assert_int_equal(pool->registered[order[i]], 0);
    }
    kvpi_pool_unlock(pool);
    kvpt_snapshot unchanged = before;
    kvpt_snapshot_take(&unchanged);
    assert_memory_equal(unchanged.seq_digest, before.seq_digest, sizeof before.seq_digest);
    assert_memory_equal(unchanged.seq_len, before.seq_len, sizeof before.seq_len);

    kvpt_destroy_sequence(child, pool);
    kvpt_destroy_sequence(parent, pool);
    kvpt_destroy_model(model);
    destroy_cached_pool(pool);
}

/*
 * The exception, precisely: a prefill token by token, from an empty
 * sequence, in a pool whose 8 pages are all cached and evictable. It takes
 * the 4 oldest (blocks 0 and 1 of two layers), token 0 writes block 0 into
 * the 2 oldest, token 2 (opening block 1) fails. The 2 written pages lose
 * their keys (evictions + 2, now free); the 2 unwritten ones are back with
 * their keys at their LRU places. In blocks the same prompt writes nothing.
 */
static void test_nothing_changed_failed_prefill_loses_only_written_pages(void **state)
{
    (void)state;
    enum { PAGES8 = 8, T = 3 };
    kvp_block_key keys[PAGES8];
    kvp_pool *pool = cached_pool(BT, PAGES8, keys);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 11);
    kvp_sequence *seq = kvpt_sequence(model, pool, 1, C);
    double x[T * D];
    row_input(x, 1, T, 95);
    static const double huge[D] = {1e156, -1e156, 1e156, 1e156};
    memcpy(x + 2 * D, huge, sizeof huge);
    kvp_tensor prompt = kvp_tensor3(x, 1, T, D);
    uint32_t order[PAGES8];
    assert_int_equal(kvpt_lru_order(pool, order), PAGES8);
    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_add_sequence(&before, seq);
    kvpt_snapshot_take(&before);
    prefix_state prefix = prefix_state_of(pool);
    kvp_error err;
    assert_int_equal(kvp_sequence_prefill(seq, &prompt, NULL, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    kvpt_assert_unchanged(&before, 0);
    assert_prefix_unchanged(&prefix, pool);

    assert_int_equal(kvp_sequence_prefill(seq, &prompt, residual_input, NULL, NULL, 0, &err),
                     KVP_NONFINITE_SCORE);
    assert_int_equal(err.token, 2);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats now = kvpt_stats(pool);
    kvp_pool_stats expected = before.stats;
    expected.evictions += L;
    expected.cached_pages -= L;
    expected.evictable_pages -= L;
    expected.free_pages += L;
    assert_memory_equal(&now, &expected, sizeof now);
    uint32_t after[PAGES8];
    assert_int_equal(kvpt_lru_order(pool, after), PAGES8 - L);
    assert_memory_equal(after, order + L, (PAGES8 - L) * sizeof *after);
    size_t found = 0;
    kvpi_pool_lock(pool);
    for (size_t i = 0; i < PAGES8; i++) {
        uint32_t page = kvpi_prefix_lookup_locked(pool, &keys[i]);
        found += page != KVPI_NO_PAGE;
        assert_true(page == KVPI_NO_PAGE || (page != order[0] && page != order[1]));
    }
    assert_int_equal(pool->registered[order[0]], 0);
    assert_int_equal(pool->registered[order[1]], 0);
    kvpi_pool_unlock(pool);
    assert_int_equal(found, PAGES8 - L);
    assert_int_equal(kvp_sequence_len(seq), 0);

    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_model(model);
    destroy_cached_pool(pool);
}

/* Mid-prefill observations, made from the next-input callback between layers. */
typedef struct midway {
    kvp_pool *pool;
    size_t calls;
    kvp_pool_stats first;  /* token 0, after layer 0: no page taken yet */
    kvp_pool_stats second; /* token 1, after layer 0: every page taken, tentatively */
} midway;

static void observe(void *ctx, size_t layer, const double *input, const double *output,
                    size_t elements, double *next)
{
    midway *m = ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
    kvpt_assert_pool_ok(m->pool); /* the audit counts tentative pages */
    if (m->calls == 0) {
        m->first = kvpt_stats(m->pool);
    } else if (m->calls == L) {
        m->second = kvpt_stats(m->pool);
    }
    m->calls++;
}

/*
 * While a prefill runs, its pages are held and tentative: the audit passes,
 * held_pages includes them, acquires and the high-water mark do not; on
 * success both count them.
 */
static void test_nothing_changed_prefill_pages_are_tentative_until_success(void **state)
{
    (void)state;
    enum { T = 5 };
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 70);
    kvp_sequence *seq = kvpt_sequence(model, pool, B, C);
    double x[B * T * D];
    row_input(x, B, T, 71);
    kvp_tensor prompt = kvp_tensor3(x, B, T, D);
    kvp_pool_stats before = kvpt_stats(pool);
    midway m = {pool, 0, {0}, {0}};
    kvp_error err;
    kvpt_assert_ok(kvp_sequence_prefill(seq, &prompt, observe, &m, NULL, 0, &err), &err);
    size_t pages = L * B * KVPT_CEIL_DIV(T, BT);
    assert_int_equal(m.calls, T * L);
    /* Token 0 is prepared before any page is taken. */
    assert_memory_equal(&m.first, &before, sizeof before);
    /* From token 1 on, every page is taken, none counted yet. */
    assert_int_equal(m.second.tentative_pages, pages);
    assert_int_equal(m.second.held_pages, before.held_pages + pages);
    assert_int_equal(m.second.acquires, before.acquires);
    assert_int_equal(m.second.high_water_pages, before.high_water_pages);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.tentative_pages, 0);
    assert_int_equal(after.acquires, before.acquires + pages);
    assert_int_equal(after.held_pages, pages);
    assert_int_equal(after.high_water_pages, pages);
    kvpt_destroy_sequence(seq, pool);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(pool);
}

/* ---- a scheduler step the decoder refuses (DECODER_BUSY) --------------- */

/* Another caller's decoder step, held open in its next_input callback until released. */
typedef struct decoder_hold {
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int inside;  /* its step is running, blocked in the callback */
    int release;
    kvp_decoder *decoder;
    kvp_sequence *sequence; /* on a pool of its own */
    kvp_status status;
} decoder_hold;

static void hold_next_input(void *ctx, size_t layer, const double *input, const double *output,
                            size_t elements, double *next)
{
    decoder_hold *h = ctx;
    (void)layer;
    for (size_t i = 0; i < elements; i++) {
        next[i] = input[i] + output[i];
    }
    pthread_mutex_lock(&h->lock);
    h->inside = 1;
    pthread_cond_broadcast(&h->changed);
    while (!h->release) {
        pthread_cond_wait(&h->changed, &h->lock);
    }
    pthread_mutex_unlock(&h->lock);
}

static void *hold_decoder(void *arg)
{
    decoder_hold *h = arg;
    double x[D];
    double out[D];
    kvpt_fill_random(x, D, 90);
    kvp_decode_job job;
    memset(&job, 0, sizeof job);
    job.sequence = h->sequence;
    job.kind = KVP_JOB_STEP;
    job.input = kvp_tensor3(x, 1, 1, D);
    job.output = out;
    job.output_len = D;
    h->status = kvp_decoder_step(h->decoder, &job, 1, hold_next_input, h, NULL);
    return NULL;
}

/* Rows: the first 8 prompt positions are every request's (a shared prefix), the rest their own. */
static void busy_rows(void *ctx, uint64_t id, size_t sample, size_t position, double *row,
                      size_t width)
{
    (void)ctx;
    uint64_t own = position < 8 ? 0 : 1000 * (id + 1) + 100 * sample;
    kvpt_fill_random(row, width, 5000 + own + position);
}

/* Submits (9 prompt tokens, 1 decoded, `samples`) and returns its id. */
static uint64_t busy_submit(kvp_scheduler *scheduler, size_t samples)
{
    kvp_request request;
    kvp_request_init(&request);
    request.prompt_tokens = 9;
    request.max_new_tokens = 1;
    request.samples = samples;
    request.input = busy_rows;
    uint64_t id = UINT64_MAX;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_submit(scheduler, &request, &id, &err), &err);
    return id;
}

/*
 * A scheduler step refused DECODER_BUSY for its prefill batch changes
 * nothing: request 0 (9 tokens) ran and published its prompt's 4 blocks,
 * now evictable; request 1 (the same 8 first rows, 2 samples) would adopt
 * them and need a second lease. While another caller's decoder step is held
 * open (barriers, so under any scheduling), the step is refused with
 * DECODER_BUSY and the pool (every counter: prefix hits and misses,
 * acquires, attached caches; the digest; the audit) and the scheduler's
 * counters (held samples included) are as before. It used to adopt
 * (prefix_hits + 8, those pages acquired and released) and keep the new
 * lease (attached_caches + 2) before undoing the admission. Released, the
 * next step admits request 1, adopting 8 tokens.
 */
static void test_nothing_changed_scheduler_step_decoder_busy(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_pool *hold_pool = kvpt_pool(BT, HEADS, HD, PAGES);
    kvp_model *model = kvpt_random_model(L, D, HEADS, POSITIONS, BASE, 91);
    kvp_decoder *decoder = kvpt_decoder(1);
    kvp_scheduler_config config;
    kvp_scheduler_config_init(&config);
    config.capacity = 12;
    config.watermark = 0.0;
    config.reserve_tokens = 2;
    kvp_scheduler *scheduler = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_scheduler_create(model, pool, decoder, &config, &scheduler, &err), &err);
    busy_submit(scheduler, 1);
    kvp_step_stats st;
    kvp_step_stats_init(&st);
    kvpt_assert_ok(kvp_scheduler_step(scheduler, &st, &err), &err);
    assert_int_equal(st.finished, 1);
    assert_int_equal(kvpt_stats(pool).evictable_pages, L * 5); /* 9 tokens: 5 blocks */
    busy_submit(scheduler, 2);

    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, pool);
    kvpt_snapshot_take(&snap);
    kvp_scheduler_stats before;
    kvp_scheduler_stats_init(&before);
    kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &before, &err), &err);

    decoder_hold h;
    memset(&h, 0, sizeof h);
    pthread_mutex_init(&h.lock, NULL);
    pthread_cond_init(&h.changed, NULL);
    h.decoder = decoder;
    h.sequence = kvpt_sequence(model, hold_pool, 1, 4);
    h.status = KVP_STATUS_COUNT_;
    pthread_t holder;
    assert_int_equal(pthread_create(&holder, NULL, hold_decoder, &h), 0);
    pthread_mutex_lock(&h.lock);
    while (!h.inside) {
        pthread_cond_wait(&h.changed, &h.lock);
    }
    pthread_mutex_unlock(&h.lock);
    kvp_step_stats_init(&st);
    st.admitted = 77;
    memset(&err, 0, sizeof err);
    assert_int_equal(kvp_scheduler_step(scheduler, &st, &err), KVP_DECODER_BUSY);
    assert_int_equal(err.status, KVP_DECODER_BUSY);
    assert_int_equal(st.admitted, 77); /* stats untouched on failure */
    kvpt_assert_unchanged(&snap, 0);
    kvp_scheduler_stats now;
    kvp_scheduler_stats_init(&now);
    kvpt_assert_ok(kvp_scheduler_stats_get(scheduler, &now, &err), &err);
    assert_memory_equal(&now, &before, sizeof now);
    pthread_mutex_lock(&h.lock);
    h.release = 1;
    pthread_cond_broadcast(&h.changed);
    pthread_mutex_unlock(&h.lock);
    assert_int_equal(pthread_join(holder, NULL), 0);
    pthread_cond_destroy(&h.changed);
    pthread_mutex_destroy(&h.lock);
    kvpt_assert_ok(h.status, NULL);

    kvpt_assert_ok(kvp_scheduler_step(scheduler, &st, &err), &err);
    assert_int_equal(st.admitted, 1);
    assert_int_equal(st.prefix_hit_tokens, 8);
    assert_int_equal(st.finished, 1);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_scheduler_destroy(scheduler, &err), &err);
    kvpt_destroy_sequence(h.sequence, hold_pool);
    kvpt_destroy_decoder(decoder);
    kvpt_destroy_model(model);
    kvpt_destroy_pool(hold_pool);
    assert_int_equal(kvpt_stats(pool).held_pages, 0); /* the prefixes stay evictable */
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_nothing_changed_sequence_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_failed_prefill_counters_exact, kvpt_disarm),
        cmocka_unit_test(test_nothing_changed_prefill_pages_are_tentative_until_success),
        cmocka_unit_test_teardown(test_nothing_changed_cancelled_takes_keep_cached_pages,
                                  kvpt_disarm),
        cmocka_unit_test(test_nothing_changed_failed_prefill_of_a_fork_keeps_cached_pages),
        cmocka_unit_test(test_nothing_changed_failed_prefill_loses_only_written_pages),
        CACHED_TEST(test_nothing_changed_sequence_functions),
        CACHED_TEST(test_nothing_changed_failed_prefill_counters_exact),
        CACHED_TEST(test_nothing_changed_cancelled_takes_keep_cached_pages),
        cmocka_unit_test(test_nothing_changed_scheduler_step_decoder_busy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
