/*
 * test_external.c: the pager on its own (kvpager/cache.h's external caches,
 * kvpager/pool.h's page data).
 *
 * Owns the checks that an external cache (kvp_binding_init_external) takes
 * raw rows, all or nothing, rounded to every storage type exactly as
 * attention's commits round; that reserve / commit / discard keep the pool's
 * counters exact and the reservation visible to kvp_pool_check; that the
 * block table and the page data let a reader outside kvpager find every row,
 * bit for bit, in layer-bound and external caches alike; and that the two
 * kinds of cache never cross: raw rows never enter a layer-bound cache, and
 * attention refuses an external one. The audit runs after every operation.
 * The failing calls' "nothing changed" checks are in test_nothing_changed.c.
 *
 * Unit test: uses pager/dtype.h (the rounding rule) and
 * pager/cache_internal.h (to plant one audit mismatch).
 */
#include "support.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pager/cache_internal.h"
#include "pager/dtype.h"

enum { BT = 4, H = 2, HD = 3, B = 2, CAP = 10 };

static kvp_pool *width_pool(kvp_dtype dtype, size_t head_width, size_t pages)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = H;
    config.head_width = head_width;
    config.budget_bytes = pages * 2 * H * BT * head_width * kvp_dtype_bytes(dtype);
    config.dtype = dtype;
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    return pool;
}

static kvp_pool *dtype_pool(kvp_dtype dtype, size_t pages)
{
    return width_pool(dtype, HD, pages);
}

static kvp_cache *external_cache(kvp_pool *pool, size_t batch, size_t capacity)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, H, HD, capacity, 77, 5, &err), &err);
    return kvpt_cache(pool, &binding, batch, capacity);
}

/*
 * x as the pool stores it. Not inlined: inlined into the expectation loop
 * below, gcc 12 -O3 left some f32 expectations unrounded (the release preset
 * only; any change to the loop, even a print, hid it).
 */
__attribute__((noinline)) static double rounded(kvp_dtype dtype, double x)
{
    return kvpi_dtype_round(dtype, x);
}

/* Reads element i of a stored row of `dtype` at `row`, widened to f64. */
static double load(kvp_dtype dtype, const void *row, size_t i)
{
    double x;
    kvpi_dtype_load(dtype, (const unsigned char *)row + i * kvp_dtype_bytes(dtype), &x, 1);
    return x;
}

/*
 * An outside reader: gathers the logical [B, H, len, d_h] keys and values of
 * `cache` through its block tables and the page data only, and checks them
 * bit for bit against kvp_cache_keys / kvp_cache_values.
 */
static void assert_gather_matches(kvp_cache *cache, kvp_pool *pool)
{
    kvp_error err;
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
    size_t heads = info.binding.kv_heads;
    size_t d = info.binding.head_width;
    size_t n = info.batch_size * heads * info.len * d;
    double *keys = kvpt_doubles(n + 1);
    double *values = kvpt_doubles(n + 1);
    double *gk = kvpt_doubles(n + 1);
    double *gv = kvpt_doubles(n + 1);
    kvpt_assert_ok(kvp_cache_keys(cache, keys, n, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, values, n, &err), &err);
    for (size_t lane = 0; lane < info.batch_size; lane++) {
        const uint32_t *table = NULL;
        size_t blocks = SIZE_MAX;
        kvpt_assert_ok(kvp_cache_block_table(cache, lane, &table, &blocks, &err), &err);
        assert_int_equal(blocks, (info.len + info.block_tokens - 1) / info.block_tokens);
        for (size_t p = 0; p < info.len; p++) {
            uint32_t page = table[p / info.block_tokens];
            uint32_t audit_page = 0;
            kvpt_assert_ok(kvp_cache_page(cache, lane, p / info.block_tokens, &audit_page, &err),
                           &err);
            assert_int_equal(page, audit_page);
            const void *k = NULL;
            const void *v = NULL;
            kvp_page_layout layout;
            kvp_page_layout_init(&layout);
            kvpt_assert_ok(kvp_pool_page_data(pool, page, &k, &v, &layout, &err), &err);
            size_t slot = p % layout.block_tokens;
            for (size_t h = 0; h < heads; h++) {
                const unsigned char *krow = (const unsigned char *)k +
                                            h * layout.head_stride_bytes +
                                            slot * layout.row_stride_bytes;
                const unsigned char *vrow = (const unsigned char *)v +
                                            h * layout.head_stride_bytes +
                                            slot * layout.row_stride_bytes;
                for (size_t i = 0; i < d; i++) {
                    size_t at = ((lane * heads + h) * info.len + p) * d + i;
                    gk[at] = load(layout.dtype, krow, i);
                    gv[at] = load(layout.dtype, vrow, i);
                }
            }
        }
    }
    assert_memory_equal(gk, keys, n * sizeof *keys);
    assert_memory_equal(gv, values, n * sizeof *values);
    free(keys);
    free(values);
    free(gk);
    free(gv);
}

