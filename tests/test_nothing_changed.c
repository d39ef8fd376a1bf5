/*
 * test_nothing_changed.c: every failing call of every public function changes
 * nothing (status.h's contract). This file holds the table of all of them
 * (below) and checks pool.h, cache.h (with the external binding's calls),
 * param.h, rope.h and layer.h; test_nothing_changed_attention.c checks
 * attention.h and model.h; test_nothing_changed_sequence.c checks
 * sequence.h, the prefill's documented exception and a scheduler step the
 * decoder refuses. The world, EXPECT_FAIL, EXPECT_NOOP, the allocation sweep
 * and the cached runs they share are in nothing_changed_support.h.
 *
 * Each test builds a small world — a pool with a sequence (2 layers, batch 2,
 * 3 tokens prefilled, 2 pages promised), a standalone cache bound to layer 0
 * with 4 tokens, a ticket holding a prepared row and its reserved page, and a
 * parameter — and registers all of it with a kvpt_snapshot (support.h): pool
 * stats (acquires, releases, high water, ...), the slab digest, the audit,
 * every cache's info and digest, the sequence's length, held and promised
 * pages, the parameter's id, revision and values, and the tickets' results.
 * EXPECT_FAIL snapshots, makes one failing call, checks its typed status (in
 * the return value and in *err) and then that the snapshot is unchanged;
 * only POOL_EXHAUSTED may add one to the exhaustions counter. Out-parameters
 * start as sentinels and must still hold them. Allocating functions are
 * swept: the Nth hooked allocation fails, for every N until the call
 * succeeds (pager/alloc.h), each failure checked the same way.
 *
 * The table: every function of the headers in include/kvpager/, and its failing calls in
 * the test_nothing_changed*.c programs.
 *
 *   status.h    kvp_status_name, kvp_status_message, kvp_error_format,
 *               kvp_mismatch_format                      infallible (pure)
 *   types.h     kvp_tensor3, kvp_tensor4                 infallible (pure)
 *   kvpager.h   kvp_version, kvp_version_number        infallible (pure)
 *   pool.h      kvp_pool_config_init                     infallible (NULL ignored)
 *               kvp_dtype_name, kvp_dtype_bytes          infallible (pure)
 *               kvp_pool_create INVALID_ARGUMENT (dtype): test_dtype.c
 *               kvp_pool_create      NULL x2, ZERO_SIZE x4, SIZE_OVERFLOW x2,
 *                                    BUDGET_TOO_SMALL, ALLOCATION_FAILED (sweep)
 *               kvp_pool_destroy     NULL, POOL_BUSY
 *               kvp_pool_stats_get   NULL x2
 *               kvp_pool_check       NULL, AUDIT_FAILED (planted mismatch)
 *               kvp_pool_admit       NULL x2
 *               kvp_pool_pages_for   infallible (saturates; test_pool.c)
 *               kvp_pool_digest      NULL x2
 *   cache.h     kvp_cache_create     NULL x3, INVALID_ARGUMENT x5 (two on kv_heads,
 *                                    one on an fp8 scale),
 *                                    ZERO_BATCH_SIZE, ZERO_CAPACITY,
 *                                    CAPACITY_EXCEEDS_POSITIONS, ELEMENT_COUNT_OVERFLOW,
 *                                    GEOMETRY_MISMATCH x2 (one on kv_heads),
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_cache_destroy, kvp_cache_reset        NULL
 *               kvp_cache_info_get, kvp_cache_digest      NULL x2
 *               kvp_cache_keys, kvp_cache_values          NULL x2, BUFFER_TOO_SMALL
 *               kvp_cache_page       NULL x2, OUT_OF_RANGE x2
 *               kvp_cache_len, _capacity, _is_empty, _is_full   infallible
 *               kvp_binding_init_external  NULL, ZERO_SIZE x3, INVALID_ARGUMENT
 *               kvp_cache_append_rows NULL x3, CACHE_LAYER_BOUND, ROWS_RESERVED, FULL,
 *                                    NONFINITE_KEY, NONFINITE_VALUE, POOL_EXHAUSTED
 *               kvp_cache_reserve_rows NULL, CACHE_LAYER_BOUND, ROWS_RESERVED, FULL,
 *                                    POOL_EXHAUSTED
 *               kvp_cache_commit_rows NULL x3, CACHE_LAYER_BOUND, ROWS_NOT_RESERVED x2,
 *                                    NONFINITE_KEY, NONFINITE_VALUE (reservation kept)
 *               kvp_cache_discard_rows NULL;  kvp_cache_promise  NULL,
 *                                    CACHE_LAYER_BOUND, OUT_OF_RANGE
 *               kvp_cache_block_table NULL x3, OUT_OF_RANGE
 *               kvp_binding_is_external, kvp_cache_reserved_rows, _promised_pages,
 *               _pages_for                               infallible
 *   (pool.h)    kvp_pool_page_data   NULL x3, OUT_OF_RANGE, PAGE_NOT_HELD
 *               kvp_pool_page_layout_get NULL x2
 *               (none of them allocates: no sweep)
 *   param.h     kvp_param_create     NULL x2, INVALID_ARGUMENT x2, ALLOCATION_FAILED
 *               kvp_param_create_matrix  NULL x2, INVALID_ARGUMENT x3, ALLOCATION_FAILED
 *               kvp_param_retain, kvp_param_release       NULL
 *               kvp_param_update, kvp_param_update_with   NULL x2
 *               kvp_param_id, _revision, _width, _values  infallible
 *   rope.h      kvp_rope_validate    NULL, ROPE_INVALID_WIDTH x2, ROPE_ZERO_POSITIONS,
 *                                    ROPE_INVALID_BASE x6 (0, -1, NaN, inf, 5e-324,
 *                                    1e-300 with many positions)
 *               kvp_rope_rotate      the same, NULL features, ROPE_POSITION_OUT_OF_RANGE
 *   layer.h     kvp_layer_create     NULL x5, PARAMETER_WIDTH_MISMATCH,
 *                                    HEADS_DO_NOT_DIVIDE_WIDTH x2, ROPE_* x3,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_random  NULL, INVALID_ARGUMENT x2, HEADS, ROPE,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS x2,
 *                                    PARAMETER_WIDTH_MISMATCH x2 (rows, K/V columns),
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_create_random_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_layer_destroy    NULL
 *               kvp_layer_info_get, kvp_layer_binding_get     NULL x2
 *               kvp_layer_set_kv_scales  NULL, INVALID_ARGUMENT x2 (k_scale, v_scale)
 *               kvp_layer_param, kvp_layer_param_mut   infallible (NULL out of range)
 *   attention.h kvp_ticket_create    NULL x2, INVALID_ARGUMENT (a record not
 *                                    attention's), ALLOCATION_FAILED (sweep)
 *               kvp_ticket_destroy, kvp_ticket_discard    NULL
 *               kvp_ticket_commit    NULL x2, TICKET_EMPTY, TICKET_FOREIGN_CACHE,
 *                                    TICKET_STALE
 *               kvp_ticket_result    NULL x2, TICKET_EMPTY
 *               kvp_attention_prepare, kvp_attention_forward   NULL x4, INPUT_RANK,
 *                                    SINGLE_TOKEN_REQUIRED, INPUT_BATCH_MISMATCH,
 *                                    INPUT_WIDTH_MISMATCH, CACHE_KV_HEAD_COUNT_MISMATCH,
 *                                    CACHE_LAYER_MISMATCH,
 *                                    CACHE_LAYER_REVISION_MISMATCH, CACHE_ROPE_MISMATCH,
 *                                    FULL, TICKET_BUSY, TICKET_GEOMETRY_MISMATCH,
 *                                    NONFINITE_PROJECTION, NONFINITE_SCORE,
 *                                    POOL_EXHAUSTED
 *               kvp_attention_reference  NULL x3, REFERENCE_INPUT_SHAPE,
 *                                    ROPE_POSITION_OUT_OF_RANGE, BUFFER_TOO_SMALL x2,
 *                                    NONFINITE_PROJECTION, NONFINITE_SCORE,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_attention_reference_stored  the same code; NULL, INVALID_ARGUMENT
 *                                    (dtype), NONFINITE_KEY/VALUE for a bf16 overflow:
 *                                    test_dtype.c (as are prepare's and the raw
 *                                    append's overflow refusals, each snapshot-checked)
 *   model.h     kvp_model_create     NULL x3, INVALID_ARGUMENT, MODEL_GEOMETRY_MISMATCH,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_create_random  NULL, INVALID_ARGUMENT x2, layer errors,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_create with KV heads differing: MODEL_GEOMETRY_MISMATCH
 *               kvp_model_create_random_grouped  KV_HEADS_DO_NOT_DIVIDE_HEADS,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_model_destroy    NULL, MODEL_BUSY;  kvp_model_info_get  NULL x2
 *               kvp_model_layer, kvp_model_param_mut   infallible (NULL out of range)
 *   sequence.h  kvp_sequence_create  NULL x3, ZERO_BATCH_SIZE, ZERO_CAPACITY,
 *                                    CAPACITY_EXCEEDS_POSITIONS, GEOMETRY_MISMATCH,
 *                                    ALLOCATION_FAILED (sweep)
 *               kvp_sequence_destroy, kvp_sequence_reset  NULL
 *               kvp_sequence_step    NULL x3, BUFFER_TOO_SMALL, INPUT_RANK,
 *                                    NONFINITE_PROJECTION, POOL_EXHAUSTED
 *               kvp_sequence_prefill NULL x2, INPUT_RANK, INPUT_BATCH_MISMATCH,
 *                                    INPUT_WIDTH_MISMATCH, INVALID_ARGUMENT, FULL,
 *                                    BUFFER_TOO_SMALL, NONFINITE_PROJECTION (NaN at
 *                                    token 2), CACHE_LAYER_REVISION_MISMATCH (stale
 *                                    binding), POOL_EXHAUSTED, NONFINITE_SCORE at
 *                                    token 2 (after two computed tokens; see below)
 *               kvp_sequence_promise NULL, OUT_OF_RANGE
 *               kvp_sequence_pages_for, _prefill_pages, _len, _capacity,
 *               _held_pages, _promised_pages, _cache      infallible
 *               kvp_decoder_create   NULL, INVALID_ARGUMENT, ALLOCATION_FAILED (sweep),
 *                                    THREAD_FAILED (test_sweep.c)
 *               kvp_decoder_destroy  NULL;  kvp_decoder_threads  infallible
 *               kvp_decoder_step     NULL x3, INVALID_ARGUMENT (shared sequence),
 *                                    DECODER_BUSY (test_decoder.c)
 *   tier.h      the tier's calls, attach, detach, stats, pack, verify and
 *               kvp_cache_group_tier_load: their refusals, allocation sweeps
 *               and tier failures are snapshot-checked in test_tier.c and
 *               test_tier_async.c (pool, cache, pool and host tier counters)
 *   windows     BLOCK_RELEASED of kvp_cache_truncate (state snapshot) and of
 *               kvp_cache_publish_block, POOL_EXHAUSTED of a windowed step at
 *               its page peak: test_window_pager.c; BLOCK_BINDING_MISMATCH
 *               of a group adopt with sliding caches: test_window_share.c
 *
 * Every check also compares the prefix cache (prefix_state: the index's
 * entries, the LRU order, cached, evictable, evictions), and every world
 * test runs twice: in the "cached" run (CACHED_TEST) the world's pool has no
 * free page and its LRU list holds cached pages, so any page a call takes
 * is borrowed from it and must come back with its key and LRU place.
 * test_nothing_changed_cancelled_takes_keep_cached_pages (in
 * test_nothing_changed_sequence.c) adds the takes that are cancelled by a
 * second call (reserve + discard, a two-layer step refused at its second
 * layer, a copy-on-write reservation, tickets).
 *
 * The documented exception (sequence.h, DESIGN.md "Sharing"): a prefill
 * that fails after writing rows (past its first block, or token by token)
 * leaves those bytes in pages it gave back (kvp_pool_digest hashes free
 * bytes too), and a page it borrowed from the LRU list and wrote loses its
 * cached block (evicted, counted). Those cases (test_nothing_changed_sequence.c)
 * assert exactly that.
 *
 * Unit test (ctest test_nothing_changed, memcheck.* in release, label threads
 * under tsan, like its two siblings): uses pager/alloc.h (fault injector) and
 * pager/pool_internal.h (to plant one audit mismatch).
 */
