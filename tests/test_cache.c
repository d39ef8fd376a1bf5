/*
 * test_cache.c: the paged layer cache — creation errors in the documented
 * order with exact details and texts, and page tables whose size would
 * overflow refused as allocation failures; raw appends across block boundaries
 * checked against a contiguous [B,H,C,d_h] reference (the seed's layout),
 * with exact page ids and pool stats; every append error leaving byte-identical
 * state, in the seed's validation order; transactional pool exhaustion;
 * reset and allocation-free replay onto the same physical pages; many caches
 * sharing one pool; destroy; NULL handles and buffer errors. Unit test: uses
 * the private append (pager/cache_internal.h).
 */
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"

/* ---- a cache and its contiguous reference ------------------------------ */

/*
 * One cache and what the seed's contiguous cache would hold: keys and values
 * as [B, H, C, d_h], of which the first `len` positions are meaningful.
 */
typedef struct model {
    kvp_cache *cache;
    size_t batch;
    size_t heads;
    size_t width;
    size_t capacity;
    size_t len;
    size_t row;      /* B * H * d_h: doubles in one appended row */
    double *keys;    /* [B, H, C, d_h] */
    double *values;  /* [B, H, C, d_h] */
    uint64_t rng;
} model;

static void model_open(model *m, kvp_pool *pool, size_t batch, size_t heads, size_t width,
                       size_t capacity, uint64_t seed)
{
    memset(m, 0, sizeof *m);
    m->batch = batch;
    m->heads = heads;
    m->width = width;
    m->capacity = capacity;
    m->row = batch * heads * width;
    m->rng = seed;
    m->keys = kvpt_doubles(m->row * capacity);
    m->values = kvpt_doubles(m->row * capacity);
    kvp_binding binding = kvpt_binding(heads, width, capacity);
    m->cache = kvpt_cache(pool, &binding, batch, capacity);
}

static void model_close(model *m, kvp_pool *pool)
{
    kvpt_destroy_cache(m->cache, pool);
    free(m->keys);
    free(m->values);
    memset(m, 0, sizeof *m);
}

/* The next row pair, [B, H, 1, d_h] flat, from the model's generator. */
static void model_make_rows(model *m, double *key, double *value)
{
    for (size_t i = 0; i < m->row; i++) {
        key[i] = kvpt_rand_unit(&m->rng) * 8.0;
        value[i] = kvpt_rand_unit(&m->rng) * 8.0;
    }
}

/* Records a committed row pair at position m->len of the reference. */
static void model_record(model *m, const double *key, const double *value)
{
    for (size_t bh = 0; bh < m->batch * m->heads; bh++) {
        size_t at = (bh * m->capacity + m->len) * m->width;
        memcpy(m->keys + at, key + bh * m->width, m->width * sizeof(double));
        memcpy(m->values + at, value + bh * m->width, m->width * sizeof(double));
    }
    m->len++;
}

static kvp_status model_append_rows(model *m, const double *key, const double *value,
                                    kvp_error *err)
{
    kvp_tensor k = kvp_tensor4(key, m->batch, m->heads, 1, m->width);
    kvp_tensor v = kvp_tensor4(value, m->batch, m->heads, 1, m->width);
    kvp_status status = kvpi_cache_append(m->cache, &k, &v, err);
    if (status == KVP_OK) {
        model_record(m, key, value);
    }
    return status;
}

/* Appends fresh rows; they must be accepted. */
static void model_append(model *m, kvp_pool *pool)
{
    double *key = kvpt_doubles(m->row);
    double *value = kvpt_doubles(m->row);
    model_make_rows(m, key, value);
    kvp_error err;
    kvpt_assert_ok(model_append_rows(m, key, value, &err), &err);
    kvpt_assert_pool_ok(pool);
    free(key);
    free(value);
}

/*
 * The logical snapshots equal the reference's [B, H, len, d_h] prefix byte for
 * byte, and nothing past B*H*len*d_h of the output buffer is written.
 */
static void model_check_snapshots(const model *m)
{
    size_t room = m->row * m->capacity;
    size_t needed = m->row * m->len;
    double *snap = kvpt_doubles(room);
    double *sentinel = kvpt_doubles(room);
    memset(sentinel, 0xA5, (room + 1) * sizeof(double));
    kvp_error err;
    for (int values = 0; values < 2; values++) {
        memcpy(snap, sentinel, (room + 1) * sizeof(double));
        if (values) {
            kvpt_assert_ok(kvp_cache_values(m->cache, snap, room + 1, &err), &err);
        } else {
            kvpt_assert_ok(kvp_cache_keys(m->cache, snap, room + 1, &err), &err);
        }
        const double *ref = values ? m->values : m->keys;
        for (size_t bh = 0; bh < m->batch * m->heads; bh++) {
            assert_memory_equal(snap + bh * m->len * m->width, ref + bh * m->capacity * m->width,
                                m->len * m->width * sizeof(double));
        }
        assert_memory_equal(snap + needed, sentinel + needed, (room + 1 - needed) * sizeof(double));
    }
    free(snap);
    free(sentinel);
    assert_int_equal(kvp_cache_len(m->cache), m->len);
    assert_int_equal(kvp_cache_is_empty(m->cache), m->len == 0);
    assert_int_equal(kvp_cache_is_full(m->cache), m->len == m->capacity);
}

/*
 * Each lane maps exactly ceil(len / block_tokens) pages; the next block is
 * OUT_OF_RANGE. Returns the mapped blocks per lane.
 */
static size_t model_check_mapping(const model *m, size_t block_tokens, size_t total_pages)
{
    size_t mapped = KVPT_CEIL_DIV(m->len, block_tokens);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_info_get(m->cache, &info, &err), &err);
    assert_int_equal(info.len, m->len);
    assert_int_equal(info.capacity, m->capacity);
    assert_int_equal(info.batch_size, m->batch);
    assert_int_equal(info.block_tokens, block_tokens);
    assert_int_equal(info.blocks_per_lane, KVPT_CEIL_DIV(m->capacity, block_tokens));
    assert_int_equal(info.mapped_pages, m->batch * mapped);
    for (size_t lane = 0; lane < m->batch; lane++) {
        for (size_t block = 0; block < mapped; block++) {
            uint32_t page = KVPI_NO_PAGE;
            kvpt_assert_ok(kvp_cache_page(m->cache, lane, block, &page, &err), &err);
            assert_true(page < total_pages);
        }
        uint32_t untouched = 0xDEADBEEF;
        assert_int_equal(kvp_cache_page(m->cache, lane, mapped, &untouched, &err),
                         KVP_OUT_OF_RANGE);
        assert_string_equal(err.argument, "block");
        assert_int_equal(err.index, mapped);
        assert_int_equal(err.limit, mapped);
        assert_int_equal(untouched, 0xDEADBEEF);
    }
    return mapped;
}

