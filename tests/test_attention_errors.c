/*
 * test_attention_errors.c: attention's refusals — every validation failure
 * in the seed's order with exact details and texts, each leaving the cache's
 * rows, page tables and pool byte-identical; in-place parameter updates that
 * make a cache stale for good; pool exhaustion changing nothing but the
 * exhaustion counter; non-finite projections (named), scores and outputs.
 * Invariant checked throughout: a refused prepare or forward changes nothing
 * (status.h), and a held prepared row stays as it was. Shares the seed's
 * fixture with the other test_attention*.c programs (attention_support.h).
 * Unit test (ctest test_attention_errors, memcheck.test_attention_errors in
 * release): uses internal headers (pager/alloc.h, pager/cache_internal.h).
 */
#include "attention_support.h"

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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_validation_errors_with_exact_details),
        cmocka_unit_test(test_attention_validation_order),
        cmocka_unit_test(test_attention_in_place_update_makes_cache_stale_for_good),
        cmocka_unit_test(test_attention_pool_exhausted_changes_nothing_but_the_counter),
        cmocka_unit_test(test_attention_nonfinite_projection_names_the_projection),
        cmocka_unit_test(test_attention_nonfinite_score_and_output),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
