/*
 * test_dtype_narrow.c: f16 and fp8 e4m3 pages (kvp_dtype, kvpager/pool.h),
 * with the fp8 K and V scales of kvp_binding. (The conversions themselves:
 * tests/test_dtype_codes.c.)
 *
 * Proves: pools of both types (geometry, stats, layout); caches store the
 * elements (read back through kvp_pool_page_data: e = round(x / scale) for
 * fp8) and export e * scale, through the external and the private append;
 * overflows are refused by every append path, prepare and the stored
 * reference with nothing changed, the fp8 ones under the keys' and the
 * values' own scales; scales are validated by kvp_cache_create and
 * kvp_layer_set_kv_scales; a cache under other fp8 scales never shares
 * blocks (other binding digest: a miss, or BLOCK_BINDING_MISMATCH), while
 * other dtypes ignore the scales; the audit passes after appends, forks and
 * copy-on-write; cache digests differ by dtype and by fp8 scales; and the
 * error of the stored-dtype reference against the f64 reference stays
 * within the bounds docs/DESIGN.md states (measured maxima printed).
 * Attention over f16/fp8 pages through a cache (the gather kernels) is
 * tested with the kernels.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

#include "pager/cache_internal.h"
#include "pager/dtype.h"

/* The bounds of docs/DESIGN.md ("Storage precision"): error / largest |f64 output| of a run. */
#define F16_BOUND 2e-3
#define FP8_BOUND 1e-1

/* ---- pools and caches ----------------------------------------------------------- */

static void test_narrow_pool_geometry_stats_layout(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F16, KVP_FP8_E4M3};
    size_t budget = 1 << 20;
    size_t pages[3];
    for (size_t i = 0; i < 3; i++) {
        kvp_pool_config config;
        kvp_pool_config_init(&config);
        config.block_tokens = 16;
        config.heads = 4;
        config.head_width = 32;
        config.budget_bytes = budget;
        config.dtype = dtypes[i];
        kvp_pool *pool = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats stats = kvpt_stats(pool);
        size_t bytes = kvp_dtype_bytes(dtypes[i]);
        assert_int_equal(stats.dtype, dtypes[i]);
        assert_int_equal(stats.element_bytes, bytes);
        assert_int_equal(stats.page_bytes, 2 * 4 * 16 * 32 * bytes);
        assert_int_equal(stats.total_pages, budget / stats.page_bytes);
        pages[i] = stats.total_pages;
        kvp_page_layout layout;
        kvp_page_layout_init(&layout);
        kvpt_assert_ok(kvp_pool_page_layout_get(pool, &layout, &err), &err);
        assert_int_equal(layout.dtype, dtypes[i]);
        assert_int_equal(layout.element_bytes, bytes);
        assert_int_equal(layout.row_stride_bytes, 32 * bytes);
        assert_int_equal(layout.head_stride_bytes, 16 * 32 * bytes);
        assert_int_equal(layout.values_offset_bytes, 4 * 16 * 32 * bytes);
        assert_int_equal(layout.page_bytes, stats.page_bytes);
        kvpt_destroy_pool(pool);
    }
    assert_int_equal(pages[1], 4 * pages[0]);
    assert_int_equal(pages[2], 8 * pages[0]);
}

enum { N_HEADS = 2, N_HD = 5, N_BATCH = 2, N_CAP = 9, N_BT = 4 };
enum { N_ROW = N_BATCH * N_HEADS * N_HD, N_KV = N_BATCH * N_HEADS * N_CAP * N_HD };

/* An external cache of `pool` with the given fp8 scales. */
static kvp_cache *scaled_cache(kvp_pool *pool, double k_scale, double v_scale, size_t batch)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, N_HEADS, N_HD, N_CAP, 7, 1, &err), &err);
    assert_true(binding.k_scale == 1.0 && binding.v_scale == 1.0);
    binding.k_scale = k_scale;
    binding.v_scale = v_scale;
    return kvpt_cache(pool, &binding, batch, N_CAP);
}

/* [B, H, rows, d_h] rows of magnitudes 2^-12 .. 2^8 (within e4m3 at scale 0.5 and above). */
static void random_rows(double *rows, size_t n, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++) {
        rows[i] = kvpt_rand_unit(seed) * ldexp(1.0, (int)(i % 11) * 2 - 12) * 0.9;
    }
}