static uint32_t page_of(const model *m, size_t lane, size_t block)
{
    uint32_t page = KVPI_NO_PAGE;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_page(m->cache, lane, block, &page, &err), &err);
    return page;
}

/* ---- creation ----------------------------------------------------------- */

/* Each failure: the status, err.status, the text, *out untouched, pool unchanged. */
static void expect_create_failure(kvp_pool *pool, const kvp_binding *binding, size_t batch,
                                  size_t capacity, kvp_status status, const char *text,
                                  kvp_error *err)
{
    kvp_pool_stats before = kvpt_stats(pool);
    kvp_cache *out = (kvp_cache *)0x1;
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvp_cache_create(pool, binding, batch, capacity, &out, err), status);
    assert_int_equal(err->status, status);
    assert_ptr_equal(out, (kvp_cache *)0x1);
    kvpt_assert_error_text(err, text);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    assert_int_equal(after.attached_caches, 0);
    kvpt_assert_pool_ok(pool);
}

static void test_cache_create_errors_in_documented_order(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 2, 4);
    kvp_binding good = kvpt_binding(2, 2, 8);
    kvp_error err;

    /* NULL_ARGUMENT first, whatever else is wrong. */
    kvp_cache *out = (kvp_cache *)0x1;
    assert_int_equal(kvp_cache_create(NULL, &good, 0, 0, &out, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    kvpt_assert_error_text(&err, "argument `pool` must not be NULL");
    assert_ptr_equal(out, (kvp_cache *)0x1);
    expect_create_failure(pool, NULL, 0, 0, KVP_NULL_ARGUMENT,
                          "argument `binding` must not be NULL", &err);
    assert_string_equal(err.argument, "binding");
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(kvp_cache_create(pool, &good, 0, 0, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&before, &after, sizeof before);
    kvpt_assert_pool_ok(pool);
    /* err is optional. */
    assert_int_equal(kvp_cache_create(pool, &good, 0, 4, &out, NULL), KVP_ZERO_BATCH_SIZE);
    assert_ptr_equal(out, (kvp_cache *)0x1);
    kvpt_assert_pool_ok(pool);

    /* INVALID_ARGUMENT (a bad binding) before the seed's checks: the pager's
     * part only (kind, reserved, page geometry); the owner record is opaque. */
    kvp_binding bad = good;
    bad.kind = 0;
    expect_create_failure(pool, &bad, 0, 0, KVP_INVALID_ARGUMENT,
                          "argument `binding` is invalid: kind must be KVP_BINDING_LAYER or "
                          "KVP_BINDING_EXTERNAL, reserved 0",
                          &err);
    assert_string_equal(err.argument, "binding");
    bad.kind = 3;
    expect_create_failure(pool, &bad, 1, 4, KVP_INVALID_ARGUMENT,
                          "argument `binding` is invalid: kind must be KVP_BINDING_LAYER or "
                          "KVP_BINDING_EXTERNAL, reserved 0",
                          &err);
    bad = good;
    bad.reserved = 1;
    expect_create_failure(pool, &bad, 1, 4, KVP_INVALID_ARGUMENT,
                          "argument `binding` is invalid: kind must be KVP_BINDING_LAYER or "
                          "KVP_BINDING_EXTERNAL, reserved 0",
                          &err);
    bad = good;
    bad.kv_heads = 0;
    expect_create_failure(pool, &bad, 0, 0, KVP_INVALID_ARGUMENT,
                          "argument `binding` is invalid: kv_heads and head_width must be nonzero",
                          &err);
    bad = good;
    bad.head_width = 0;
    expect_create_failure(pool, &bad, 1, 4, KVP_INVALID_ARGUMENT,
                          "argument `binding` is invalid: kv_heads and head_width must be nonzero",
                          &err);
    /* The record's contents are not the pager's to check: a record whose model
     * width is not heads * head_width makes a cache (attention refuses it). */
    kvpi_layer_record odd = kvpt_record(&good);
    odd.model_width = 5;
    kvp_binding opaque = kvpt_rebind(&good, &odd);
    kvp_cache *made = kvpt_cache(pool, &opaque, 1, 4);
    kvpt_destroy_cache(made, pool);

    /* The seed's order: batch, capacity, positions, element count; then geometry. */
    kvp_binding other_geometry = kvpt_binding(4, 1, 8);
    expect_create_failure(pool, &other_geometry, 0, 0, KVP_ZERO_BATCH_SIZE,
                          "KV cache batch size must be nonzero", &err);
    assert_int_equal(err.batch_size, 0);
    assert_int_equal(err.capacity, 0);
    expect_create_failure(pool, &other_geometry, 1, 0, KVP_ZERO_CAPACITY,
                          "KV cache capacity must be nonzero", &err);
    expect_create_failure(pool, &other_geometry, 1, 9, KVP_CAPACITY_EXCEEDS_POSITIONS,
                          "KV cache capacity 9 exceeds RoPE position capacity 8", &err);
    assert_int_equal(err.capacity, 9);
    assert_int_equal(err.max_positions, 8);
    assert_int_equal(err.batch_size, 0);
    expect_create_failure(pool, &good, 3, 100, KVP_CAPACITY_EXCEEDS_POSITIONS,
                          "KV cache capacity 100 exceeds RoPE position capacity 8", &err);

    kvp_binding wide = kvpt_binding(4, 1, SIZE_MAX);
    size_t huge_batch = SIZE_MAX / 4 + 1; /* * 4 heads * 1 * 1 overflows */
    char text[200];
    snprintf(text, sizeof text,
             "KV cache element count overflows for batch %zu, 4 heads, capacity 1, and head "
             "width 1",
             huge_batch);
    expect_create_failure(pool, &wide, huge_batch, 1, KVP_ELEMENT_COUNT_OVERFLOW, text, &err);
    assert_int_equal(err.batch_size, huge_batch);
    assert_int_equal(err.heads, 4);
    assert_int_equal(err.capacity, 1);
    assert_int_equal(err.head_width, 1);
    /* Overflow with the pool's own geometry, through the capacity. */
    kvp_binding matching_wide = kvpt_binding(2, 2, SIZE_MAX);
    size_t huge_capacity = SIZE_MAX / 8;
    snprintf(text, sizeof text,
             "KV cache element count overflows for batch 3, 2 heads, capacity %zu, and head "
             "width 2",
             huge_capacity);
    expect_create_failure(pool, &matching_wide, 3, huge_capacity, KVP_ELEMENT_COUNT_OVERFLOW,
                          text, &err);

    /* GEOMETRY_MISMATCH last: heads differ, or head width differs. */
    expect_create_failure(pool, &other_geometry, 1, 8, KVP_GEOMETRY_MISMATCH,
                          "cache geometry (4 heads, head width 1) does not match page pool "
                          "geometry (2 heads, head width 2)",
                          &err);
    assert_int_equal(err.pool_geometry.heads, 2);
    assert_int_equal(err.pool_geometry.head_width, 2);
    assert_int_equal(err.binding_geometry.heads, 4);
    assert_int_equal(err.binding_geometry.head_width, 1);
    kvp_binding narrow = kvpt_binding(2, 3, 8);
    expect_create_failure(pool, &narrow, 1, 8, KVP_GEOMETRY_MISMATCH,
                          "cache geometry (2 heads, head width 3) does not match page pool "
                          "geometry (2 heads, head width 2)",
                          &err);

    /* Capacity equal to the RoPE positions is allowed, and takes no page. */
    kvp_cache *cache = kvpt_cache(pool, &good, 3, 8);
    kvp_pool_stats created = kvpt_stats(pool);
    assert_int_equal(created.attached_caches, 1);
    assert_int_equal(created.free_pages, 4);
    assert_int_equal(created.acquires, 0);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
    assert_int_equal(info.batch_size, 3);
    assert_int_equal(info.capacity, 8);
    assert_int_equal(info.len, 0);
    assert_int_equal(info.block_tokens, 2);
    assert_int_equal(info.blocks_per_lane, 4);
    assert_int_equal(info.mapped_pages, 0);
    assert_memory_equal(&info.binding, &good, sizeof good);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/*
 * Page tables hold B * (2 * ceil(C / block) + 1) entries (tables, spare
 * entries, row-reservation entries). The seed's element check
 * bounds B * H * C * d_h only, so with H == d_h == 1 the table size itself can
 * overflow: it must fail as an allocation, never wrap into a tiny table.
 */
static void test_cache_create_page_table_size_cannot_overflow(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 1, 4);
    kvp_binding binding = kvpt_binding(1, 1, SIZE_MAX);
    kvp_error err;
    char text[160];
    snprintf(text, sizeof text, "cannot allocate KV cache page tables (%zu bytes)",
             (size_t)SIZE_MAX);

    /* ceil(SIZE_MAX / 2) must not wrap to 0 blocks per lane. */
    expect_create_failure(pool, &binding, 1, SIZE_MAX, KVP_ALLOCATION_FAILED, text, &err);
    assert_string_equal(err.what, "KV cache page tables");
    assert_int_equal(err.bytes, SIZE_MAX);
    /* B * (2 + 1) entries must not wrap to 0 entries. */
    expect_create_failure(pool, &binding, SIZE_MAX / 2 + 1, 1, KVP_ALLOCATION_FAILED, text, &err);
    /* B * (2 + 1) entries fit, but not their bytes. */
    expect_create_failure(pool, &binding, SIZE_MAX / 4, 1, KVP_ALLOCATION_FAILED, text, &err);

    /* A large, representable capacity still works, and maps pages lazily. */
    kvp_cache *cache = kvpt_cache(pool, &binding, 1, 1000);
    double row[1] = {0.25};
    kvp_tensor view = kvp_tensor4(row, 1, 1, 1, 1);
    for (size_t t = 0; t < 8; t++) {
        kvpt_assert_ok(kvpi_cache_append(cache, &view, &view, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    assert_int_equal(kvpi_cache_append(cache, &view, &view, &err), KVP_POOL_EXHAUSTED);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* ---- appends across block boundaries ------------------------------------ */

/*
 * Appends to one cache on a fresh pool of exactly B * ceil(C / block) pages,
 * until full. After every append: snapshots, mapping, page ids (the LIFO pool
 * hands out 0, 1, 2, ... block-major, lane-minor) and exact stats.
 */
static void run_block_boundaries(size_t block, size_t batch, size_t heads, size_t width,
                                 size_t capacity)
{
    size_t total = batch * KVPT_CEIL_DIV(capacity, block);
    kvp_pool *pool = kvpt_pool(block, heads, width, total);
    model m;
    model_open(&m, pool, batch, heads, width, capacity, 0x1234 + block * 7 + batch);
    model_check_snapshots(&m);
    assert_int_equal(model_check_mapping(&m, block, total), 0);

    for (size_t step = 1; step <= capacity; step++) {
        model_append(&m, pool);
        assert_int_equal(m.len, step);
        model_check_snapshots(&m);
        size_t mapped = model_check_mapping(&m, block, total);
        assert_int_equal(mapped, KVPT_CEIL_DIV(step, block));
        for (size_t lane = 0; lane < batch; lane++) {
            for (size_t b = 0; b < mapped; b++) {
                assert_int_equal(page_of(&m, lane, b), b * batch + lane);
            }
        }
        kvp_pool_stats stats = kvpt_stats(pool);
        size_t held = batch * mapped;
        assert_int_equal(stats.total_pages, total);
        assert_int_equal(stats.held_pages, held);
        assert_int_equal(stats.free_pages, total - held);
        assert_int_equal(stats.acquires, held);
        assert_int_equal(stats.releases, 0);
        assert_int_equal(stats.high_water_pages, held);
        assert_int_equal(stats.exhaustions, 0);
        assert_int_equal(stats.attached_caches, 1);
        assert_int_equal(stats.attached_reservations, 0);
        kvpt_assert_pool_ok(pool);
    }
    assert_true(kvp_cache_is_full(m.cache));

    /* Full, and the pool is used up exactly. */
    double *row = kvpt_doubles(m.row);
    kvp_error err;
    assert_int_equal(model_append_rows(&m, row, row, &err), KVP_FULL);
    assert_int_equal(err.capacity, capacity);
    kvpt_assert_pool_ok(pool);
    free(row);
    assert_int_equal(kvpt_stats(pool).free_pages, 0);

    model_close(&m, pool);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.free_pages, total);
    assert_int_equal(stats.releases, total);
    assert_int_equal(stats.acquires, total);
    assert_int_equal(stats.attached_caches, 0);
    kvpt_destroy_pool(pool);
}

static void test_cache_append_crosses_blocks_of_one_token(void **state)
{
    (void)state;
    run_block_boundaries(1, 1, 1, 1, 5);
    run_block_boundaries(1, 2, 3, 2, 7);
    run_block_boundaries(1, 3, 1, 4, 4);
}

static void test_cache_append_crosses_blocks_of_two_tokens(void **state)
{
    (void)state;
    run_block_boundaries(2, 1, 2, 2, 5);
    run_block_boundaries(2, 3, 1, 4, 9);
    run_block_boundaries(2, 2, 2, 1, 1);
}

static void test_cache_append_crosses_blocks_of_three_tokens(void **state)
{
    (void)state;
    run_block_boundaries(3, 2, 2, 3, 10);
    run_block_boundaries(3, 1, 4, 1, 8);
    run_block_boundaries(3, 4, 1, 2, 2);
}

static void test_cache_append_crosses_blocks_of_sixteen_tokens(void **state)
{
    (void)state;
    run_block_boundaries(16, 2, 2, 2, 35);
    run_block_boundaries(16, 3, 1, 5, 17);
    run_block_boundaries(16, 1, 3, 1, 33);
}

/* ---- failed appends change nothing -------------------------------------- */

/*
 * Calls the raw append with the given views; it must fail with `status` and
 * `text`, and leave the cache and the pool byte-identical.
 */
static void expect_append_failure(model *m, kvp_pool *pool, const kvp_tensor *key,
                                  const kvp_tensor *value, kvp_status status, const char *text,
                                  kvp_error *err)
{
    kvpt_state before;
    kvpt_state_capture(m->cache, pool, &before);
    memset(err, 0x5A, sizeof *err);
    assert_int_equal(kvpi_cache_append(m->cache, key, value, err), status);
    assert_int_equal(err->status, status);
    kvpt_assert_error_text(err, text);
    kvpt_assert_state_unchanged(&before, m->cache, pool, 0);
    kvpt_state_free(&before);
    model_check_snapshots(m);
}

static void test_cache_append_shape_errors_change_nothing(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 2, 4);
    model m;
    model_open(&m, pool, 1, 2, 2, 4, 11);
    model_append(&m, pool);
    double rows[16] = {0};
    kvp_tensor good = kvp_tensor4(rows, 1, 2, 1, 2);
    kvp_error err;

    /* At len 1 (inside a block) and at len 2 (a new block would be needed). */
    for (int round = 0; round < 2; round++) {
        kvp_tensor two_tokens = kvp_tensor4(rows, 1, 2, 2, 2);
        expect_append_failure(&m, pool, &two_tokens, &good, KVP_KEY_SHAPE_MISMATCH,
                              "appended key must have shape [1, 2, 1, 2], got [1, 2, 2, 2]",
                              &err);
        assert_int_equal(err.expected.rank, 4);
        assert_int_equal(err.expected.dims[2], 1);
        assert_int_equal(err.actual.rank, 4);
        assert_int_equal(err.actual.dims[2], 2);

        kvp_tensor wide = kvp_tensor4(rows, 1, 2, 1, 3);
        expect_append_failure(&m, pool, &good, &wide, KVP_VALUE_SHAPE_MISMATCH,
                              "appended value must have shape [1, 2, 1, 2], got [1, 2, 1, 3]",
                              &err);
        kvp_tensor batch2 = kvp_tensor4(rows, 2, 2, 1, 2);
        expect_append_failure(&m, pool, &batch2, &good, KVP_KEY_SHAPE_MISMATCH,
                              "appended key must have shape [1, 2, 1, 2], got [2, 2, 1, 2]",
                              &err);
        kvp_tensor rank3 = kvp_tensor3(rows, 1, 2, 2);
        expect_append_failure(&m, pool, &good, &rank3, KVP_VALUE_SHAPE_MISMATCH,
                              "appended value must have shape [1, 2, 1, 2], got [1, 2, 2]",
                              &err);
        assert_int_equal(err.actual.rank, 3);

        /* Missing data is a typed error too, before any shape check. */
        kvp_tensor no_data = kvp_tensor4(NULL, 1, 2, 1, 2);
        expect_append_failure(&m, pool, &no_data, &two_tokens, KVP_NULL_ARGUMENT,
                              "argument `key` must not be NULL", &err);
        expect_append_failure(&m, pool, &good, &no_data, KVP_NULL_ARGUMENT,
                              "argument `value` must not be NULL", &err);
        expect_append_failure(&m, pool, NULL, &good, KVP_NULL_ARGUMENT,
                              "argument `key` must not be NULL", &err);
        expect_append_failure(&m, pool, &good, NULL, KVP_NULL_ARGUMENT,
                              "argument `value` must not be NULL", &err);
        model_append(&m, pool);
    }
    assert_int_equal(kvpi_cache_append(NULL, &good, &good, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

static void test_cache_append_nonfinite_rows_change_nothing(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 2, 4);
    model m;
    model_open(&m, pool, 1, 2, 2, 4, 12);
    model_append(&m, pool);
    kvp_error err;
    static const struct {
        double bad;
        const char *name;
    } cases[] = {{NAN, "NaN"}, {INFINITY, "inf"}, {-INFINITY, "-inf"}};

    /* At len 1, then at len 2 where the append would open a block. */
    for (int round = 0; round < 2; round++) {
        for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
            double key[4] = {0.5, -1.0, 2.0, cases[c].bad};
            double value[4] = {1.0, 2.0, 3.0, 4.0};
            kvp_tensor k = kvp_tensor4(key, 1, 2, 1, 2);
            kvp_tensor v = kvp_tensor4(value, 1, 2, 1, 2);
            char text[128];
            snprintf(text, sizeof text,
                     "appended key value at flat index 3 must be finite, got %s", cases[c].name);
            expect_append_failure(&m, pool, &k, &v, KVP_NONFINITE_KEY, text, &err);
            assert_int_equal(err.index, 3);
            assert_memory_equal(&err.value, &key[3], sizeof(double));

            /* The first non-finite one is reported. */
            key[1] = -cases[c].bad;
            snprintf(text, sizeof text,
                     "appended key value at flat index 1 must be finite, got %s",
                     c == 0 ? "NaN" : (c == 1 ? "-inf" : "inf"));
            expect_append_failure(&m, pool, &k, &v, KVP_NONFINITE_KEY, text, &err);
            assert_int_equal(err.index, 1);
        }
        double key[4] = {0.5, -1.0, 2.0, 3.0};
        double value[4] = {INFINITY, 2.0, NAN, 4.0};
        kvp_tensor k = kvp_tensor4(key, 1, 2, 1, 2);
        kvp_tensor v = kvp_tensor4(value, 1, 2, 1, 2);
        expect_append_failure(&m, pool, &k, &v, KVP_NONFINITE_VALUE,
                              "appended value at flat index 0 must be finite, got inf", &err);
        assert_int_equal(err.index, 0);
        assert_true(isinf(err.value) && err.value > 0);
        value[0] = 1.0;
        expect_append_failure(&m, pool, &k, &v, KVP_NONFINITE_VALUE,
                              "appended value at flat index 2 must be finite, got NaN", &err);
        value[2] = -INFINITY;
        expect_append_failure(&m, pool, &k, &v, KVP_NONFINITE_VALUE,
                              "appended value at flat index 2 must be finite, got -inf", &err);
        model_append(&m, pool);
    }
    assert_int_equal(m.len, 3);
    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

/* The seed's order: key shape, value shape, full, non-finite key, non-finite value. */
static void test_cache_append_validation_order(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 2, 2);
    model m;
    model_open(&m, pool, 1, 2, 2, 4, 13);
    kvp_error err;
    double finite[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double nan_row[8] = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
    kvp_tensor good = kvp_tensor4(finite, 1, 2, 1, 2);
    kvp_tensor nan = kvp_tensor4(nan_row, 1, 2, 1, 2);
    kvp_tensor bad_shape = kvp_tensor4(finite, 1, 2, 2, 2);
    kvp_tensor bad_nan = kvp_tensor4(nan_row, 1, 1, 1, 2);

    /* Not full: shapes before finiteness, key before value. */
    expect_append_failure(&m, pool, &bad_nan, &bad_shape, KVP_KEY_SHAPE_MISMATCH,
                          "appended key must have shape [1, 2, 1, 2], got [1, 1, 1, 2]", &err);
    expect_append_failure(&m, pool, &nan, &bad_shape, KVP_VALUE_SHAPE_MISMATCH,
                          "appended value must have shape [1, 2, 1, 2], got [1, 2, 2, 2]", &err);
    expect_append_failure(&m, pool, &nan, &nan, KVP_NONFINITE_KEY,
                          "appended key value at flat index 0 must be finite, got NaN", &err);

    for (int i = 0; i < 4; i++) {
        model_append(&m, pool);
    }
    assert_true(kvp_cache_is_full(m.cache));

    /* Full: shape errors still come first; finiteness is never reached. */
    expect_append_failure(&m, pool, &bad_shape, &good, KVP_KEY_SHAPE_MISMATCH,
                          "appended key must have shape [1, 2, 1, 2], got [1, 2, 2, 2]", &err);
    expect_append_failure(&m, pool, &bad_shape, &bad_shape, KVP_KEY_SHAPE_MISMATCH,
                          "appended key must have shape [1, 2, 1, 2], got [1, 2, 2, 2]", &err);
    expect_append_failure(&m, pool, &good, &bad_shape, KVP_VALUE_SHAPE_MISMATCH,
                          "appended value must have shape [1, 2, 1, 2], got [1, 2, 2, 2]", &err);
    expect_append_failure(&m, pool, &nan, &good, KVP_FULL, "KV cache is full at capacity 4",
                          &err);
    assert_int_equal(err.capacity, 4);
    expect_append_failure(&m, pool, &good, &nan, KVP_FULL, "KV cache is full at capacity 4",
                          &err);
    expect_append_failure(&m, pool, &good, &good, KVP_FULL, "KV cache is full at capacity 4",
                          &err);
    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

/*
 * A block-opening append needs a page for every lane; with fewer free it
 * takes none. Only the exhaustion counter moves.
 */
static void test_cache_append_pool_exhausted_takes_nothing(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 6);
    kvp_error err;
    model other;
    model_open(&other, pool, 1, 1, 2, 4, 20);
    model_append(&other, pool); /* page 0 */
    model m;
    model_open(&m, pool, 3, 1, 2, 6, 21);
    model_append(&m, pool); /* pages 1, 2, 3 */
    model_append(&m, pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 2);

    double key[6];
    double value[6];
    model_make_rows(&m, key, value);
    kvp_tensor k = kvp_tensor4(key, 3, 1, 1, 2);
    kvp_tensor v = kvp_tensor4(value, 3, 1, 1, 2);
    for (uint64_t attempt = 1; attempt <= 2; attempt++) {
        kvpt_state before;
        kvpt_state_capture(m.cache, pool, &before);
        assert_int_equal(kvpi_cache_append(m.cache, &k, &v, &err), KVP_POOL_EXHAUSTED);
        assert_int_equal(err.needed, 3);
        assert_int_equal(err.available, 2);
        kvpt_assert_error_text(&err, "page pool exhausted: 3 pages needed, 2 free");
        kvpt_assert_state_unchanged(&before, m.cache, pool, 1);
        kvpt_state_free(&before);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.exhaustions, attempt);
        assert_int_equal(stats.attached_reservations, 0);
        model_check_snapshots(&m);
        model_check_snapshots(&other);
    }

    /* Page 0 comes back on top of the free list, so the retry gets 0, 4, 5. */
    model_close(&other, pool);
    assert_int_equal(kvpt_stats(pool).free_pages, 3);
    kvpt_assert_ok(model_append_rows(&m, key, value, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(page_of(&m, 0, 1), 0);
    assert_int_equal(page_of(&m, 1, 1), 4);
    assert_int_equal(page_of(&m, 2, 1), 5);
    assert_int_equal(page_of(&m, 0, 0), 1);
    assert_int_equal(page_of(&m, 1, 0), 2);
    assert_int_equal(page_of(&m, 2, 0), 3);
    model_check_snapshots(&m);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.free_pages, 0);
    assert_int_equal(stats.held_pages, 6);
    assert_int_equal(stats.acquires, 7);
    assert_int_equal(stats.releases, 1);
    assert_int_equal(stats.high_water_pages, 6);
    assert_int_equal(stats.exhaustions, 2);
    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

/* ---- reset and replay ----------------------------------------------------- */

static void test_cache_reset_keeps_binding_and_replays_onto_same_pages(void **state)
{
    (void)state;
    enum { B = 2, H = 2, D = 3, BT = 3, C = 8 };
    kvp_pool *pool = kvpt_pool(BT, H, D, 12);
    kvp_error err;
    model other;
    model_open(&other, pool, 1, H, D, 8, 30);
    model m;
    model_open(&m, pool, B, H, D, C, 31);

    /* Interleave another cache, so this cache's pages are not 0, 1, 2, ... */
    double keys[C][B * H * D];
    double values[C][B * H * D];
    for (size_t t = 0; t < C; t++) {
        model_make_rows(&m, keys[t], values[t]);
        kvpt_assert_ok(model_append_rows(&m, keys[t], values[t], &err), &err);
        kvpt_assert_pool_ok(pool);
        if (t % 3 == 0) {
            model_append(&other, pool);
        }
    }
    model_check_snapshots(&m);
    size_t mapped = model_check_mapping(&m, BT, 12);
    assert_int_equal(mapped, 3);
    uint32_t pages[B][3];
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t block = 0; block < mapped; block++) {
            pages[lane][block] = page_of(&m, lane, block);
        }
    }
    /* Block 0 took pages 0, 1; the other cache then took page 2 (its three rows
     * fit in it); blocks 1 and 2 took 3, 4 and 5, 6. */
    static const uint32_t expected_pages[B][3] = {{0, 3, 5}, {1, 4, 6}};
    assert_memory_equal(pages, expected_pages, sizeof pages);
    assert_int_equal(other.len, 3);
    assert_int_equal(page_of(&other, 0, 0), 2);
    kvp_pool_stats full = kvpt_stats(pool);
    assert_int_equal(full.held_pages, 1 + B * 3);

    kvp_cache_info info_before;
    kvp_cache_info_init(&info_before);
    kvpt_assert_ok(kvp_cache_info_get(m.cache, &info_before, &err), &err);
    kvpt_assert_ok(kvp_cache_reset(m.cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvpt_assert_ok(kvp_cache_info_get(m.cache, &info, &err), &err);
    assert_int_equal(info.len, 0);
    assert_int_equal(info.mapped_pages, 0);
    assert_int_equal(info.capacity, C);
    assert_int_equal(info.batch_size, B);
    assert_int_equal(info.blocks_per_lane, info_before.blocks_per_lane);
    assert_memory_equal(&info.binding, &info_before.binding, sizeof info.binding);
    assert_true(kvp_cache_is_empty(m.cache));
    kvp_pool_stats reset = kvpt_stats(pool);
    assert_int_equal(reset.free_pages, 12 - 1);
    assert_int_equal(reset.held_pages, 1);
    assert_int_equal(reset.releases, B * 3);
    assert_int_equal(reset.attached_caches, 2);
    uint32_t unused = 0xDEADBEEF;
    assert_int_equal(kvp_cache_page(m.cache, 0, 0, &unused, &err), KVP_OUT_OF_RANGE);
    assert_int_equal(unused, 0xDEADBEEF);
    m.len = 0;
    model_check_snapshots(&m);
    model_check_snapshots(&other);

    /* Replay: the same physical pages in the same table slots, the same rows. */
    for (size_t t = 0; t < C; t++) {
        kvpt_assert_ok(model_append_rows(&m, keys[t], values[t], &err), &err);
        kvpt_assert_pool_ok(pool);
        size_t now = model_check_mapping(&m, BT, 12);
        for (size_t lane = 0; lane < B; lane++) {
            for (size_t block = 0; block < now; block++) {
                assert_int_equal(page_of(&m, lane, block), pages[lane][block]);
            }
        }
        model_check_snapshots(&m);
    }
    kvp_pool_stats replayed = kvpt_stats(pool);
    assert_int_equal(replayed.held_pages, full.held_pages);
    assert_int_equal(replayed.high_water_pages, full.high_water_pages);
    assert_int_equal(replayed.acquires, full.acquires + B * 3);
    model_check_snapshots(&other);

    /* Reset of an empty cache is a no-op on the pool. */
    kvpt_assert_ok(kvp_cache_reset(m.cache, &err), &err);
    kvp_pool_stats once = kvpt_stats(pool);
    kvpt_assert_ok(kvp_cache_reset(m.cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats twice = kvpt_stats(pool);
    assert_memory_equal(&once, &twice, sizeof once);
    m.len = 0;
    model_check_snapshots(&m);

    model_close(&m, pool);
    model_close(&other, pool);
    kvpt_destroy_pool(pool);
}

/*
 * Reset and a full replay make no heap allocation and no free. The rows are
 * prepared up front; between the two counter reads only the cache is called.
 */
static void test_cache_reset_and_replay_allocate_nothing(void **state)
{
    (void)state;
    enum { B = 2, H = 2, D = 3, BT = 3, C = 8 };
    kvp_pool *pool = kvpt_pool(BT, H, D, B * 3);
    kvp_error err;
    model m;
    model_open(&m, pool, B, H, D, C, 40);
    double keys[C][B * H * D];
    double values[C][B * H * D];
    kvp_tensor key_views[C];
    kvp_tensor value_views[C];
    for (size_t t = 0; t < C; t++) {
        model_make_rows(&m, keys[t], values[t]);
        key_views[t] = kvp_tensor4(keys[t], B, H, 1, D);
        value_views[t] = kvp_tensor4(values[t], B, H, 1, D);
        kvpt_assert_ok(model_append_rows(&m, keys[t], values[t], &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    model_check_snapshots(&m);
    uint32_t pages[B][3];
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t block = 0; block < 3; block++) {
            pages[lane][block] = page_of(&m, lane, block);
        }
    }

    kvp_status statuses[C + 1];
    kvpt_heap_window heap;
    kvpt_heap_window_open(&heap);
    statuses[0] = kvp_cache_reset(m.cache, &err);
    for (size_t t = 0; t < C; t++) {
        statuses[t + 1] = kvpi_cache_append(m.cache, &key_views[t], &value_views[t], &err);
    }
    kvpt_heap_window_close(&heap);

    for (size_t i = 0; i <= C; i++) {
        assert_int_equal(statuses[i], KVP_OK);
    }
    kvpt_assert_no_heap_traffic(&heap);
    kvpt_assert_pool_ok(pool);
    model_check_snapshots(&m); /* the reference still holds the same C rows */
    for (size_t lane = 0; lane < B; lane++) {
        for (size_t block = 0; block < 3; block++) {
            assert_int_equal(page_of(&m, lane, block), pages[lane][block]);
        }
    }
    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

/* ---- many caches, one pool ---------------------------------------------- */

static void test_cache_many_caches_share_one_pool(void **state)
{
    (void)state;
    enum { CACHES = 3, BT = 2, TOTAL = 6 };
    static const size_t batches[CACHES] = {1, 2, 1};
    kvp_pool *pool = kvpt_pool(BT, 1, 2, TOTAL);
    kvp_error err;
    model m[CACHES];
    for (size_t i = 0; i < CACHES; i++) {
        model_open(&m[i], pool, batches[i], 1, 2, 8, 50 + i);
        assert_int_equal(kvpt_stats(pool).attached_caches, i + 1);
    }

    /* Round robin until an append is refused. */
    size_t appended = 0;
    size_t refused = CACHES;
    for (size_t turn = 0; refused == CACHES; turn++) {
        model *c = &m[turn % CACHES];
        size_t held = 0;
        for (size_t i = 0; i < CACHES; i++) {
            held += m[i].batch * KVPT_CEIL_DIV(m[i].len, BT);
        }
        size_t needed = c->len % BT == 0 ? c->batch : 0;
        double key[4];
        double value[4];
        model_make_rows(c, key, value);
        if (needed > TOTAL - held) {
            kvpt_state before;
            kvpt_state_capture(c->cache, pool, &before);
            assert_int_equal(model_append_rows(c, key, value, &err), KVP_POOL_EXHAUSTED);
            assert_int_equal(err.needed, needed);
            assert_int_equal(err.available, TOTAL - held);
            kvpt_assert_state_unchanged(&before, c->cache, pool, 1);
            kvpt_state_free(&before);
            refused = turn % CACHES;
            continue;
        }
        kvpt_assert_ok(model_append_rows(c, key, value, &err), &err);
        kvpt_assert_pool_ok(pool);
        appended++;
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.held_pages, held + needed);
        assert_int_equal(stats.free_pages, TOTAL - held - needed);
        assert_int_equal(stats.acquires, held + needed);
        assert_int_equal(stats.releases, 0);
        for (size_t i = 0; i < CACHES; i++) {
            model_check_snapshots(&m[i]); /* no cache sees another's rows */
        }
    }
    /* 1 + 2 + 1 pages for the first block, then cache 0 takes the 5th page at
     * len 3 and cache 1 (two lanes) finds one page free. */
    assert_int_equal(appended, 7);
    assert_int_equal(refused, 1);
    assert_int_equal(err.needed, 2);
    assert_int_equal(err.available, 1);
    assert_int_equal(m[0].len, 3);
    assert_int_equal(m[1].len, 2);
    assert_int_equal(m[2].len, 2);

    /* Destroy one by one: each cache's pages come back, attachments drop. */
    size_t free_pages = kvpt_stats(pool).free_pages;
    assert_int_equal(free_pages, 1);
    for (size_t i = 0; i < CACHES; i++) {
        size_t held = m[i].batch * KVPT_CEIL_DIV(m[i].len, BT);
        model_close(&m[i], pool);
        kvp_pool_stats stats = kvpt_stats(pool);
        free_pages += held;
        assert_int_equal(stats.free_pages, free_pages);
        assert_int_equal(stats.attached_caches, CACHES - i - 1);
        for (size_t j = i + 1; j < CACHES; j++) {
            model_check_snapshots(&m[j]);
        }
    }
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.free_pages, TOTAL);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.acquires, stats.releases);
    assert_int_equal(stats.acquires, 5);
    assert_int_equal(stats.high_water_pages, 5);
    assert_int_equal(stats.exhaustions, 1);
    kvpt_destroy_pool(pool);
}

/* ---- destroy, NULL handles, buffers ---------------------------------------- */

static void test_cache_destroy_returns_every_page(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 2, 1, 8);
    kvp_error err;
    model m;
    model_open(&m, pool, 2, 2, 1, 6, 60);
    for (int i = 0; i < 5; i++) {
        model_append(&m, pool);
    }
    kvp_pool_stats held = kvpt_stats(pool);
    assert_int_equal(held.held_pages, 6);
    assert_int_equal(held.attached_caches, 1);
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.held_pages, 6);
    kvpt_assert_pool_ok(pool);

    model_close(&m, pool);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.free_pages, 8);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.acquires, 6);
    assert_int_equal(stats.releases, 6);
    assert_int_equal(stats.attached_caches, 0);
    assert_int_equal(stats.attached_reservations, 0);

    /* A cache that never appended takes and returns nothing. */
    model_open(&m, pool, 3, 2, 1, 4, 61);
    model_close(&m, pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_memory_equal(&stats, &after, sizeof stats);
    kvpt_destroy_pool(pool);
}

static void test_cache_null_handles_and_bad_indices_are_typed_errors(void **state)
{
    (void)state;
    kvp_error err;
    double buf[4];
    uint32_t page = 0xDEADBEEF;
    kvp_cache_info info;
    kvp_cache_info_init(&info);

    assert_int_equal(kvp_cache_reset(NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    kvpt_assert_error_text(&err, "argument `cache` must not be NULL");
    /* Destroying NULL does nothing, as free(NULL); err is untouched. */
    memset(&err, 0x5A, sizeof err);
    {
        const kvp_error err_before = err;
        assert_int_equal(kvp_cache_destroy(NULL, &err), KVP_OK);
        assert_memory_equal(&err, &err_before, sizeof err);
    }
    assert_int_equal(kvp_cache_keys(NULL, buf, 4, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_cache_values(NULL, buf, 4, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_cache_info_get(NULL, &info, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(kvp_cache_page(NULL, 0, 0, &page, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "cache");
    assert_int_equal(page, 0xDEADBEEF);
    assert_int_equal(kvp_cache_reset(NULL, NULL), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_cache_len(NULL), 0);
    assert_int_equal(kvp_cache_capacity(NULL), 0);
    assert_false(kvp_cache_is_empty(NULL));
    assert_false(kvp_cache_is_full(NULL));

    kvp_pool *pool = kvpt_pool(2, 1, 2, 4);
    model m;
    model_open(&m, pool, 2, 1, 2, 5, 70);
    assert_int_equal(kvp_cache_capacity(m.cache), 5);
    assert_int_equal(kvp_cache_info_get(m.cache, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    assert_int_equal(kvp_cache_page(m.cache, 0, 0, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    /* An empty cache needs no buffer at all. */
    kvpt_assert_ok(kvp_cache_keys(m.cache, NULL, 0, &err), &err);
    kvpt_assert_ok(kvp_cache_values(m.cache, NULL, 0, &err), &err);
    assert_int_equal(kvp_cache_page(m.cache, 0, 0, &page, &err), KVP_OUT_OF_RANGE);
    assert_int_equal(err.limit, 0);
    kvpt_assert_pool_ok(pool);

    for (int i = 0; i < 3; i++) {
        model_append(&m, pool);
    }
    assert_int_equal(kvp_cache_page(m.cache, 2, 0, &page, &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "lane");
    assert_int_equal(err.index, 2);
    assert_int_equal(err.limit, 2);
    kvpt_assert_error_text(&err, "argument `lane` is 2, which is out of range (must be below 2)");
    assert_int_equal(kvp_cache_page(m.cache, SIZE_MAX, 0, &page, &err), KVP_OUT_OF_RANGE);
    assert_int_equal(kvp_cache_page(m.cache, 1, 2, &page, &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "block");
    assert_int_equal(err.index, 2);
    assert_int_equal(err.limit, 2);
    kvpt_assert_error_text(&err, "argument `block` is 2, which is out of range (must be below 2)");
    assert_int_equal(page, 0xDEADBEEF);
    kvpt_assert_ok(kvp_cache_page(m.cache, 1, 1, &page, &err), &err);
    assert_int_equal(page, 3);
    kvpt_assert_pool_ok(pool);

    /* Snapshot buffers: B*H*len*d_h = 2*1*3*2 = 12 doubles. */
    assert_int_equal(kvp_cache_keys(m.cache, NULL, 12, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "out");
    double small[12];
    double sentinel[12];
    memset(sentinel, 0xA5, sizeof sentinel);
    for (int values = 0; values < 2; values++) {
        for (size_t room = 0; room < 12; room += 11) {
            memcpy(small, sentinel, sizeof small);
            kvp_status status = values ? kvp_cache_values(m.cache, small, room, &err)
                                       : kvp_cache_keys(m.cache, small, room, &err);
            assert_int_equal(status, KVP_BUFFER_TOO_SMALL);
            assert_string_equal(err.argument, "out");
            assert_int_equal(err.needed, 12);
            assert_int_equal(err.available, room);
            assert_memory_equal(small, sentinel, sizeof small); /* nothing written */
            kvpt_assert_pool_ok(pool);
        }
    }
    kvpt_assert_error_text(&err, "buffer `out` holds 11 values but 12 are needed");
    kvpt_assert_ok(kvp_cache_keys(m.cache, small, 12, &err), &err);
    model_check_snapshots(&m);

    model_close(&m, pool);
    kvpt_destroy_pool(pool);
}

/*
 * kvp_cache_digest covers the page tables, not only the rows: two caches of
 * the same binding, geometry and rows on different pages digest differently,
 * and moving a lane's block to another page holding the same bytes changes
 * the digest too. Equal digests around a call must mean the tables are equal.
 */
static void test_cache_digest_covers_page_tables(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_pool(2, 1, 2, 8);
    kvp_binding binding = kvpt_binding(1, 2, 64);
    kvp_cache *a = kvpt_cache(pool, &binding, 1, 8);
    kvp_cache *b = kvpt_cache(pool, &binding, 1, 8);
    double row[2] = {1.5, -2.0};
    kvp_tensor key = kvp_tensor4(row, 1, 1, 1, 2);
    kvp_error err;
    for (int t = 0; t < 3; t++) {
        kvpt_assert_ok(kvpi_cache_append(a, &key, &key, &err), &err);
        kvpt_assert_ok(kvpi_cache_append(b, &key, &key, &err), &err);
    }
    kvpt_assert_pool_ok(pool);
    uint64_t da = 0;
    uint64_t db = 0;
    kvpt_assert_ok(kvp_cache_digest(a, &da, &err), &err);
    kvpt_assert_ok(kvp_cache_digest(b, &db, &err), &err);
    assert_true(a->tables[0] != b->tables[0]);
    assert_true(da != db); /* same rows, other pages */

    /* a's block 1 moved to another page holding the same bytes: rows equal, table not.
     * The page is held by a reservation, so memcheck sees it as allocated. */
    uint32_t storage[1];
    kvpi_reservation res;
    kvpi_reservation_init(&res, pool, storage, 1);
    kvpt_assert_ok(kvpi_reservation_fill(&res, 1, &err), &err);
    uint32_t old = a->tables[1];
    uint32_t spare = storage[0];
    memcpy(kvpi_pool_page(pool, spare), kvpi_pool_page(pool, old), pool->page_bytes);
    a->tables[1] = spare;
    uint64_t moved = 0;
    kvpt_assert_ok(kvp_cache_digest(a, &moved, &err), &err);
    assert_true(moved != da);
    a->tables[1] = old;
    kvpt_assert_ok(kvp_cache_digest(a, &moved, &err), &err);
    assert_true(moved == da);
    kvpi_reservation_release(&res);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_cache(a, pool);
    kvpt_destroy_cache(b, pool);
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_create_errors_in_documented_order),
        cmocka_unit_test(test_cache_create_page_table_size_cannot_overflow),
        cmocka_unit_test(test_cache_append_crosses_blocks_of_one_token),
        cmocka_unit_test(test_cache_append_crosses_blocks_of_two_tokens),
        cmocka_unit_test(test_cache_append_crosses_blocks_of_three_tokens),
        cmocka_unit_test(test_cache_append_crosses_blocks_of_sixteen_tokens),
        cmocka_unit_test(test_cache_append_shape_errors_change_nothing),
        cmocka_unit_test(test_cache_append_nonfinite_rows_change_nothing),
        cmocka_unit_test(test_cache_append_validation_order),
        cmocka_unit_test(test_cache_append_pool_exhausted_takes_nothing),
        cmocka_unit_test(test_cache_reset_keeps_binding_and_replays_onto_same_pages),
        cmocka_unit_test(test_cache_reset_and_replay_allocate_nothing),
        cmocka_unit_test(test_cache_many_caches_share_one_pool),
        cmocka_unit_test(test_cache_destroy_returns_every_page),
        cmocka_unit_test(test_cache_null_handles_and_bad_indices_are_typed_errors),
        cmocka_unit_test(test_cache_digest_covers_page_tables),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