#include "nothing_changed_support.h"

/* ---- pool.h -------------------------------------------------------------------- */

static void count_mismatch(void *ctx, const kvp_mismatch *m)
{
    (void)m;
    (*(size_t *)ctx)++;
}

static kvp_status make_pool(world *w, void **out, kvp_error *err)
{
    (void)w;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = HEADS;
    config.head_width = HD;
    config.budget_bytes = 4 * 2 * HEADS * BT * HD * sizeof(double);
    config.dtype = KVP_F64;
    return kvp_pool_create(&config, (kvp_pool **)out, err);
}

static void destroy_pool(world *w, void *object)
{
    (void)w;
    kvpt_destroy_pool((kvp_pool *)object);
}

static void test_nothing_changed_pool_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_pool *out = SENTINEL;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_create(NULL, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_create(&config, NULL, &e));
    for (size_t field = 0; field < 4; field++) {
        kvp_pool_config zero = config;
        size_t *sizes[4] = {&zero.block_tokens, &zero.heads, &zero.head_width, &zero.budget_bytes};
        *sizes[field] = 0;
        EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_pool_create(&zero, &out, &e));
    }
    kvp_pool_config huge = config;
    huge.heads = SIZE_MAX / 2;
    EXPECT_FAIL(&w, KVP_SIZE_OVERFLOW, 0, kvp_pool_create(&huge, &out, &e));
    kvp_pool_config many;
    kvp_pool_config_init(&many);
    many.block_tokens = 1;
    many.heads = 1;
    many.head_width = 1;
    many.budget_bytes = (size_t)16 << 32;
    many.dtype = KVP_F64; /* 2^32 pages of 16 bytes */
    EXPECT_FAIL(&w, KVP_SIZE_OVERFLOW, 0, kvp_pool_create(&many, &out, &e));
    kvp_pool_config small = config;
    small.budget_bytes = 1;
    EXPECT_FAIL(&w, KVP_BUDGET_TOO_SMALL, 0, kvp_pool_create(&small, &out, &e));
    assert_ptr_equal(out, SENTINEL);
    sweep_call call = {make_pool, destroy_pool};
    assert_int_equal(sweep(&w, &call, 3), 3);

    EXPECT_NOOP(&w, kvp_pool_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_POOL_BUSY, 0, kvp_pool_destroy(w.pool, &e));

    kvp_pool_stats stats;
    memset(&stats, 0x5A, sizeof stats);
    stats.struct_size = sizeof stats;
    kvp_pool_stats sentinel_stats = stats;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_stats_get(NULL, &stats, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_stats_get(w.pool, NULL, &e));
    assert_memory_equal(&stats, &sentinel_stats, sizeof stats);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_check(NULL, NULL, NULL, &e));

    kvp_admission admission = (kvp_admission)77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_admit(NULL, 1, 0, &admission, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_admit(w.pool, 1, 0, NULL, &e));
    assert_int_equal(admission, 77);

    uint64_t digest = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_digest(NULL, &digest, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_digest(w.pool, NULL, &e));
    assert_int_equal(digest, 77);

    /* A failing audit changes nothing either: plant a high-water mismatch, audit twice. */
    kvp_pool_stats before = kvpt_stats(w.pool);
    uint64_t slab_before = w.snap.pool_digest;
    w.pool->high_water_pages = 0;
    for (int i = 0; i < 2; i++) {
        size_t found = 0;
        kvp_error e;
        assert_int_equal(kvp_pool_check(w.pool, count_mismatch, &found, &e), KVP_AUDIT_FAILED);
        assert_int_equal(found, 1);
        assert_int_equal(e.mismatches, 1);
        assert_int_equal(e.first_mismatch.invariant, KVP_INVARIANT_STATS);
        kvp_pool_stats now = kvpt_stats(w.pool);
        now.high_water_pages = before.high_water_pages;
        assert_memory_equal(&now, &before, sizeof now);
        uint64_t slab_now = 0;
        kvpt_assert_ok(kvp_pool_digest(w.pool, &slab_now, &e), &e);
        assert_int_equal(slab_now, slab_before);
        w.failures++;
    }
    w.pool->high_water_pages = before.high_water_pages;
    world_free(&w);
}