static void test_external_binding(void **state)
{
    (void)state;
    kvp_binding b;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&b, 2, 8, 100, 0xABCDull, 9, &err), &err);
    assert_int_equal(b.kind, KVP_BINDING_EXTERNAL);
    assert_int_equal(b.kv_heads, 2);
    assert_int_equal(b.head_width, 8);
    assert_int_equal(b.max_positions, 100);
    assert_int_equal(b.owner_digest[0], 0xABCDull);
    assert_int_equal(b.owner_digest[1], 0);
    assert_int_equal(b.owner_revision, 9);
    for (size_t i = 0; i < KVP_BINDING_RECORD_BYTES; i++) {
        assert_int_equal(b.record[i], 0);
    }
    assert_true(b.k_scale == 1.0 && b.v_scale == 1.0);
    assert_true(kvp_binding_is_external(&b));
    assert_false(kvp_binding_is_external(NULL));
    /* What attention compares an external cache with: the fields the binding
     * had before 0.2, so it refuses one with the same errors. */
    kvpi_layer_record r = kvpt_record(&b);
    assert_int_equal(r.heads, 2);
    assert_int_equal(r.model_width, 16);
    assert_int_equal(r.rope_feature_width, 0);
    assert_int_equal(r.rope_max_positions, 100);
    assert_int_equal(r.rope_base_bits, 0);
    for (size_t i = 0; i < KVP_PARAM_COUNT; i++) {
        assert_int_equal(r.node_id[i], 0xABCDull);
        assert_int_equal(r.revision[i], 9);
    }

    /* A layer's binding is never external: its kind says so. */
    kvp_layer *layer = kvpt_random_layer(4, 2, 16, 10000.0, 3);
    kvp_binding lb;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &lb, &err), &err);
    assert_false(kvp_binding_is_external(&lb));
    kvpt_destroy_layer(layer);

    kvp_binding untouched;
    memset(&untouched, 0x5A, sizeof untouched);
    kvp_binding out = untouched;
    assert_int_equal(kvp_binding_init_external(NULL, 1, 1, 1, 0, 0, &err), KVP_NULL_ARGUMENT);
    assert_int_equal(kvp_binding_init_external(&out, 0, 1, 1, 0, 0, &err), KVP_ZERO_SIZE);
    assert_string_equal(err.argument, "kv_heads");
    assert_int_equal(kvp_binding_init_external(&out, 1, 0, 1, 0, 0, &err), KVP_ZERO_SIZE);
    assert_string_equal(err.argument, "head_width");
    assert_int_equal(kvp_binding_init_external(&out, 1, 1, 0, 0, 0, &err), KVP_ZERO_SIZE);
    assert_string_equal(err.argument, "max_positions");
    assert_int_equal(kvp_binding_init_external(&out, 2, SIZE_MAX / 2 + 1, 1, 0, 0, &err),
                     KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "head_width");
    assert_memory_equal(&out, &untouched, sizeof out);
}

/*
 * Rows appended in three calls (3, 6, 1 rows: within a block, across two
 * boundaries, the last position) read back as the input rounded once to the
 * pool's dtype, at every dtype; pages follow len; the gather agrees.
 */