/* The element of (lane, head, position, i) as its page holds it, widened (e for fp8). */
static double page_element(kvp_cache *cache, kvp_pool *pool, int values, size_t lane,
                           size_t head, size_t position, size_t i)
{
    uint32_t page;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_page(cache, lane, position / N_BT, &page, &err), &err);
    const void *keys;
    const void *vals;
    kvp_page_layout layout;
    kvp_page_layout_init(&layout);
    kvpt_assert_ok(kvp_pool_page_data(pool, page, &keys, &vals, &layout, &err), &err);
    const unsigned char *base = values ? vals : keys;
    const unsigned char *at = base + head * layout.head_stride_bytes +
                              (position % N_BT) * layout.row_stride_bytes +
                              i * layout.element_bytes;
    double x;
    kvpi_dtype_load(layout.dtype, at, &x, 1);
    return x;
}

/*
 * Rows appended (externally, then privately) land in the pages as the
 * elements of the definition (e = round(x / scale) for fp8) and export as
 * e * scale; an f16 cache ignores the scales.
 */
static void test_narrow_caches_store_elements_and_export_values(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F16, KVP_FP8_E4M3};
    for (size_t t = 0; t < 2; t++) {
        kvp_dtype dtype = dtypes[t];
        kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 2 * N_BATCH * 3, dtype);
        kvp_cache *cache = scaled_cache(pool, 0.5, 3.0, N_BATCH);
        double k_scale = dtype == KVP_FP8_E4M3 ? 0.5 : 1.0;
        double v_scale = dtype == KVP_FP8_E4M3 ? 3.0 : 1.0;
        double got_k;
        double got_v;
        kvpi_cache_kv_scales(cache, &got_k, &got_v);
        assert_true(got_k == k_scale && got_v == v_scale);
        double keys[N_KV];
        double values[N_KV];
        uint64_t seed = 40 + t;
        random_rows(keys, N_KV, &seed);
        random_rows(values, N_KV, &seed);
        kvp_error err;
        /* Positions 0 .. 5 through kvp_cache_append_rows ([B, H, 6, d_h]). */
        enum { FIRST = 6 };
        double part_k[N_BATCH * N_HEADS * FIRST * N_HD];
        double part_v[N_BATCH * N_HEADS * FIRST * N_HD];
        for (size_t bh = 0; bh < N_BATCH * N_HEADS; bh++) {
            memcpy(part_k + bh * FIRST * N_HD, keys + bh * N_CAP * N_HD,
                   FIRST * N_HD * sizeof(double));
            memcpy(part_v + bh * FIRST * N_HD, values + bh * N_CAP * N_HD,
                   FIRST * N_HD * sizeof(double));
        }
        kvpt_assert_ok(kvp_cache_append_rows(cache, part_k, part_v, FIRST, &err), &err);
        kvpt_assert_pool_ok(pool);
        /* The rest one row at a time through the private append ([B, H, 1, d_h]). */
        for (size_t p = FIRST; p < N_CAP; p++) {
            double row_k[N_ROW];
            double row_v[N_ROW];
            for (size_t bh = 0; bh < N_BATCH * N_HEADS; bh++) {
                memcpy(row_k + bh * N_HD, keys + (bh * N_CAP + p) * N_HD, N_HD * sizeof(double));
                memcpy(row_v + bh * N_HD, values + (bh * N_CAP + p) * N_HD,
                       N_HD * sizeof(double));
            }
            kvp_tensor k = kvp_tensor4(row_k, N_BATCH, N_HEADS, 1, N_HD);
            kvp_tensor v = kvp_tensor4(row_v, N_BATCH, N_HEADS, 1, N_HD);
            kvpt_assert_ok(kvpi_cache_append(cache, &k, &v, &err), &err);
            kvpt_assert_pool_ok(pool);
        }
        double out_k[N_KV];
        double out_v[N_KV];
        kvpt_assert_ok(kvp_cache_keys(cache, out_k, N_KV, &err), &err);
        kvpt_assert_ok(kvp_cache_values(cache, out_v, N_KV, &err), &err);
        for (size_t lane = 0; lane < N_BATCH; lane++) {
            for (size_t h = 0; h < N_HEADS; h++) {
                for (size_t p = 0; p < N_CAP; p++) {
                    for (size_t i = 0; i < N_HD; i++) {
                        size_t at = ((lane * N_HEADS + h) * N_CAP + p) * N_HD + i;
                        double ek = kvpi_dtype_round_scaled(dtype, k_scale, keys[at]);
                        double ev = kvpi_dtype_round_scaled(dtype, v_scale, values[at]);
                        assert_true(kvpt_same_bits(page_element(cache, pool, 0, lane, h, p, i), ek));
                        assert_true(kvpt_same_bits(page_element(cache, pool, 1, lane, h, p, i), ev));
                        assert_true(kvpt_same_bits(out_k[at], ek * k_scale));
                        assert_true(kvpt_same_bits(out_v[at], ev * v_scale));
                    }
                }
            }
        }
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
}