/* ---- cache.h ------------------------------------------------------------------- */

static kvp_status make_cache(world *w, void **out, kvp_error *err)
{
    kvp_binding binding;
    kvp_status status = kvp_layer_binding_get(w->layer, &binding, err);
    if (status == KVP_OK) {
        status = kvp_cache_create(w->pool, &binding, 3, 5, (kvp_cache **)out, err);
    }
    return status;
}

static void destroy_cache(world *w, void *object)
{
    kvpt_destroy_cache((kvp_cache *)object, w->pool);
}

static void test_nothing_changed_cache_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_binding good;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_binding_get(w.layer, &good, &err), &err);
    kvp_cache *out = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(NULL, &good, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(w.pool, NULL, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_create(w.pool, &good, 1, 1, NULL, &e));
    kvp_binding no_kind = good;
    no_kind.kind = 0; /* neither KVP_BINDING_LAYER nor KVP_BINDING_EXTERNAL */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &no_kind, 1, 1, &out, &e));
    kvp_binding reserved = good;
    reserved.reserved = 1;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &reserved, 1, 1, &out, &e));
    kvp_binding odd_kv = good;
    odd_kv.kv_heads = 0;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &odd_kv, 1, 1, &out, &e));
    kvp_binding no_width = good;
    no_width.head_width = 0;
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_cache_create(w.pool, &no_width, 1, 1, &out, &e));
    kvp_binding grouped = good;
    grouped.kv_heads = 1; /* valid, but the pool stores HEADS heads per page */
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_cache_create(w.pool, &grouped, 1, 1, &out, &e));
    kvp_binding bad_scale = good;
    bad_scale.v_scale = -1.0; /* fp8 scales: finite, normal and > 0 (or 0) */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_cache_create(w.pool, &bad_scale, 1, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_ZERO_BATCH_SIZE, 0, kvp_cache_create(w.pool, &good, 0, 1, &out, &e));
    EXPECT_FAIL(&w, KVP_ZERO_CAPACITY, 0, kvp_cache_create(w.pool, &good, 1, 0, &out, &e));
    EXPECT_FAIL(&w, KVP_CAPACITY_EXCEEDS_POSITIONS, 0,
                kvp_cache_create(w.pool, &good, 1, POSITIONS + 1, &out, &e));
    kvp_binding many_positions = good;
    many_positions.max_positions = SIZE_MAX;
    EXPECT_FAIL(&w, KVP_ELEMENT_COUNT_OVERFLOW, 0,
                kvp_cache_create(w.pool, &many_positions, SIZE_MAX / 2, 4, &out, &e));
    kvp_binding other = good;
    other.kv_heads = 1;
    other.head_width = D;
    EXPECT_FAIL(&w, KVP_GEOMETRY_MISMATCH, 0, kvp_cache_create(w.pool, &other, 1, 1, &out, &e));
    assert_ptr_equal(out, SENTINEL);
    sweep_call call = {make_cache, destroy_cache};
    assert_int_equal(sweep(&w, &call, 2), 2);

    EXPECT_NOOP(&w, kvp_cache_destroy(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_reset(NULL, &e));
    kvp_cache_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_cache_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_info_get(w.cache, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);

    enum { ROWS = CACHE_B * HEADS * CACHE_LEN * HD };
    double rows[ROWS];
    kvpt_fill(rows, ROWS, 7.0);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_keys(NULL, rows, ROWS, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_keys(w.cache, NULL, ROWS, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0, kvp_cache_keys(w.cache, rows, ROWS - 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_values(NULL, rows, ROWS, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_values(w.cache, NULL, ROWS, &e));
    EXPECT_FAIL(&w, KVP_BUFFER_TOO_SMALL, 0, kvp_cache_values(w.cache, rows, ROWS - 1, &e));
    kvpt_assert_filled(rows, ROWS, 7.0);

    uint32_t page = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_page(NULL, 0, 0, &page, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_page(w.cache, 0, 0, NULL, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_page(w.cache, CACHE_B, 0, &page, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_page(w.cache, 0, CACHE_LEN / BT, &page, &e));
    assert_int_equal(page, 77);
    uint64_t digest = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_digest(NULL, &digest, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_digest(w.cache, NULL, &e));
    assert_int_equal(digest, 77);
    world_free(&w);
}

/* ---- param.h, rope.h, layer.h ------------------------------------------------------ */

static kvp_status make_param(world *w, void **out, kvp_error *err)
{
    (void)w;
    double values[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    return kvp_param_create(3, values, (kvp_param **)out, err);
}

static void destroy_param(world *w, void *object)
{
    (void)w;
    kvp_error err;
    kvpt_assert_ok(kvp_param_release((kvp_param *)object, &err), &err);
}

static kvp_status make_layer(world *w, void **out, kvp_error *err)
{
    return kvp_layer_create(w->param, w->param, w->param, w->param, HEADS, POSITIONS, BASE,
                            (kvp_layer **)out, err);
}

static kvp_status make_random_layer(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_layer_create_random(D, HEADS, POSITIONS, BASE, 5, (kvp_layer **)out, err);
}

static kvp_status make_param_matrix(world *w, void **out, kvp_error *err)
{
    (void)w;
    double values[6] = {1, 2, 3, 4, 5, 6};
    return kvp_param_create_matrix(3, 2, values, (kvp_param **)out, err);
}

/*
 * External caches, block tables and page data (cache.h, pool.h): every
 * failing call of the raw-row API, on an external cache holding 3 rows with
 * a promise, and on the world's layer-bound cache; a pending reservation
 * stays pending through a failed commit.
 */
static void test_nothing_changed_external_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    kvp_error err;
    kvp_binding eb;
    kvpt_assert_ok(kvp_binding_init_external(&eb, HEADS, HD, 8, 1, 2, &err), &err);
    kvp_cache *ext = kvpt_cache(w.pool, &eb, 1, 8);
    double rows[4 * HEADS * 8 * HD];
    kvpt_fill_random(rows, sizeof rows / sizeof *rows, 3);
    kvpt_assert_ok(kvp_cache_append_rows(ext, rows, rows, 3, &err), &err);
    kvpt_assert_ok(kvp_cache_promise(ext, 1, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, ext);
    kvpt_snapshot_take(&w.snap);
    kvp_binding untouched;
    memset(&untouched, 0x5A, sizeof untouched);
    kvp_binding out = untouched;

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_binding_init_external(NULL, 1, 1, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 0, 1, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 1, 0, 1, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_ZERO_SIZE, 0, kvp_binding_init_external(&out, 1, 1, 0, 0, 0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_binding_init_external(&out, 2, SIZE_MAX, 1, 0, 0, &e));
    assert_memory_equal(&out, &untouched, sizeof out);

    /* append_rows, in its order. */
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(NULL, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_append_rows(w.cache, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(ext, NULL, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_append_rows(ext, rows, NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_cache_append_rows(ext, rows, rows, 6, &e));
    double bad[HEADS * 2 * HD];
    memcpy(bad, rows, sizeof bad);
    bad[HEADS * 2 * HD - 1] = NAN; /* the last element of 2 rows: no page is taken before */
    EXPECT_FAIL(&w, KVP_NONFINITE_KEY, 0, kvp_cache_append_rows(ext, bad, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_VALUE, 0, kvp_cache_append_rows(ext, rows, bad, 2, &e));
    /* 5 rows open block 2 (positions 4, 5, ...): more lanes than pages free. */
    kvp_cache *wide = NULL;
    kvpt_assert_ok(kvp_cache_create(w.pool, &eb, 64, 8, &wide, &err), &err);
    kvpt_snapshot_add_cache(&w.snap, wide);
    double *many = kvpt_doubles(64 * HEADS * 8 * HD);
    kvpt_fill_random(many, 64 * HEADS * 8 * HD, 4);
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1, kvp_cache_append_rows(wide, many, many, 1, &e));

    /* reserve, commit, discard, promise, block table, page data. */
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_reserve_rows(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_reserve_rows(w.cache, 1, &e));
    EXPECT_FAIL(&w, KVP_FULL, 0, kvp_cache_reserve_rows(ext, 6, &e));
    EXPECT_FAIL(&w, KVP_POOL_EXHAUSTED, 1, kvp_cache_reserve_rows(wide, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(NULL, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_commit_rows(w.cache, rows, rows, 0, &e));
    EXPECT_FAIL(&w, KVP_ROWS_NOT_RESERVED, 0, kvp_cache_commit_rows(ext, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_discard_rows(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_promise(NULL, 1, &e));
    EXPECT_FAIL(&w, KVP_CACHE_LAYER_BOUND, 0, kvp_cache_promise(w.cache, 1, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_promise(ext, 5, &e));
    const uint32_t *table = SENTINEL;
    size_t blocks = 77;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(NULL, 0, &table, &blocks, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(ext, 0, NULL, &blocks, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_block_table(ext, 0, &table, NULL, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0, kvp_cache_block_table(ext, 1, &table, &blocks, &e));
    assert_ptr_equal(table, SENTINEL);
    assert_int_equal(blocks, 77);
    const void *k = SENTINEL;
    const void *v = SENTINEL;
    kvp_page_layout layout;
    memset(&layout, 0x5A, sizeof layout);
    layout.struct_size = sizeof layout;
    kvp_page_layout layout_before = layout;
    kvp_pool_stats stats = kvpt_stats(w.pool);
    uint32_t free_page = 0;
    while (kvp_pool_page_data(w.pool, free_page, &k, &v, NULL, &err) == KVP_OK) {
        free_page++;
    }
    k = SENTINEL;
    v = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(NULL, 0, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, NULL, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, &k, NULL, &layout, &e));
    EXPECT_FAIL(&w, KVP_OUT_OF_RANGE, 0,
                kvp_pool_page_data(w.pool, (uint32_t)stats.total_pages, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_PAGE_NOT_HELD, 0,
                kvp_pool_page_data(w.pool, free_page, &k, &v, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_layout_get(NULL, &layout, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_pool_page_layout_get(w.pool, NULL, &e));
    kvp_page_layout unsized = layout;
    unsized.struct_size = 0; /* never initialized */
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_pool_page_data(w.pool, 0, &k, &v, &unsized, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_pool_page_layout_get(w.pool, &unsized, &e));
    assert_int_equal(unsized.struct_size, 0);
    unsized.struct_size = layout.struct_size;
    assert_memory_equal(&unsized, &layout_before, sizeof unsized);
    assert_ptr_equal(k, SENTINEL);
    assert_ptr_equal(v, SENTINEL);
    assert_memory_equal(&layout, &layout_before, sizeof layout);

    /* With a reservation pending: refusals keep it, exactly. */
    kvpt_assert_ok(kvp_cache_reserve_rows(ext, 3, &err), &err); /* positions 3..5: opens blocks 2 (4, 5) */
    kvpt_snapshot_take(&w.snap);
    assert_int_equal(w.snap.stats.tentative_pages, 1);
    EXPECT_FAIL(&w, KVP_ROWS_RESERVED, 0, kvp_cache_append_rows(ext, rows, rows, 1, &e));
    EXPECT_FAIL(&w, KVP_ROWS_RESERVED, 0, kvp_cache_reserve_rows(ext, 1, &e));
    EXPECT_FAIL(&w, KVP_ROWS_NOT_RESERVED, 0, kvp_cache_commit_rows(ext, rows, rows, 4, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(ext, NULL, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_cache_commit_rows(ext, rows, NULL, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_KEY, 0, kvp_cache_commit_rows(ext, bad, rows, 2, &e));
    EXPECT_FAIL(&w, KVP_NONFINITE_VALUE, 0, kvp_cache_commit_rows(ext, rows, bad, 2, &e));
    assert_int_equal(kvp_cache_reserved_rows(ext), 3);
    kvpt_assert_ok(kvp_cache_commit_rows(ext, rows, rows, 3, &err), &err);
    kvpt_assert_pool_ok(w.pool);

    free(many);
    kvpt_destroy_cache(wide, w.pool);
    kvpt_destroy_cache(ext, w.pool);
    world_free(&w);
}

/* A grouped layer over the world's square W_q, W_o and one D x d_h W_k, W_v (MQA). */
static kvp_status make_grouped_layer(world *w, void **out, kvp_error *err)
{
    return kvp_layer_create_grouped(w->param, w->narrow, w->narrow, w->param, HEADS, 1,
                                    POSITIONS, BASE, (kvp_layer **)out, err);
}

static kvp_status make_random_grouped_layer(world *w, void **out, kvp_error *err)
{
    (void)w;
    return kvp_layer_create_random_grouped(D, HEADS, 1, POSITIONS, BASE, 5, (kvp_layer **)out,
                                           err);
}

static void destroy_layer(world *w, void *object)
{
    (void)w;
    kvpt_destroy_layer((kvp_layer *)object);
}

static void test_nothing_changed_param_rope_layer_functions(void **state)
{
    (void)state;
    world w;
    world_make(&w);
    double values[D * D] = {0};
    kvp_param *param = SENTINEL;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create(D, NULL, &param, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create(D, values, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create(0, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_param_create((size_t)1 << 33, values, &param, &e));
    assert_ptr_equal(param, SENTINEL);
    sweep_call param_call = {make_param, destroy_param};
    assert_int_equal(sweep(&w, &param_call, 1), 1);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_retain(NULL, &e));
    EXPECT_NOOP(&w, kvp_param_release(NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update(NULL, values, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update(w.param, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update_with(NULL, bump, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_update_with(w.param, NULL, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create_matrix(3, 2, NULL, &param, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_param_create_matrix(3, 2, values, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create_matrix(0, 2, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_param_create_matrix(3, 0, values, &param, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_param_create_matrix((size_t)1 << 33, (size_t)1 << 33, values, &param, &e));
    assert_ptr_equal(param, SENTINEL);
    sweep_call matrix_call = {make_param_matrix, destroy_param};
    assert_int_equal(sweep(&w, &matrix_call, 1), 1);

    /* RoPE: validate and rotate refuse the same configurations; features stay. */
    const kvp_rope_config bad[] = {
        {3, 8, BASE},  {0, 8, BASE},     {4, 0, BASE},    {4, 8, 0.0},      {4, 8, -1.0},
        {4, 8, NAN},   {4, 8, INFINITY}, {64, 8, 5e-324}, {64, 1, 5e-324},  {64, SIZE_MAX, 1e-300},
    };
    const kvp_status why[] = {
        KVP_ROPE_INVALID_WIDTH, KVP_ROPE_INVALID_WIDTH, KVP_ROPE_ZERO_POSITIONS,
        KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,
        KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,  KVP_ROPE_INVALID_BASE,
        KVP_ROPE_INVALID_BASE,
    };
    double features[4] = {1.0, 2.0, 3.0, 4.0};
    const double original[4] = {1.0, 2.0, 3.0, 4.0};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_rope_validate(NULL, &e));
    for (size_t i = 0; i < KVPT_COUNT_OF(bad); i++) {
        EXPECT_FAIL(&w, why[i], 0, kvp_rope_validate(&bad[i], &e));
        EXPECT_FAIL(&w, why[i], 0, kvp_rope_rotate(&bad[i], features, 0, &e));
    }
    kvp_rope_config rope = {4, 8, BASE};
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_rope_rotate(&rope, NULL, 0, &e));
    EXPECT_FAIL(&w, KVP_ROPE_POSITION_OUT_OF_RANGE, 0, kvp_rope_rotate(&rope, features, 8, &e));
    assert_memory_equal(features, original, sizeof features);

    /* Layers: the parameters keep their identity and revision. */
    kvp_param *narrow = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_param_create(2, values, &narrow, &err), &err);
    kvp_layer *layer = SENTINEL;
    kvp_param *p = w.param;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_create(p, p, p, p, HEADS, 8, BASE, NULL, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(NULL, p, p, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, NULL, p, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, p, NULL, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create(p, p, p, NULL, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create(p, p, narrow, p, HEADS, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 0, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 3, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_WIDTH, 0,
                kvp_layer_create(p, p, p, p, 4, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_ZERO_POSITIONS, 0,
                kvp_layer_create(p, p, p, p, HEADS, 0, BASE, &layer, &e));
    /* 5e-324 is refused over 64 features (theta_31 overflows), not over 2. */
    double *zeros = kvpt_doubles(64 * 64);
    kvp_param *p64 = NULL;
    kvpt_assert_ok(kvp_param_create(64, zeros, &p64, &err), &err);
    free(zeros);
    kvpt_snapshot_add_param(&w.snap, p64);
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_layer_create(p64, p64, p64, p64, 1, 8, 5e-324, &layer, &e));
    kvpt_assert_ok(kvp_layer_create(p64, p64, p64, p64, 2, 8, 5e-324, &layer, &err), &err);
    kvpt_destroy_layer(layer);
    layer = SENTINEL;
    assert_ptr_equal(layer, SENTINEL);
    sweep_call layer_call = {make_layer, destroy_layer};
    assert_int_equal(sweep(&w, &layer_call, 1), 1);

    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0,
                kvp_layer_create_random(D, HEADS, 8, BASE, 1, NULL, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_layer_create_random(0, HEADS, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0,
                kvp_layer_create_random((size_t)1 << 31, HEADS, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_HEADS_DO_NOT_DIVIDE_WIDTH, 0,
                kvp_layer_create_random(D, 3, 8, BASE, 1, &layer, &e));
    EXPECT_FAIL(&w, KVP_ROPE_INVALID_BASE, 0,
                kvp_layer_create_random(64, 1, 8, 5e-324, 1, &layer, &e));
    assert_ptr_equal(layer, SENTINEL);
    sweep_call random_call = {make_random_layer, destroy_layer};
    /* The weights scratch, four parameters, the layer. */
    assert_int_equal(sweep(&w, &random_call, 6), 6);

    /* Grouped layers: KV heads must divide heads, W_k and W_v have kv_heads * d_h columns. */
    kvp_param *n = w.narrow;
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_grouped(p, n, n, p, HEADS, 0, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_grouped(p, n, n, p, HEADS, HEADS + 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create_grouped(p, n, narrow, p, HEADS, 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_PARAMETER_WIDTH_MISMATCH, 0,
                kvp_layer_create_grouped(p, p, p, p, HEADS, 1, 8, BASE, &layer, &e));
    EXPECT_FAIL(&w, KVP_KV_HEADS_DO_NOT_DIVIDE_HEADS, 0,
                kvp_layer_create_random_grouped(D, HEADS, 3, 8, BASE, 1, &layer, &e));
    assert_ptr_equal(layer, SENTINEL);
    sweep_call grouped_call = {make_grouped_layer, destroy_layer};
    assert_int_equal(sweep(&w, &grouped_call, 1), 1);
    sweep_call random_grouped_call = {make_random_grouped_layer, destroy_layer};
    assert_int_equal(sweep(&w, &random_grouped_call, 6), 6);

    EXPECT_NOOP(&w, kvp_layer_destroy(NULL, &e));
    kvp_layer_info info;
    memset(&info, 0x5A, sizeof info);
    info.struct_size = sizeof info;
    kvp_layer_info sentinel_info = info;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_info_get(NULL, &info, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_info_get(w.layer, NULL, &e));
    assert_memory_equal(&info, &sentinel_info, sizeof info);
    kvp_binding binding;
    memset(&binding, 0x5A, sizeof binding);
    kvp_binding sentinel_binding = binding;
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_binding_get(NULL, &binding, &e));
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_binding_get(w.layer, NULL, &e));
    assert_memory_equal(&binding, &sentinel_binding, sizeof binding);
    /* A refused kvp_layer_set_kv_scales leaves the layer's binding as it was. */
    kvp_layer *scaled = kvpt_random_layer(D, HEADS, POSITIONS, 10000.0, 5);
    kvp_binding unscaled;
    kvpt_assert_ok(kvp_layer_binding_get(scaled, &unscaled, &err), &err);
    EXPECT_FAIL(&w, KVP_NULL_ARGUMENT, 0, kvp_layer_set_kv_scales(NULL, 1.0, 1.0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_layer_set_kv_scales(scaled, NAN, 1.0, &e));
    EXPECT_FAIL(&w, KVP_INVALID_ARGUMENT, 0, kvp_layer_set_kv_scales(scaled, 2.0, 0.0, &e));
    kvpt_assert_ok(kvp_layer_binding_get(scaled, &binding, &err), &err);
    assert_memory_equal(&binding, &unscaled, sizeof binding);
    kvpt_destroy_layer(scaled);
    kvpt_assert_ok(kvp_param_release(narrow, &err), &err);
    kvpt_assert_ok(kvp_param_release(p64, &err), &err);
    world_free(&w);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_nothing_changed_pool_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_cache_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_external_functions, kvpt_disarm),
        cmocka_unit_test_teardown(test_nothing_changed_param_rope_layer_functions, kvpt_disarm),
        CACHED_TEST(test_nothing_changed_pool_functions),
        CACHED_TEST(test_nothing_changed_cache_functions),
        CACHED_TEST(test_nothing_changed_external_functions),
        CACHED_TEST(test_nothing_changed_param_rope_layer_functions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