static void test_external_append_rows_round_trip(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16};
    static const size_t chunks[] = {3, 6, 1};
    for (size_t t = 0; t < 3; t++) {
        kvp_dtype dtype = dtypes[t];
        kvp_pool *pool = dtype_pool(dtype, 16);
        kvp_cache *cache = external_cache(pool, B, CAP);
        double expect_k[B * H * CAP * HD];
        double expect_v[B * H * CAP * HD];
        size_t len = 0;
        for (size_t c = 0; c < 3; c++) {
            size_t rows = chunks[c];
            double k[B * H * CAP * HD];
            double v[B * H * CAP * HD];
            kvpt_fill_random(k, B * H * rows * HD, 100 + c);
            kvpt_fill_random(v, B * H * rows * HD, 200 + c);
            k[0] = 1.0 + 0x1p-20; /* rounds in bf16 and f32... */
            v[1] = 1.0 + 0x1p-40; /* ...and in f32 */
            kvp_error err;
            kvpt_assert_ok(kvp_cache_append_rows(cache, k, v, rows, &err), &err);
            kvpt_assert_pool_ok(pool);
            for (size_t b = 0; b < B; b++) {
                for (size_t h = 0; h < H; h++) {
                    for (size_t r = 0; r < rows; r++) {
                        for (size_t i = 0; i < HD; i++) {
                            size_t in = ((b * H + h) * rows + r) * HD + i;
                            size_t at = ((b * H + h) * CAP + len + r) * HD + i;
                            expect_k[at] = rounded(dtype, k[in]);
                            expect_v[at] = rounded(dtype, v[in]);
                        }
                    }
                }
            }
            len += rows;
            assert_int_equal(kvp_cache_len(cache), len);
            kvp_pool_stats stats = kvpt_stats(pool);
            assert_int_equal(stats.held_pages, B * ((len + BT - 1) / BT));
            assert_int_equal(stats.acquires, stats.held_pages);
            assert_int_equal(stats.tentative_pages, 0);
            assert_int_equal(stats.attached_reservations, 0);
        }
        assert_true(kvp_cache_is_full(cache));
        double got_k[B * H * CAP * HD];
        double got_v[B * H * CAP * HD];
        kvp_error err;
        kvpt_assert_ok(kvp_cache_keys(cache, got_k, sizeof got_k / sizeof *got_k, &err), &err);
        kvpt_assert_ok(kvp_cache_values(cache, got_v, sizeof got_v / sizeof *got_v, &err), &err);
        /* expect_* is laid out with stride CAP; at len == CAP the layouts coincide. */
        assert_memory_equal(got_k, expect_k, sizeof got_k);
        assert_memory_equal(got_v, expect_v, sizeof got_v);
        /* Rounded once to the dtype: bf16 keeps 8 bits, f32 24. */
        assert_true(got_k[0] == (dtype == KVP_BF16 ? 1.0 : 1.0 + 0x1p-20));
        assert_true(got_v[1] == (dtype == KVP_F64 ? 1.0 + 0x1p-40 : 1.0));
        assert_gather_matches(cache, pool);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
}

/*
 * reserve -> commit in pieces -> done; reserve -> discard leaves every
 * counter as it was; the reservation is visible to the audit and to stats.
 */