/* ---- refusals ------------------------------------------------------------------- */

/*
 * An element past the boundary is refused by the external append, the
 * reserved commit and the private append, with nothing changed (the commit
 * keeps its reservation); the largest accepted one is stored as the largest
 * finite element.
 */
static void test_narrow_appends_refuse_overflow_changing_nothing(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F16, KVP_FP8_E4M3};
    for (size_t t = 0; t < 2; t++) {
        kvp_dtype dtype = dtypes[t];
        int fp8 = dtype == KVP_FP8_E4M3;
        /* For fp8 at k_scale 0.5 and v_scale 2: keys above 232, values above 928. */
        double key_limit = fp8 ? 232.0 : KVPI_F16_OVERFLOW;
        double value_limit = fp8 ? 928.0 : KVPI_F16_OVERFLOW;
        kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, N_BATCH * 4, dtype);
        kvp_cache *cache = scaled_cache(pool, 0.5, 2.0, N_BATCH);
        double key[N_ROW];
        double value[N_ROW];
        uint64_t seed = 11;
        kvp_error err;
        for (size_t p = 0; p < N_BT; p++) { /* a full block: the next append takes pages */
            random_rows(key, N_ROW, &seed);
            random_rows(value, N_ROW, &seed);
            kvpt_assert_ok(kvp_cache_append_rows(cache, key, value, 1, &err), &err);
        }
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_cache(&before, cache);
        kvpt_snapshot_take(&before);
        double bad_key = fp8 ? nextafter(key_limit, INFINITY) : key_limit;
        double bad_value = fp8 ? nextafter(value_limit, INFINITY) : value_limit;

        key[6] = -bad_key;
        memset(&err, 0, sizeof err);
        assert_int_equal(kvp_cache_append_rows(cache, key, value, 1, &err), KVP_NONFINITE_KEY);
        assert_string_equal(err.what, kvp_dtype_name(dtype));
        assert_int_equal(err.index, 6);
        assert_true(kvpt_same_bits(err.value, -bad_key));
        kvpt_assert_unchanged(&before, 0);
        char text[200];
        snprintf(text, sizeof text, "appended key value at flat index 6 must be finite in %s "
                 "storage, got %s", kvp_dtype_name(dtype),
                 fp8 ? "-232.00000000000003" : "-65520.0");
        kvpt_assert_error_text(&err, text);
        kvp_tensor k = kvp_tensor4(key, N_BATCH, N_HEADS, 1, N_HD);
        kvp_tensor v = kvp_tensor4(value, N_BATCH, N_HEADS, 1, N_HD);
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_KEY);
        assert_int_equal(err.index, 6);
        kvpt_assert_unchanged(&before, 0);
        key[6] = fp8 ? -key_limit : nextafter(-key_limit, 0.0);
        value[N_ROW - 1] = bad_value;
        assert_int_equal(kvp_cache_append_rows(cache, key, value, 1, &err), KVP_NONFINITE_VALUE);
        assert_string_equal(err.what, kvp_dtype_name(dtype));
        assert_int_equal(err.index, N_ROW - 1);
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_VALUE);
        kvpt_assert_unchanged(&before, 0);
        /* Keys and values have their own scales: 233 is too big a key, not a value. */
        if (fp8) {
            value[0] = key_limit + 1.0;
            assert_int_equal(kvp_cache_append_rows(cache, key, value, 1, &err),
                             KVP_NONFINITE_VALUE);
            assert_int_equal(err.index, N_ROW - 1);
            value[0] = 0.5;
        }

        /* A reserved commit refuses the same and keeps its reservation. */
        kvpt_assert_ok(kvp_cache_reserve_rows(cache, 1, &err), &err);
        kvpt_snapshot reserved;
        kvpt_snapshot_init(&reserved, pool);
        kvpt_snapshot_add_cache(&reserved, cache);
        kvpt_snapshot_take(&reserved);
        assert_int_equal(kvp_cache_commit_rows(cache, key, value, 1, &err), KVP_NONFINITE_VALUE);
        kvpt_assert_unchanged(&reserved, 0);
        assert_int_equal(kvp_cache_reserved_rows(cache), 1);

        /* The largest accepted elements: stored as the largest finite element. */
        value[N_ROW - 1] = fp8 ? value_limit : nextafter(value_limit, 0.0);
        kvpt_assert_ok(kvp_cache_commit_rows(cache, key, value, 1, &err), &err);
        kvpt_assert_pool_ok(pool);
        double keys[N_KV];
        double values[N_KV];
        kvpt_assert_ok(kvp_cache_keys(cache, keys, N_KV, &err), &err);
        kvpt_assert_ok(kvp_cache_values(cache, values, N_KV, &err), &err);
        size_t len = N_BT + 1;
        /* key[6]: lane 0, head 1, feature 1; value[N_ROW - 1]: lane 1, head 1, feature 4. */
        double top_k = fp8 ? 448.0 * 0.5 : KVPI_F16_MAX;
        double top_v = fp8 ? 448.0 * 2.0 : KVPI_F16_MAX;
        assert_true(kvpt_same_bits(keys[((0 * N_HEADS + 1) * len + N_BT) * N_HD + 1], -top_k));
        assert_true(kvpt_same_bits(values[((1 * N_HEADS + 1) * len + N_BT) * N_HD + 4], top_v));
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
}

enum { P_HEADS = 2, P_HD = 4, P_D = P_HEADS * P_HD, P_CAP = 6 };

/* Identity W_q, W_k, W_v and W_o. */
static kvp_layer *identity_layer(void)
{
    static double eye[P_D * P_D];
    memset(eye, 0, sizeof eye);
    for (size_t i = 0; i < P_D; i++) {
        eye[i * P_D + i] = 1.0;
    }
    const double *const w[KVP_PARAM_COUNT] = {eye, eye, eye, eye};
    return kvpt_layer_from_matrices(P_D, w, P_HEADS, P_CAP, 10000.0);
}

/*
 * prepare and kvp_attention_reference_stored refuse an element beyond the
 * dtype the same way, the fp8 one under the layer's scales (captured by the
 * cache), with nothing changed; a value that only the scale makes too big
 * shows the scale is used.
 */
static void test_narrow_prepare_and_reference_refuse_overflow(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F16, KVP_FP8_E4M3};
    for (size_t t = 0; t < 2; t++) {
        kvp_dtype dtype = dtypes[t];
        kvp_layer *layer = identity_layer();
        kvp_error err;
        /* Keys over 0.25 * 464 = 116 are refused by fp8; f16 ignores the scales. */
        kvpt_assert_ok(kvp_layer_set_kv_scales(layer, 0.25, 4.0, &err), &err);
        kvp_binding binding;
        kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
        assert_true(binding.k_scale == 0.25 && binding.v_scale == 4.0);
        kvp_pool *pool = kvpt_dtype_pool(2, P_HEADS, P_HD, 4, dtype);
        kvp_cache *cache = kvpt_cache(pool, &binding, 1, P_CAP);
        kvp_ticket *ticket = kvpt_ticket(cache);
        /* Token 0 (position 0: no rotation), flat index 5 (head 1, feature 1). */
        double x[P_D] = {0.5, -0.25, 0.0, 1.0, 0.75, 0.0, -1.0, 0.125};
        x[5] = dtype == KVP_FP8_E4M3 ? 117.0 : 65520.0;
        kvp_tensor input = kvp_tensor3(x, 1, 1, P_D);
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_cache(&before, cache);
        kvpt_snapshot_add_ticket(&before, ticket);
        kvpt_snapshot_take(&before);
        assert_int_equal(kvp_attention_prepare(layer, &input, cache, ticket, &err),
                         KVP_NONFINITE_KEY);
        assert_string_equal(err.what, kvp_dtype_name(dtype));
        assert_int_equal(err.index, 5);
        assert_true(kvpt_same_bits(err.value, x[5]));
        kvpt_assert_unchanged(&before, 0);
        double out[P_D];
        kvpt_fill(out, P_D, 7.0);
        kvp_error ref_err;
        assert_int_equal(kvp_attention_reference_stored(layer, dtype, &input, out, P_D, NULL,
                                                        NULL, 0, &ref_err),
                         KVP_NONFINITE_KEY);
        assert_string_equal(ref_err.what, kvp_dtype_name(dtype));
        assert_int_equal(ref_err.index, 5);
        assert_int_equal(ref_err.token, 0);
        kvpt_assert_filled(out, P_D, 7.0);
        /* Under scale 1 the fp8 key 117 is storable: the scale made the difference. */
        if (dtype == KVP_FP8_E4M3) {
            kvpt_assert_ok(kvp_layer_set_kv_scales(layer, 1.0, 4.0, &err), &err);
            kvpt_assert_ok(kvp_attention_reference_stored(layer, dtype, &input, out, P_D, NULL,
                                                          NULL, 0, &ref_err),
                           &ref_err);
        }
        kvpt_destroy_ticket(ticket, pool);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
        kvpt_destroy_layer(layer);
    }
}