static void test_external_reserve_commit_discard(void **state)
{
    (void)state;
    kvp_pool *pool = dtype_pool(KVP_F32, 16);
    kvp_cache *cache = external_cache(pool, B, CAP);
    kvp_error err;
    double k[B * H * CAP * HD];
    double v[B * H * CAP * HD];
    kvpt_fill_random(k, sizeof k / sizeof *k, 1);
    kvpt_fill_random(v, sizeof v / sizeof *v, 2);
    kvpt_assert_ok(kvp_cache_append_rows(cache, k, v, 2, &err), &err);
    kvp_pool_stats before = kvpt_stats(pool);
    assert_int_equal(before.held_pages, B);

    /* 5 more rows: positions 2..6 need block 1 (4..7): B pages. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 5, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_reserved_rows(cache), 5);
    kvp_pool_stats s = kvpt_stats(pool);
    assert_int_equal(s.held_pages, 2 * B);
    assert_int_equal(s.tentative_pages, B);
    assert_int_equal(s.attached_reservations, 1);
    assert_int_equal(s.acquires, before.acquires);
    assert_int_equal(s.high_water_pages, before.high_water_pages);

    /* Discard: everything exactly as before the reserve, stats included. */
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    s = kvpt_stats(pool);
    assert_memory_equal(&s, &before, sizeof s);
    assert_int_equal(kvp_cache_reserved_rows(cache), 0);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err); /* nothing pending: no-op */
    s = kvpt_stats(pool);
    assert_memory_equal(&s, &before, sizeof s);

    /* Reserve 6, commit 1 (no new block), then 3 (opens block 1), then 2. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 6, &err), &err);
    assert_int_equal(kvp_cache_append_rows(cache, k, v, 1, &err), KVP_ROWS_RESERVED);
    assert_int_equal(err.tokens, 6);
    assert_int_equal(kvp_cache_reserve_rows(cache, 1, &err), KVP_ROWS_RESERVED);
    assert_int_equal(kvp_cache_commit_rows(cache, k, v, 7, &err), KVP_ROWS_NOT_RESERVED);
    assert_int_equal(err.tokens, 7);
    assert_int_equal(err.available, 6);
    static const size_t pieces[] = {1, 3, 2};
    size_t len = 2;
    for (size_t i = 0; i < 3; i++) {
        kvpt_assert_ok(kvp_cache_commit_rows(cache, k, v, pieces[i], &err), &err);
        len += pieces[i];
        kvpt_assert_pool_ok(pool);
        assert_int_equal(kvp_cache_len(cache), len);
        s = kvpt_stats(pool);
        size_t mapped = B * ((len + BT - 1) / BT);
        assert_int_equal(s.acquires, mapped);
        assert_int_equal(s.held_pages, B * 2); /* blocks 0 and 1, mapped or reserved */
        assert_int_equal(s.tentative_pages, B * 2 - mapped);
        assert_int_equal(s.attached_reservations, B * 2 - mapped != 0);
    }
    assert_int_equal(kvp_cache_reserved_rows(cache), 0);
    assert_int_equal(kvp_cache_commit_rows(cache, k, v, 1, &err), KVP_ROWS_NOT_RESERVED);
    assert_int_equal(err.available, 0);
    assert_gather_matches(cache, pool);

    /* The rows committed in pieces are the rows appended at once elsewhere. */
    kvp_cache *twin = external_cache(pool, B, CAP);
    double all_k[B * H * 8 * HD];
    double all_v[B * H * 8 * HD];
    kvpt_assert_ok(kvp_cache_keys(cache, all_k, sizeof all_k / sizeof *all_k, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, all_v, sizeof all_v / sizeof *all_v, &err), &err);
    kvpt_assert_ok(kvp_cache_append_rows(twin, all_k, all_v, 8, &err), &err);
    /* Same rows and length (the page ids differ). */
    double twin_k[B * H * 8 * HD];
    kvpt_assert_ok(kvp_cache_keys(twin, twin_k, sizeof twin_k / sizeof *twin_k, &err), &err);
    assert_memory_equal(twin_k, all_k, sizeof twin_k);
    kvpt_destroy_cache(twin, pool);

    /* Reset and destroy give back a pending reservation too. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 2, &err), &err);
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_reserved_rows(cache), 0);
    assert_int_equal(kvpt_stats(pool).held_pages, 0);
    assert_int_equal(kvpt_stats(pool).tentative_pages, 0);
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 9, &err), &err);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* Promises: admission sees them, reserves draw from them, discard gives them back. */
static void test_external_promise(void **state)
{
    (void)state;
    kvp_pool *pool = dtype_pool(KVP_F64, 16);
    kvp_cache *cache = external_cache(pool, B, CAP);
    kvp_error err;
    assert_int_equal(kvp_cache_promise(cache, B * 3 + 1, &err), KVP_OUT_OF_RANGE);
    assert_int_equal(err.limit, B * 3 + 1);
    kvpt_assert_ok(kvp_cache_promise(cache, 4, &err), &err);
    assert_int_equal(kvp_cache_promised_pages(cache), 4);
    assert_int_equal(kvpt_stats(pool).promised_pages, 4);
    kvp_admission admission;
    kvpt_assert_ok(kvp_pool_admit(pool, 13, 0, &admission, &err), &err);
    assert_int_equal(admission, KVP_ADMIT_LATER); /* 16 free - 4 promised < 13 */

    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 5, &err), &err); /* 2 blocks: 4 pages */
    assert_int_equal(kvp_cache_promised_pages(cache), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err);
    assert_int_equal(kvp_cache_promised_pages(cache), 4);
    assert_int_equal(kvpt_stats(pool).promised_pages, 4);

    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 5, &err), &err);
    double rows[B * H * 5 * HD];
    kvpt_fill_random(rows, sizeof rows / sizeof *rows, 9);
    kvpt_assert_ok(kvp_cache_commit_rows(cache, rows, rows, 3, &err), &err); /* block 0 */
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err); /* block 1's 2 pages */
    assert_int_equal(kvp_cache_promised_pages(cache), 2);
    assert_int_equal(kvp_cache_pages_for(cache, 5), B);
    assert_int_equal(kvp_cache_pages_for(cache, 3), 0);
    assert_int_equal(kvp_cache_pages_for(cache, SIZE_MAX), B * (SIZE_MAX / BT)); /* 1 mapped */
    assert_int_equal(kvp_cache_pages_for(NULL, 5), 0);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    assert_int_equal(kvp_cache_promised_pages(cache), 0);
    assert_int_equal(kvpt_stats(pool).promised_pages, 0);
    kvpt_assert_ok(kvp_cache_promise(cache, 2, &err), &err);
    kvpt_destroy_cache(cache, pool); /* destroy returns the promise */
    kvpt_destroy_pool(pool);
}

static void count_mismatch(void *ctx, const kvp_mismatch *m)
{
    assert_string_equal(m->what, "pages reserved for a cache's pending rows");
    (*(size_t *)ctx)++;
}

/* The audit counts a pending reservation's pages and checks they match its rows. */
static void test_external_audit_sees_the_reservation(void **state)
{
    (void)state;
    kvp_pool *pool = dtype_pool(KVP_F64, 16);
    kvp_cache *cache = external_cache(pool, 1, CAP);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 5, &err), &err); /* 2 pages */
    kvpt_assert_pool_ok(pool);
    cache->reserved_rows = 9; /* planted: 9 rows would need 3 pages */
    size_t found = 0;
    assert_int_equal(kvp_pool_check(pool, count_mismatch, &found, &err), KVP_AUDIT_FAILED);
    assert_int_equal(found, 1);
    assert_int_equal(err.first_mismatch.expected, 3);
    assert_int_equal(err.first_mismatch.actual, 2);
    cache->reserved_rows = 5;
    kvpt_assert_pool_ok(pool);
    /* Pool destroy refuses while the reservation holds pages. */
    assert_int_equal(kvp_pool_destroy(pool, &err), KVP_POOL_BUSY);
    assert_int_equal(err.attached_reservations, 1);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/*
 * The seed's rule holds: raw rows never enter a layer-bound cache, and
 * attention refuses an external cache (its binding names no layer). The
 * block table and page data serve both kinds.
 */
static void test_external_kinds_never_cross(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_BF16};
    for (size_t t = 0; t < 2; t++) {
        enum { W = 4 }; /* head width: RoPE needs an even one */
        kvp_pool *pool = width_pool(dtypes[t], W, 16);
        kvp_layer *layer = kvpt_random_layer(H * W, H, 16, 10000.0, 4);
        kvp_layer_info linfo;
        kvp_layer_info_init(&linfo);
        kvp_error err;
        kvpt_assert_ok(kvp_layer_info_get(layer, &linfo, &err), &err);
        kvp_binding lb;
        kvpt_assert_ok(kvp_layer_binding_get(layer, &lb, &err), &err);
        kvp_cache *bound = kvpt_cache(pool, &lb, B, 8);
        kvp_ticket *ticket = kvpt_ticket(bound);
        size_t width = linfo.model_width;
        for (size_t step = 0; step < 6; step++) {
            double x[B * 8];
            kvpt_fill_random(x, B * width, 40 + step);
            kvp_tensor in = kvp_tensor3(x, B, 1, width);
            kvpt_assert_ok(kvp_attention_forward(layer, &in, bound, ticket, &err), &err);
        }
        assert_gather_matches(bound, pool);
        double rows[B * H * W];
        kvpt_fill_random(rows, B * H * W, 5);
        assert_int_equal(kvp_cache_append_rows(bound, rows, rows, 1, &err),
                         KVP_CACHE_LAYER_BOUND);
        assert_int_equal(kvp_cache_reserve_rows(bound, 1, &err), KVP_CACHE_LAYER_BOUND);
        assert_int_equal(kvp_cache_commit_rows(bound, rows, rows, 0, &err),
                         KVP_CACHE_LAYER_BOUND);
        assert_int_equal(kvp_cache_promise(bound, 1, &err), KVP_CACHE_LAYER_BOUND);
        assert_int_equal(kvp_cache_len(bound), 6);

        kvp_binding eb;
        kvpt_assert_ok(kvp_binding_init_external(&eb, H, W, 16, kvp_param_id(kvp_layer_param(layer, 0)),
                                                 kvp_param_revision(kvp_layer_param(layer, 0)),
                                                 &err),
                       &err);
        kvp_cache *external = kvpt_cache(pool, &eb, B, 8);
        kvp_ticket *other = kvpt_ticket(external);
        double x[B * 8];
        kvpt_fill_random(x, B * width, 50);
        kvp_tensor in = kvp_tensor3(x, B, 1, width);
        /* Even with the layer's query identity and revision, the binding differs. */
        kvp_status refused = kvp_attention_forward(layer, &in, external, other, &err);
        assert_true(refused == KVP_CACHE_LAYER_MISMATCH || refused == KVP_CACHE_ROPE_MISMATCH);
        assert_int_equal(kvp_cache_len(external), 0);
        kvpt_assert_ok(kvp_cache_append_rows(external, rows, rows, 1, &err), &err);
        assert_gather_matches(external, pool);
        kvpt_assert_pool_ok(pool);
        kvpt_destroy_ticket(other, pool);
        kvpt_destroy_cache(external, pool);
        kvpt_destroy_ticket(ticket, pool);
        kvpt_destroy_cache(bound, pool);
        kvpt_destroy_layer(layer);
        kvpt_destroy_pool(pool);
    }
}