/* Scales that are not finite, normal and > 0 are refused, by caches and layers, changing nothing. */
static void test_narrow_scales_are_validated(void **state)
{
    (void)state;
    static const double bad[] = {-1.0, NAN, INFINITY, -INFINITY, 0x1p-1030, -0x1p-1022};
    kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 4, KVP_FP8_E4M3);
    kvp_binding good;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&good, N_HEADS, N_HD, N_CAP, 3, 0, &err), &err);
    kvp_layer *layer = identity_layer();
    kvp_binding layer_before;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &layer_before, &err), &err);
    assert_true(layer_before.k_scale == 1.0 && layer_before.v_scale == 1.0);
    kvpt_snapshot before;
    kvpt_snapshot_init(&before, pool);
    kvpt_snapshot_take(&before);
    for (size_t i = 0; i < KVPT_COUNT_OF(bad); i++) {
        for (int which = 0; which < 2; which++) {
            kvp_binding b = good;
            *(which ? &b.v_scale : &b.k_scale) = bad[i];
            kvp_cache *untouched = (kvp_cache *)&b;
            assert_int_equal(kvp_cache_create(pool, &b, 1, N_CAP, &untouched, &err),
                             KVP_INVALID_ARGUMENT);
            assert_string_equal(err.argument, which ? "v_scale" : "k_scale");
            assert_ptr_equal(untouched, (kvp_cache *)&b);
            kvpt_assert_unchanged(&before, 0);
            double k = which ? 1.0 : bad[i];
            double v = which ? bad[i] : 1.0;
            assert_int_equal(kvp_layer_set_kv_scales(layer, k, v, &err), KVP_INVALID_ARGUMENT);
            assert_string_equal(err.argument, which ? "v_scale" : "k_scale");
            kvp_binding now;
            kvpt_assert_ok(kvp_layer_binding_get(layer, &now, &err), &err);
            assert_memory_equal(&now, &layer_before, sizeof now);
        }
    }
    /* Both bad: k_scale is named first. A bad geometry comes before any scale. */
    kvp_binding both = good;
    both.k_scale = NAN;
    both.v_scale = -2.0;
    kvp_cache *cache = NULL;
    assert_int_equal(kvp_cache_create(pool, &both, 1, N_CAP, &cache, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "k_scale");
    kvpt_assert_error_text(&err, "argument `k_scale` is invalid: must be finite, normal and > 0 "
                                 "(or 0: 1.0)");
    both.kv_heads = 0;
    assert_int_equal(kvp_cache_create(pool, &both, 1, N_CAP, &cache, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "binding");
    assert_int_equal(kvp_layer_set_kv_scales(NULL, 1.0, 1.0, &err), KVP_NULL_ARGUMENT);
    /* 0 means 1.0: kept as given in the binding, used as 1.0. */
    kvp_binding zero = good;
    zero.k_scale = 0.0;
    zero.v_scale = 0.0;
    cache = kvpt_cache(pool, &zero, 1, N_CAP);
    kvp_cache_info info;
    kvp_cache_info_init(&info);
    kvpt_assert_ok(kvp_cache_info_get(cache, &info, &err), &err);
    assert_true(info.binding.k_scale == 0.0 && info.binding.v_scale == 0.0);
    double k;
    double v;
    kvpi_cache_kv_scales(cache, &k, &v);
    assert_true(k == 1.0 && v == 1.0);
    kvp_cache *ones = kvpt_cache(pool, &good, 1, N_CAP);
    kvp_block_key zero_key;
    kvp_block_key ones_key;
    kvpt_assert_ok(kvp_cache_binding_key(cache, &zero_key, &err), &err);
    kvpt_assert_ok(kvp_cache_binding_key(ones, &ones_key, &err), &err);
    assert_true(zero_key.lo == ones_key.lo && zero_key.hi == ones_key.hi);
    /* The smallest normal and the largest finite scales are fine. */
    kvpt_assert_ok(kvp_layer_set_kv_scales(layer, DBL_MIN, DBL_MAX, &err), &err);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_cache(ones, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

/* ---- sharing, audit, digests ------------------------------------------------------ */

/* Appends `rows` rows of `seed`'s data to every lane of `cache`. */
static void append_seeded(kvp_cache *cache, size_t batch, size_t rows, uint64_t seed)
{
    size_t n = batch * N_HEADS * rows * N_HD;
    double *keys = kvpt_doubles(n);
    double *values = kvpt_doubles(n);
    random_rows(keys, n, &seed);
    random_rows(values, n, &seed);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_append_rows(cache, keys, values, rows, &err), &err);
    free(keys);
    free(values);
}

/* Destroys a pool whose published pages wait, evictable, on its LRU list. */
static void destroy_shared_pool(kvp_pool *pool)
{
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats stats = kvpt_stats(pool);
    assert_int_equal(stats.held_pages, 0);
    assert_int_equal(stats.free_pages + stats.evictable_pages, stats.total_pages);
    kvp_error err;
    kvpt_assert_ok(kvp_pool_destroy(pool, &err), &err);
}

/* The chain key of `cache`'s block 0 over fixed input bytes. */
static kvp_block_key block0_key(const kvp_cache *cache)
{
    static const char input[] = "the same prompt block";
    kvp_block_key key;
    kvp_error err;
    kvpt_assert_ok(kvp_block_key_chain(NULL, cache, input, sizeof input, NULL, &key, &err), &err);
    return key;
}

static int same_key(kvp_block_key a, kvp_block_key b)
{
    return a.lo == b.lo && a.hi == b.hi;
}

/*
 * fp8 caches under other scales have other binding digests: their keys miss
 * a block published under different scales, and a key carried over is
 * refused (BLOCK_BINDING_MISMATCH, nothing changed); a cache of the same
 * scales adopts it. An f16 pool ignores the scales: the digests agree.
 */
static void test_narrow_other_scales_never_share_blocks(void **state)
{
    (void)state;
    kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 16, KVP_FP8_E4M3);
    kvp_cache *publisher = scaled_cache(pool, 0.5, 2.0, 1);
    kvp_cache *other_k = scaled_cache(pool, 0.25, 2.0, 1);
    kvp_cache *other_v = scaled_cache(pool, 0.5, 0x1.0000000000001p+1, 1);
    kvp_cache *same = scaled_cache(pool, 0.5, 2.0, 1);
    append_seeded(publisher, 1, N_BT, 5);
    kvp_block_key key = block0_key(publisher);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_publish_block(publisher, 0, 0, &key, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_cache *const others[2] = {other_k, other_v};
    for (size_t i = 0; i < 2; i++) {
        kvp_block_key mine = block0_key(others[i]);
        assert_false(same_key(mine, key));
        size_t adopted = 99;
        kvpt_assert_ok(kvp_cache_adopt_prefix(others[i], &mine, 1, &adopted, &err), &err);
        assert_int_equal(adopted, 0);
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_cache(&before, others[i]);
        kvpt_snapshot_take(&before);
        assert_int_equal(kvp_cache_adopt_prefix(others[i], &key, 1, &adopted, &err),
                         KVP_BLOCK_BINDING_MISMATCH);
        kvpt_assert_unchanged(&before, 0);
        assert_int_equal(kvp_cache_len(others[i]), 0);
    }
    kvp_block_key same_scales = block0_key(same);
    assert_true(same_key(same_scales, key));
    size_t adopted = 0;
    kvpt_assert_ok(kvp_cache_adopt_prefix(same, &same_scales, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 1);
    assert_int_equal(kvpt_stats(pool).prefix_hits, 1);
    kvpt_assert_pool_ok(pool);
    kvp_cache *const all[4] = {publisher, other_k, other_v, same};
    for (size_t i = 0; i < 4; i++) {
        kvpt_destroy_cache(all[i], pool);
    }
    destroy_shared_pool(pool);

    /* f16: the scales mean nothing, the binding digests agree, the block is shared. */
    kvp_pool *half = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 16, KVP_F16);
    kvp_cache *a = scaled_cache(half, 0.5, 2.0, 1);
    kvp_cache *b = scaled_cache(half, 1.0, 1.0, 1);
    append_seeded(a, 1, N_BT, 5);
    kvp_block_key ka = block0_key(a);
    assert_true(same_key(ka, block0_key(b)));
    kvpt_assert_ok(kvp_cache_publish_block(a, 0, 0, &ka, &err), &err);
    kvpt_assert_ok(kvp_cache_adopt_prefix(b, &ka, 1, &adopted, &err), &err);
    assert_int_equal(adopted, 1);
    kvpt_assert_pool_ok(half);
    kvpt_destroy_cache(a, half);
    kvpt_destroy_cache(b, half);
    destroy_shared_pool(half);
}

/*
 * Appends, a fork mid-block and the copy-on-write appends of both sides on
 * f16 and fp8 pools: the audit passes after each, the copies are counted,
 * and each side reads the shared rows as before plus its own new ones.
 */
static void test_narrow_audit_after_fork_and_copy_on_write(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F16, KVP_FP8_E4M3};
    for (size_t t = 0; t < 2; t++) {
        kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 4 * N_BATCH, dtypes[t]);
        kvp_cache *parent = scaled_cache(pool, 0.5, 3.0, N_BATCH);
        append_seeded(parent, N_BATCH, N_BT + 2, 70);
        kvpt_assert_pool_ok(pool);
        double before_keys[N_KV];
        double before_values[N_KV];
        kvp_error err;
        kvpt_assert_ok(kvp_cache_keys(parent, before_keys, N_KV, &err), &err);
        kvpt_assert_ok(kvp_cache_values(parent, before_values, N_KV, &err), &err);
        kvp_cache *child = NULL;
        kvpt_assert_ok(kvp_cache_fork(parent, &child, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_cache_info info;
        kvp_cache_info_init(&info);
        kvpt_assert_ok(kvp_cache_info_get(child, &info, &err), &err);
        assert_true(info.binding.k_scale == 0.5 && info.binding.v_scale == 3.0);
        append_seeded(child, N_BATCH, 1, 71);
        kvpt_assert_pool_ok(pool);
        append_seeded(parent, N_BATCH, 1, 72);
        kvpt_assert_pool_ok(pool);
        assert_int_equal(kvpt_stats(pool).cow_copies, 2 * N_BATCH);
        kvp_cache *const sides[2] = {parent, child};
        double keys[N_KV];
        double values[N_KV];
        for (size_t s = 0; s < 2; s++) {
            kvpt_assert_ok(kvp_cache_keys(sides[s], keys, N_KV, &err), &err);
            kvpt_assert_ok(kvp_cache_values(sides[s], values, N_KV, &err), &err);
            size_t len = N_BT + 3;
            for (size_t bh = 0; bh < N_BATCH * N_HEADS; bh++) {
                size_t old = (N_BT + 2) * N_HD;
                assert_memory_equal(keys + bh * len * N_HD, before_keys + bh * old,
                                    old * sizeof(double));
                assert_memory_equal(values + bh * len * N_HD, before_values + bh * old,
                                    old * sizeof(double));
            }
        }
        kvpt_destroy_cache(child, pool);
        kvpt_assert_pool_ok(pool);
        kvpt_destroy_cache(parent, pool);
        kvpt_destroy_pool(pool);
    }
}

/* kvp_cache_digest tells dtypes apart, and fp8 scales, even when the stored bytes agree. */
static void test_narrow_digests_differ_by_dtype_and_scales(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    uint64_t digests[5];
    kvp_error err;
    for (size_t i = 0; i < 5; i++) {
        /* Empty caches: the same length, capacity and (no) rows. */
        kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 4, dtypes[i]);
        kvp_cache *cache = scaled_cache(pool, 1.0, 1.0, 1);
        kvpt_assert_ok(kvp_cache_digest(cache, &digests[i], &err), &err);
        for (size_t j = 0; j < i; j++) {
            assert_true(digests[i] != digests[j]);
        }
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
    /* Zero rows in fresh fp8 pools: the same bytes and page ids, under scales 1, 2 and 1. */
    static const double k_scales[3] = {1.0, 2.0, 1.0};
    uint64_t fp8[3];
    for (size_t i = 0; i < 3; i++) {
        kvp_pool *pool = kvpt_dtype_pool(N_BT, N_HEADS, N_HD, 4, KVP_FP8_E4M3);
        kvp_cache *cache = scaled_cache(pool, k_scales[i], 1.0, 1);
        double zeros[N_HEADS * N_HD] = {0};
        kvpt_assert_ok(kvp_cache_append_rows(cache, zeros, zeros, 1, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvpt_assert_ok(kvp_cache_digest(cache, &fp8[i], &err), &err);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
    assert_true(fp8[0] == fp8[2]);
    assert_true(fp8[0] != fp8[1]);
}

/* ---- error bounds of the stored-dtype reference ----------------------------------- */

/*
 * The error of kvp_attention_reference_stored against the f64 reference,
 * max |y - y_f64| / max |y_f64| over a run, on 32 random geometries (as
 * test_dtype.c): f16; fp8 at scale 1; fp8 with per-layer scales calibrated
 * as engines do (max |K| / 448 and max |V| / 448 of the run's f64 K/V).
 * The exported K and V are e * scale (as kvp_cache_keys gives them).
 */
static void test_narrow_reference_error_against_f64_is_bounded(void **state)
{
    (void)state;
    uint64_t seed = 4242;
    double worst[3] = {0.0, 0.0, 0.0};
    for (size_t run = 0; run < 32; run++) {
        size_t batch = 1 + kvpt_rand_next(&seed) % 3;
        size_t heads = 1 + kvpt_rand_next(&seed) % 4;
        size_t hd = 2 * (1 + kvpt_rand_next(&seed) % 32);
        size_t tokens = 1 + kvpt_rand_next(&seed) % 48;
        size_t d = heads * hd;
        size_t rows = batch * tokens * d;
        kvp_layer *layer = kvpt_random_layer(d, heads, tokens, 10000.0, 600 + run);
        double *input = kvpt_doubles(rows);
        kvpt_fill_random(input, rows, 1600 + run);
        kvp_tensor whole = kvp_tensor3(input, batch, tokens, d);
        double *ref = kvpt_doubles(rows);
        double *ref_k = kvpt_doubles(rows);
        double *ref_v = kvpt_doubles(rows);
        double *out = kvpt_doubles(rows);
        double *out_k = kvpt_doubles(rows);
        double *out_v = kvpt_doubles(rows);
        kvp_error err;
        kvpt_assert_ok(kvp_attention_reference(layer, &whole, ref, rows, ref_k, ref_v, rows, &err),
                       &err);
        double scale = 0.0;
        double amax_k = 0.0;
        double amax_v = 0.0;
        for (size_t i = 0; i < rows; i++) {
            scale = fmax(scale, fabs(ref[i]));
            amax_k = fmax(amax_k, fabs(ref_k[i]));
            amax_v = fmax(amax_v, fabs(ref_v[i]));
        }
        for (size_t c = 0; c < 3; c++) {
            kvp_dtype dtype = c == 0 ? KVP_F16 : KVP_FP8_E4M3;
            double ks = c == 2 ? amax_k / 448.0 : 1.0;
            double vs = c == 2 ? amax_v / 448.0 : 1.0;
            kvpt_assert_ok(kvp_layer_set_kv_scales(layer, ks, vs, &err), &err);
            kvpt_assert_ok(kvp_attention_reference_stored(layer, dtype, &whole, out, rows, out_k,
                                                          out_v, rows, &err),
                           &err);
            worst[c] = fmax(worst[c], kvpt_max_abs_diff(out, ref, rows) / scale);
            for (size_t i = 0; i < rows; i++) {
                /* Exported: the stored element times its scale. */
                double ek = kvpi_dtype_round_scaled(dtype, ks, ref_k[i]);
                double ev = kvpi_dtype_round_scaled(dtype, vs, ref_v[i]);
                assert_true(kvpt_same_bits(out_k[i], dtype == KVP_F16 ? ek : ek * ks));
                assert_true(kvpt_same_bits(out_v[i], dtype == KVP_F16 ? ev : ev * vs));
            }
        }
        free(input);
        free(ref);
        free(ref_k);
        free(ref_v);
        free(out);
        free(out_k);
        free(out_v);
        kvpt_destroy_layer(layer);
    }
    printf("# error against f64 over 32 random geometries: f16 %.3e (bound %.0e), fp8 e4m3 "
           "scale 1 %.3e, calibrated scales %.3e (bound %.0e)\n",
           worst[0], F16_BOUND, worst[1], worst[2], FP8_BOUND);
    assert_true(worst[0] > 0.0 && worst[0] <= F16_BOUND);
    assert_true(worst[1] > worst[0] && worst[1] <= FP8_BOUND);
    assert_true(worst[2] > worst[0] && worst[2] <= FP8_BOUND);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_narrow_pool_geometry_stats_layout),
        cmocka_unit_test(test_narrow_caches_store_elements_and_export_values),
        cmocka_unit_test(test_narrow_appends_refuse_overflow_changing_nothing),
        cmocka_unit_test(test_narrow_prepare_and_reference_refuse_overflow),
        cmocka_unit_test(test_narrow_scales_are_validated),
        cmocka_unit_test(test_narrow_other_scales_never_share_blocks),
        cmocka_unit_test(test_narrow_audit_after_fork_and_copy_on_write),
        cmocka_unit_test(test_narrow_digests_differ_by_dtype_and_scales),
        cmocka_unit_test(test_narrow_reference_error_against_f64_is_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