/* The page format in numbers, and which page ids page_data accepts. */
static void test_external_page_data(void **state)
{
    (void)state;
    kvp_pool *pool = dtype_pool(KVP_BF16, 4);
    kvp_cache *cache = external_cache(pool, 1, CAP);
    kvp_error err;
    double rows[H * HD];
    kvpt_fill_random(rows, H * HD, 8);
    kvpt_assert_ok(kvp_cache_append_rows(cache, rows, rows, 1, &err), &err);
    uint32_t page = 0;
    kvpt_assert_ok(kvp_cache_page(cache, 0, 0, &page, &err), &err);
    const void *k = NULL;
    const void *v = NULL;
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    kvpt_assert_ok(kvp_pool_page_data(pool, page, &k, &v, &layout, &err), &err);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(layout.dtype, KVP_BF16);
    assert_int_equal(layout.element_bytes, 2);
    assert_int_equal(layout.heads, H);
    assert_int_equal(layout.block_tokens, BT);
    assert_int_equal(layout.head_width, HD);
    assert_int_equal(layout.head_stride, BT * HD);
    assert_int_equal(layout.row_stride, HD);
    assert_int_equal(layout.head_stride_bytes, BT * HD * 2);
    assert_int_equal(layout.row_stride_bytes, HD * 2);
    assert_int_equal(layout.values_offset_bytes, H * BT * HD * 2);
    assert_int_equal(layout.page_bytes, stats.page_bytes);
    assert_ptr_equal(k, (const void *)(stats.slab_address + page * stats.page_bytes));
    assert_ptr_equal((const unsigned char *)v, (const unsigned char *)k + layout.values_offset_bytes);
    /* layout is optional. */
    const void *k2 = NULL;
    const void *v2 = NULL;
    kvpt_assert_ok(kvp_pool_page_data(pool, page, &k2, &v2, NULL, &err), &err);
    assert_ptr_equal(k2, k);
    assert_ptr_equal(v2, v);

    /* Only held pages: a free one is PAGE_NOT_HELD, past the slab OUT_OF_RANGE. */
    uint32_t free_page = page + 1;
    const void *keep = (const void *)0x1;
    const void *keep_v = (const void *)0x2;
    assert_int_equal(kvp_pool_page_data(pool, free_page, &keep, &keep_v, &layout, &err),
                     KVP_PAGE_NOT_HELD);
    assert_int_equal(err.index, free_page);
    assert_int_equal(kvp_pool_page_data(pool, 4, &keep, &keep_v, NULL, &err), KVP_OUT_OF_RANGE);
    assert_string_equal(err.argument, "page");
    assert_int_equal(err.limit, 4);
    assert_ptr_equal(keep, (const void *)0x1);
    assert_ptr_equal(keep_v, (const void *)0x2);
    /* After a reset the page is free again. */
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    assert_int_equal(kvp_pool_page_data(pool, page, &keep, &keep_v, NULL, &err),
                     KVP_PAGE_NOT_HELD);

    const uint32_t *table = NULL;
    size_t blocks = 7;
    kvpt_assert_ok(kvp_cache_block_table(cache, 0, &table, &blocks, &err), &err);
    assert_int_equal(blocks, 0);
    assert_non_null(table);
    assert_int_equal(kvp_cache_block_table(cache, 1, &table, &blocks, &err), KVP_OUT_OF_RANGE);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_external_binding),
        cmocka_unit_test(test_external_append_rows_round_trip),
        cmocka_unit_test(test_external_reserve_commit_discard),
        cmocka_unit_test(test_external_promise),
        cmocka_unit_test(test_external_audit_sees_the_reservation),
        cmocka_unit_test(test_external_kinds_never_cross),
        cmocka_unit_test(test_external_page_data),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
