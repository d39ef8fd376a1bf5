/*
 * test_dtype.c: storage precision chosen per pool (kvp_dtype, kvpager/pool.h).
 *
 * Proves: the conversion rules of src/pager/dtype.h (f32 by the C cast, bf16
 * rounded once from f64, both to nearest even, subnormals kept, -0 kept, the
 * overflow boundaries exact), checked against a rounding written out here
 * from first principles on 200000 random values of every magnitude; pool
 * geometry, stats and the validation order of the dtype; caches store the
 * rounded rows, snapshots widen them exactly and digests see the stored
 * bytes; an element the dtype cannot hold is refused, by the raw append,
 * prepare and the stored-dtype reference alike, with nothing changed;
 * incremental attention equals kvp_attention_reference_stored bit for bit
 * for f64, f32 and bf16, at every ISA level and block_tokens 1, 3 and 16,
 * and the results are the same bits across levels and block sizes; and the
 * error against the f64 reference on unit-scale random data stays within the
 * bounds docs/DESIGN.md states (the measured maxima are printed).
 * Every test audits its pools (kvp_pool_check) after each operation.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <valgrind/valgrind.h>

#include "support.h"

#include "attention/kernels.h"
#include "pager/cache_internal.h"
#include "pager/dtype.h"

static const kvp_dtype all_dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};

/* The bounds of docs/DESIGN.md ("Storage precision"): error / largest |f64 output| of a run. */
#define F32_BOUND 1e-5
#define BF16_BOUND 1e-2

/* ---- conversions ------------------------------------------------------------ */

static double bf16(double x)
{
    return kvpi_bf16_to_f64(kvpi_bf16_from_f64(x));
}

static double f32(double x)
{
    return (double)kvpi_f32_from_f64(x);
}

static void test_dtype_names_and_sizes(void **state)
{
    (void)state;
    assert_string_equal(kvp_dtype_name(KVP_F64), "f64");
    assert_string_equal(kvp_dtype_name(KVP_F32), "f32");
    assert_string_equal(kvp_dtype_name(KVP_BF16), "bf16");
    assert_string_equal(kvp_dtype_name(KVP_F16), "f16");
    assert_string_equal(kvp_dtype_name(KVP_FP8_E4M3), "fp8_e4m3");
    assert_string_equal(kvp_dtype_name((kvp_dtype)5), "unknown");
    assert_int_equal(kvp_dtype_bytes(KVP_F64), 8);
    assert_int_equal(kvp_dtype_bytes(KVP_F32), 4);
    assert_int_equal(kvp_dtype_bytes(KVP_BF16), 2);
    assert_int_equal(kvp_dtype_bytes(KVP_F16), 2);
    assert_int_equal(kvp_dtype_bytes(KVP_FP8_E4M3), 1);
    assert_int_equal(kvp_dtype_bytes((kvp_dtype)5), 0);
    assert_int_equal(kvp_dtype_bytes((kvp_dtype)-1), 0);
    assert_int_equal(KVP_F64, 0);
    assert_int_equal(KVP_F32, 1);
    assert_int_equal(KVP_BF16, 2);
    assert_int_equal(KVP_F16, 3);
    assert_int_equal(KVP_FP8_E4M3, 4);
    kvp_pool_config config;
    memset(&config, 0xff, sizeof config);
    kvp_pool_config_init(&config);
    assert_int_equal(config.dtype, KVP_F64);
}

static void test_dtype_conversion_edge_cases(void **state)
{
    (void)state;
    /* f32: ties to even, subnormals, the overflow boundary, -0. */
    assert_true(kvpt_same_bits(f32(1.0 + 0x1p-24), 1.0));
    assert_true(kvpt_same_bits(f32(1.0 + 0x3p-24), 1.0 + 0x1p-22));
    assert_true(kvpt_same_bits(f32(1.0 + 0x1p-24 + 0x1p-50), 1.0 + 0x1p-23));
    assert_true(kvpt_same_bits(f32(0x1p-150), 0.0));
    assert_true(kvpt_same_bits(f32(0x3p-150), 0x1p-148));
    assert_true(kvpt_same_bits(f32(0x1.8p-149), 0x1p-148));
    assert_true(kvpt_same_bits(f32(-0x1p-151), -0.0));
    assert_true(kvpt_same_bits(f32(-0.0), -0.0));
    assert_true(kvpt_same_bits(f32(0x1.fffffe8p+127), (double)FLT_MAX)); /* below the midpoint */
    assert_false(kvpi_dtype_overflows(KVP_F32, nextafter(KVPI_F32_OVERFLOW, 0.0)));
    assert_true(kvpt_same_bits(f32(nextafter(KVPI_F32_OVERFLOW, 0.0)), (double)FLT_MAX));
    assert_true(kvpi_dtype_overflows(KVP_F32, KVPI_F32_OVERFLOW));
    assert_true(kvpi_dtype_overflows(KVP_F32, -KVPI_F32_OVERFLOW));
    assert_true(kvpi_dtype_overflows(KVP_F32, DBL_MAX));
    assert_false(kvpi_dtype_overflows(KVP_F32, INFINITY)); /* not finite: not its business */
    assert_false(kvpi_dtype_overflows(KVP_F32, NAN));
    assert_false(kvpi_dtype_overflows(KVP_F64, DBL_MAX));

    /* bf16: ties to even, rounding once (not through f32), carries, subnormals, -0. */
    assert_true(kvpt_same_bits(bf16(1.0 + 0x1p-8), 1.0));
    assert_true(kvpt_same_bits(bf16(1.0 + 0x3p-8), 1.0 + 0x1p-6));
    /* f32 would round this to the tie 1 + 2^-8, which then goes to 1.0: twice rounded. */
    double twice = 1.0 + 0x1p-8 + 0x1p-30;
    assert_true(kvpt_same_bits((double)(float)twice, 1.0 + 0x1p-8));
    assert_true(kvpt_same_bits(bf16(twice), 1.0 + 0x1p-7));
    assert_true(kvpt_same_bits(bf16(0x1.ff8p0), 2.0));
    assert_true(kvpt_same_bits(bf16(-1.0 - 0x3p-8), -1.0 - 0x1p-6));
    assert_true(kvpt_same_bits(bf16(0x1p-133), 0x1p-133)); /* the smallest subnormal */
    assert_true(kvpt_same_bits(bf16(0x1p-134), 0.0));
    assert_true(kvpt_same_bits(bf16(0x1.8p-134), 0x1p-133));
    assert_true(kvpt_same_bits(bf16(0x3p-134), 0x1p-132));
    assert_true(kvpt_same_bits(bf16(0x1.fcp-127 + 0x1p-134), 0x1p-126)); /* up into the normals */
    assert_true(kvpt_same_bits(bf16(-0x1p-140), -0.0));
    assert_int_equal(kvpi_bf16_from_f64(-0.0), 0x8000);
    assert_int_equal(kvpi_bf16_from_f64(0.0), 0x0000);
    assert_int_equal(kvpi_bf16_from_f64(1.0), 0x3F80);
    assert_int_equal(kvpi_bf16_from_f64(-2.0), 0xC000);
    assert_int_equal(kvpi_bf16_from_f64(INFINITY), 0x7F80);
    assert_true(kvpt_same_bits(bf16(0x1.fep+127), 0x1.fep+127)); /* the largest finite bf16 */
    assert_false(kvpi_dtype_overflows(KVP_BF16, nextafter(KVPI_BF16_OVERFLOW, 0.0)));
    assert_true(kvpt_same_bits(bf16(nextafter(KVPI_BF16_OVERFLOW, 0.0)), 0x1.fep+127));
    assert_true(kvpi_dtype_overflows(KVP_BF16, KVPI_BF16_OVERFLOW));
    assert_true(kvpi_dtype_overflows(KVP_BF16, -KVPI_BF16_OVERFLOW));
    assert_false(kvpi_dtype_overflows(KVP_F32, KVPI_BF16_OVERFLOW)); /* f32 holds it */
    assert_true(kvpt_same_bits(kvpi_bf16_widen(0x3F80), 1.0));

    /* Round trips through a store and a load, and f64 stores exactly. */
    double in[4] = {1.0 + 0x3p-8, -0.0, 0x1p-134, 1.0 / 3.0};
    uint16_t h[4];
    float f[4];
    double back[4];
    kvpi_dtype_store(KVP_BF16, h, in, 4);
    kvpi_dtype_load(KVP_BF16, h, back, 4);
    for (size_t i = 0; i < 4; i++) {
        assert_true(kvpt_same_bits(back[i], bf16(in[i])));
        assert_true(kvpt_same_bits(kvpi_dtype_round(KVP_BF16, in[i]), bf16(in[i])));
    }
    kvpi_dtype_store(KVP_F32, f, in, 4);
    kvpi_dtype_load(KVP_F32, f, back, 4);
    for (size_t i = 0; i < 4; i++) {
        assert_true(kvpt_same_bits(back[i], f32(in[i])));
    }
    double copy[4];
    kvpi_dtype_store(KVP_F64, copy, in, 4);
    assert_memory_equal(copy, in, sizeof in);
    assert_true(kvpt_same_bits(kvpi_dtype_round(KVP_F64, 1.0 / 3.0), 1.0 / 3.0));
}

static void test_dtype_conversion_matches_definition(void **state)
{
    (void)state;
    uint64_t seed = 1234567;
    size_t ties = 0;
    for (size_t i = 0; i < 200000; i++) {
        /* Exponents over both formats' whole range, subnormals included. */
        double m = 1.0 + kvpt_rand_unit(&seed) * 0.5 + 0.5;
        int e = (int)(kvpt_rand_next(&seed) % 290) - 155;
        double x = ldexp(m, e);
        if (i % 7 == 0) {
            /* An exact tie of bf16 or f32, where only the even rule decides. */
            uint64_t bits = kvpi_f64_bits(x);
            int shift = i % 2 ? 44 : 28;
            bits = (bits & ~(((uint64_t)1 << (shift + 1)) - 1)) | ((uint64_t)1 << shift);
            x = kvpi_f64_from_bits(bits);
            ties++;
        }
        if (i % 2) {
            x = -x;
        }
        if (!kvpi_dtype_overflows(KVP_BF16, x)) {
            double want = kvpt_round_to_format(x, 8, -126);
            if (!kvpt_same_bits(bf16(x), want)) {
                print_error("bf16(%a) = %a, expected %a\n", x, bf16(x), want);
                fail();
            }
        }
        if (!kvpi_dtype_overflows(KVP_F32, x)) {
            double want = kvpt_round_to_format(x, 24, -126);
            if (!kvpt_same_bits(f32(x), want)) {
                print_error("f32(%a) = %a, expected %a\n", x, f32(x), want);
                fail();
            }
        }
    }
    assert_true(ties > 20000);
}

/* ---- pools and caches ----------------------------------------------------------- */

static void test_dtype_pool_geometry_and_stats(void **state)
{
    (void)state;
    size_t budget = 1 << 20;
    size_t pages[3];
    for (size_t i = 0; i < 3; i++) {
        kvp_dtype dtype = all_dtypes[i];
        kvp_pool_config config;
        kvp_pool_config_init(&config);
        config.block_tokens = 16;
        config.heads = 4;
        config.head_width = 32;
        config.budget_bytes = budget;
        config.dtype = dtype;
        kvp_pool *pool = NULL;
        kvp_error err;
        kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_pool_stats stats = kvpt_stats(pool);
        assert_int_equal(stats.dtype, dtype);
        assert_int_equal(stats.element_bytes, kvp_dtype_bytes(dtype));
        assert_int_equal(stats.page_bytes, 2 * 4 * 16 * 32 * kvp_dtype_bytes(dtype));
        assert_int_equal(stats.total_pages, budget / stats.page_bytes);
        assert_int_equal(stats.slab_bytes, stats.total_pages * stats.page_bytes);
        pages[i] = stats.total_pages;
        kvpt_destroy_pool(pool);
    }
    assert_int_equal(pages[1], 2 * pages[0]);
    assert_int_equal(pages[2], 4 * pages[0]);

    /* A bad dtype: INVALID_ARGUMENT "dtype", after ZERO_SIZE and before SIZE_OVERFLOW. */
    kvp_pool *untouched = (kvp_pool *)&budget;
    kvp_error err;
    kvp_pool_config bad;
    kvp_pool_config_init(&bad);
    bad.block_tokens = 16;
    bad.heads = 4;
    bad.head_width = 32;
    bad.budget_bytes = budget;
    bad.dtype = (kvp_dtype)5;
    assert_int_equal(kvp_pool_create(&bad, &untouched, &err), KVP_INVALID_ARGUMENT);
    assert_string_equal(err.argument, "dtype");
    kvpt_assert_error_text(&err,
                           "argument `dtype` is invalid: must be KVP_F64, KVP_F32, KVP_BF16, "
                           "KVP_F16 or KVP_FP8_E4M3");
    bad.heads = 0;
    assert_int_equal(kvp_pool_create(&bad, &untouched, &err), KVP_ZERO_SIZE);
    assert_string_equal(err.argument, "heads");
    kvp_pool_config huge;
    kvp_pool_config_init(&huge);
    huge.block_tokens = SIZE_MAX / 4;
    huge.heads = 2;
    huge.head_width = 2;
    huge.budget_bytes = 1 << 20;
    huge.dtype = (kvp_dtype)7;
    assert_int_equal(kvp_pool_create(&huge, &untouched, &err), KVP_INVALID_ARGUMENT);
    huge.dtype = KVP_BF16;
    assert_int_equal(kvp_pool_create(&huge, &untouched, &err), KVP_SIZE_OVERFLOW);
    /* A budget of one bf16 page is below one f64 page. */
    kvp_pool_config small;
    kvp_pool_config_init(&small);
    small.block_tokens = 4;
    small.heads = 2;
    small.head_width = 8;
    small.budget_bytes = 2 * 2 * 4 * 8 * 2;
    small.dtype = KVP_F64;
    assert_int_equal(kvp_pool_create(&small, &untouched, &err), KVP_BUDGET_TOO_SMALL);
    assert_int_equal(err.page_bytes, 2 * 2 * 4 * 8 * 8);
    small.dtype = KVP_BF16;
    kvp_pool *pool = NULL;
    kvpt_assert_ok(kvp_pool_create(&small, &pool, &err), &err);
    assert_int_equal(kvpt_stats(pool).total_pages, 1);
    kvpt_destroy_pool(pool);
    assert_ptr_equal(untouched, (kvp_pool *)&budget);
}

enum { C_HEADS = 2, C_HD = 5, C_BATCH = 2, C_CAP = 7, C_BT = 3 };

static void random_row(double *row, size_t n, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++) {
        row[i] = kvpt_rand_unit(seed) * ldexp(1.0, (int)(i % 9) * 4 - 16);
    }
}

static void test_dtype_cache_stores_rounded_rows(void **state)
{
    (void)state;
    enum { ROW = C_BATCH * C_HEADS * C_HD, KV = C_BATCH * C_HEADS * C_CAP * C_HD };
    kvp_binding binding = kvpt_binding(C_HEADS, C_HD, C_CAP);
    for (size_t i = 0; i < 3; i++) {
        kvp_dtype dtype = all_dtypes[i];
        kvp_pool *pool = kvpt_dtype_pool(C_BT, C_HEADS, C_HD, C_BATCH * 3, dtype);
        kvp_cache *cache = kvpt_cache(pool, &binding, C_BATCH, C_CAP);
        /* A twin cache in a pool of its own, fed rows that differ below the dtype's precision. */
        kvp_pool *twin_pool = kvpt_dtype_pool(C_BT, C_HEADS, C_HD, C_BATCH * 3, dtype);
        kvp_cache *twin = kvpt_cache(twin_pool, &binding, C_BATCH, C_CAP);
        double key[ROW];
        double value[ROW];
        double nudged_key[ROW];
        double expect_keys[C_CAP][ROW];
        double expect_values[C_CAP][ROW];
        uint64_t seed = 99 + i;
        for (size_t t = 0; t < C_CAP; t++) {
            random_row(key, ROW, &seed);
            random_row(value, ROW, &seed);
            for (size_t j = 0; j < ROW; j++) {
                expect_keys[t][j] = kvpi_dtype_round(dtype, key[j]);
                expect_values[t][j] = kvpi_dtype_round(dtype, value[j]);
                /* Half an f64 ulp of the dtype's precision away: rounds to the same element. */
                nudged_key[j] = dtype == KVP_F64 ? key[j]
                                                 : expect_keys[t][j] + ldexp(key[j], -30) * 0.25;
                assert_true(kvpt_same_bits(kvpi_dtype_round(dtype, nudged_key[j]),
                                      expect_keys[t][j]));
            }
            kvp_tensor k = kvp_tensor4(key, C_BATCH, C_HEADS, 1, C_HD);
            kvp_tensor v = kvp_tensor4(value, C_BATCH, C_HEADS, 1, C_HD);
            kvp_tensor nk = kvp_tensor4(nudged_key, C_BATCH, C_HEADS, 1, C_HD);
            kvp_error err;
            kvpt_assert_ok(kvpi_cache_append(cache, &k, &v, &err), &err);
            kvpt_assert_pool_ok(pool);
            kvpt_assert_ok(kvpi_cache_append(twin, &nk, &v, &err), &err);
            kvpt_assert_pool_ok(twin_pool);
        }
        /* Snapshots are the rounded rows, widened exactly, in [B, H, len, d_h]. */
        double keys[KV];
        double values[KV];
        kvp_error err;
        kvpt_assert_ok(kvp_cache_keys(cache, keys, KV, &err), &err);
        kvpt_assert_ok(kvp_cache_values(cache, values, KV, &err), &err);
        for (size_t b = 0; b < C_BATCH; b++) {
            for (size_t h = 0; h < C_HEADS; h++) {
                for (size_t t = 0; t < C_CAP; t++) {
                    size_t at = ((b * C_HEADS + h) * C_CAP + t) * C_HD;
                    size_t from = (b * C_HEADS + h) * C_HD;
                    assert_memory_equal(keys + at, &expect_keys[t][from], C_HD * sizeof(double));
                    assert_memory_equal(values + at, &expect_values[t][from],
                                        C_HD * sizeof(double));
                }
            }
        }
        /* The digests cover the stored bytes: the nudge is invisible below f64. */
        uint64_t d1 = 0;
        uint64_t d2 = 0;
        kvpt_assert_ok(kvp_cache_digest(cache, &d1, &err), &err);
        kvpt_assert_ok(kvp_cache_digest(twin, &d2, &err), &err);
        assert_true(d1 == d2);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_cache(twin, twin_pool);
        kvpt_destroy_pool(pool);
        kvpt_destroy_pool(twin_pool);
    }
}

/* ---- refusals ------------------------------------------------------------------- */

static void test_dtype_append_refuses_overflow_changing_nothing(void **state)
{
    (void)state;
    enum { ROW = C_BATCH * C_HEADS * C_HD };
    kvp_binding binding = kvpt_binding(C_HEADS, C_HD, C_CAP);
    for (size_t i = 1; i < 3; i++) {
        kvp_dtype dtype = all_dtypes[i];
        double limit = dtype == KVP_F32 ? KVPI_F32_OVERFLOW : KVPI_BF16_OVERFLOW;
        kvp_pool *pool = kvpt_dtype_pool(C_BT, C_HEADS, C_HD, C_BATCH * 3, dtype);
        kvp_cache *cache = kvpt_cache(pool, &binding, C_BATCH, C_CAP);
        double key[ROW];
        double value[ROW];
        uint64_t seed = 5;
        kvp_error err;
        for (size_t t = 0; t < C_BT; t++) { /* a full block, so the next append takes pages */
            random_row(key, ROW, &seed);
            random_row(value, ROW, &seed);
            kvp_tensor k = kvp_tensor4(key, C_BATCH, C_HEADS, 1, C_HD);
            kvp_tensor v = kvp_tensor4(value, C_BATCH, C_HEADS, 1, C_HD);
            kvpt_assert_ok(kvpi_cache_append(cache, &k, &v, &err), &err);
        }
        kvp_tensor k = kvp_tensor4(key, C_BATCH, C_HEADS, 1, C_HD);
        kvp_tensor v = kvp_tensor4(value, C_BATCH, C_HEADS, 1, C_HD);
        kvpt_state before;
        kvpt_state_capture(cache, pool, &before);

        /* The largest value that rounds to a finite element is stored; the boundary is not. */
        key[6] = -limit;
        memset(&err, 0, sizeof err);
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_KEY);
        assert_string_equal(err.what, kvp_dtype_name(dtype));
        assert_int_equal(err.index, 6);
        assert_true(kvpt_same_bits(err.value, -limit));
        kvpt_assert_state_unchanged(&before, cache, pool, 0);
        char text[160];
        snprintf(text, sizeof text, "appended key value at flat index 6 must be finite in %s "
                 "storage, got %s", kvp_dtype_name(dtype),
                 dtype == KVP_F32 ? "-3.4028235677973366e38" : "-3.39617752923046e38");
        kvpt_assert_error_text(&err, text);

        /* A non-finite element before the first overflow is reported as in f64 (what NULL). */
        key[2] = NAN;
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_KEY);
        assert_null(err.what);
        assert_int_equal(err.index, 2);
        key[2] = 0.5;
        key[9] = INFINITY; /* after the overflow at 6: the overflow is first */
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_KEY);
        assert_int_equal(err.index, 6);
        key[6] = nextafter(-limit, 0.0);
        key[9] = 1.0;
        value[ROW - 1] = limit;
        assert_int_equal(kvpi_cache_append(cache, &k, &v, &err), KVP_NONFINITE_VALUE);
        assert_string_equal(err.what, kvp_dtype_name(dtype));
        assert_int_equal(err.index, ROW - 1);
        kvpt_assert_state_unchanged(&before, cache, pool, 0);

        /* Just below the boundary: stored as the largest finite element. */
        value[ROW - 1] = nextafter(limit, 0.0);
        kvpt_assert_ok(kvpi_cache_append(cache, &k, &v, &err), &err);
        kvpt_assert_pool_ok(pool);
        double keys[C_BATCH * C_HEADS * C_CAP * C_HD];
        kvpt_assert_ok(kvp_cache_keys(cache, keys, KVPT_COUNT_OF(keys), &err), &err);
        /* key[6] is lane 0, head 1, feature 1 of position 3 (len 4). */
        double biggest = dtype == KVP_F32 ? (double)FLT_MAX : 0x1.fep+127;
        assert_true(kvpt_same_bits(keys[((0 * C_HEADS + 1) * 4 + 3) * C_HD + 1], -biggest));
        kvpt_state_free(&before);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
    }
}

enum { P_HEADS = 2, P_HD = 4, P_D = P_HEADS * P_HD, P_CAP = 6 };

/* Identity W_q and W_o; W_k identity or zero; W_v identity. */
static kvp_layer *identity_layer(int zero_key)
{
    static double eye[P_D * P_D];
    static double zero[P_D * P_D];
    memset(eye, 0, sizeof eye);
    for (size_t i = 0; i < P_D; i++) {
        eye[i * P_D + i] = 1.0;
    }
    const double *const w[KVP_PARAM_COUNT] = {eye, zero_key ? zero : eye, eye, eye};
    return kvpt_layer_from_matrices(P_D, w, P_HEADS, P_CAP, 10000.0);
}

/*
 * prepare and kvp_attention_reference_stored refuse a candidate element the
 * dtype cannot hold the same way (key first, then value), after the
 * projections and before the scores, and change nothing.
 */
static void test_dtype_prepare_and_reference_refuse_overflow(void **state)
{
    (void)state;
    for (int zero_key = 0; zero_key < 2; zero_key++) {
        kvp_layer *layer = identity_layer(zero_key);
        kvp_binding binding;
        kvp_error err;
        kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
        kvp_status want = zero_key ? KVP_NONFINITE_VALUE : KVP_NONFINITE_KEY;
        kvp_pool *pool = kvpt_dtype_pool(2, P_HEADS, P_HD, 4, KVP_BF16);
        kvp_cache *cache = kvpt_cache(pool, &binding, 1, P_CAP);
        kvp_ticket *ticket = kvpt_ticket(cache);
        double x[2 * P_D];
        for (size_t i = 0; i < 2 * P_D; i++) {
            x[i] = 0.25 * (double)(i % 5) - 0.5;
        }
        kvp_tensor first = kvp_tensor3(x, 1, 1, P_D);
        kvpt_assert_ok(kvp_attention_forward(layer, &first, cache, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
        /*
         * Token 1, head 1, feature 3 (flat index 7): within f32 and f64, beyond
         * bf16, also once the key's pair (2, 3) is rotated by 1 * theta_1.
         */
        x[P_D + 6] = 0.0;
        x[P_D + 7] = 3.4e38;
        double rotated = 3.4e38 * cos(kvpi_rope_theta(10000.0, P_HD, 1));
        assert_true(kvpi_dtype_overflows(KVP_BF16, rotated));
        double found = zero_key ? 3.4e38 : rotated;
        kvp_tensor second = kvp_tensor3(x + P_D, 1, 1, P_D);
        kvpt_snapshot before;
        kvpt_snapshot_init(&before, pool);
        kvpt_snapshot_add_cache(&before, cache);
        kvpt_snapshot_take(&before);
        assert_int_equal(kvp_attention_prepare(layer, &second, cache, ticket, &err), want);
        assert_string_equal(err.what, "bf16");
        assert_int_equal(err.index, 7);
        assert_true(kvpt_same_bits(err.value, found));
        kvpt_assert_unchanged(&before, 0);
        assert_int_equal(kvp_attention_forward(layer, &second, cache, ticket, &err), want);
        kvpt_assert_unchanged(&before, 0);

        /* The stored-dtype reference reports the same, with the token. */
        double out[2 * P_D];
        kvpt_fill(out, 2 * P_D, 7.0);
        kvp_tensor both = kvp_tensor3(x, 1, 2, P_D);
        kvp_error ref_err;
        assert_int_equal(kvp_attention_reference_stored(layer, KVP_BF16, &both, out, 2 * P_D,
                                                        NULL, NULL, 0, &ref_err),
                         want);
        assert_string_equal(ref_err.what, "bf16");
        assert_int_equal(ref_err.index, 7);
        assert_true(kvpt_same_bits(ref_err.value, found));
        assert_int_equal(ref_err.token, 1);
        kvpt_assert_filled(out, 2 * P_D, 7.0);
        /* f32 holds it: no refusal there (the score may overflow instead, as in f64). */
        kvp_status f32_status = kvp_attention_reference_stored(layer, KVP_F32, &both, out,
                                                               2 * P_D, NULL, NULL, 0, &ref_err);
        kvp_status f64_status =
            kvp_attention_reference(layer, &both, out, 2 * P_D, NULL, NULL, 0, &err);
        assert_int_equal(f32_status, f64_status);
        /* A bad dtype is refused after the NULL checks. */
        assert_int_equal(kvp_attention_reference_stored(layer, (kvp_dtype)5, &both, out, 2 * P_D,
                                                        NULL, NULL, 0, &ref_err),
                         KVP_INVALID_ARGUMENT);
        assert_string_equal(ref_err.argument, "dtype");
        assert_int_equal(kvp_attention_reference_stored(layer, (kvp_dtype)5, NULL, out, 2 * P_D,
                                                        NULL, NULL, 0, &ref_err),
                         KVP_NULL_ARGUMENT);
        kvpt_destroy_ticket(ticket, pool);
        kvpt_destroy_cache(cache, pool);
        kvpt_destroy_pool(pool);
        kvpt_destroy_layer(layer);
    }
}

/* ---- exactness and error bounds -------------------------------------------------- */

typedef struct geometry {
    size_t batch, heads, head_width, capacity;
    size_t kv_heads; /* 0: heads (multi-head) */
} geometry;

static size_t kv_heads_of(const geometry *g)
{
    return g->kv_heads != 0 ? g->kv_heads : g->heads;
}

/*
 * Decodes a random [B, C, D] input one token at a time through a cache of a
 * `dtype` pool with `bt` tokens per page, at the active level: out gets the
 * outputs as [B, C, D], keys and values the cache's rows at the end.
 */
static void decode(const geometry *g, kvp_dtype dtype, size_t bt, const kvp_layer *layer,
                   const double *input, double *out, double *keys, double *values)
{
    size_t d = g->heads * g->head_width;
    size_t kv = g->batch * g->capacity * kv_heads_of(g) * g->head_width;
    kvp_error err;
    kvp_pool *pool = kvpt_dtype_pool(bt, kv_heads_of(g), g->head_width,
                                g->batch * KVPT_CEIL_DIV(g->capacity, bt), dtype);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, g->batch, g->capacity);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *step = kvpt_doubles(g->batch * d);
    for (size_t t = 0; t < g->capacity; t++) {
        for (size_t b = 0; b < g->batch; b++) {
            memcpy(step + b * d, input + (b * g->capacity + t) * d, d * sizeof(double));
        }
        kvp_tensor view = kvp_tensor3(step, g->batch, 1, d);
        kvpt_assert_ok(kvp_attention_forward(layer, &view, cache, ticket, &err), &err);
        kvpt_assert_pool_ok(pool);
        kvp_attention_result result;
        kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
        for (size_t b = 0; b < g->batch; b++) {
            memcpy(out + (b * g->capacity + t) * d, result.output + b * d, d * sizeof(double));
        }
    }
    kvpt_assert_ok(kvp_cache_keys(cache, keys, kv, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, values, kv, &err), &err);
    free(step);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* The levels this machine runs (AVX-512 not under Valgrind, which lacks it). */
static size_t levels_to_test(kvpi_isa out[KVPI_ISA_COUNT])
{
    size_t n = 0;
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        if (kvpi_kernels_level((kvpi_isa)isa) != NULL &&
            !(isa == KVPI_ISA_AVX512 && RUNNING_ON_VALGRIND)) {
            out[n++] = (kvpi_isa)isa;
        }
    }
    return n;
}

static kvpi_isa initial_level;

static int restore_level(void **state)
{
    (void)state;
    return kvpi_kernels_use(initial_level) == 0 ? 0 : -1;
}

static void test_dtype_incremental_equals_stored_reference(void **state)
{
    (void)state;
    /* Multi-head, then multi-query (kv_heads 1) and a group of 4 (8 heads, 2 KV heads). */
    static const geometry cases[] = {{2, 3, 14, 20, 0}, {1, 2, 64, 19, 0}, {3, 1, 8, 9, 0},
                                     {2, 4, 8, 17, 1},  {1, 8, 16, 21, 2}};
    static const size_t blocks[] = {1, 3, 16};
    kvpi_isa levels[KVPI_ISA_COUNT];
    size_t nlevels = levels_to_test(levels);
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        const geometry *g = &cases[c];
        size_t d = g->heads * g->head_width;
        size_t rows = g->batch * g->capacity * d;
        size_t kv_rows = g->batch * g->capacity * kv_heads_of(g) * g->head_width;
        kvp_layer *layer = NULL;
        kvp_error made;
        kvpt_assert_ok(kvp_layer_create_random_grouped(d, g->heads, kv_heads_of(g), g->capacity,
                                                       10000.0, 40 + c, &layer, &made),
                       &made);
        double *input = kvpt_doubles(rows);
        kvpt_fill_random(input, rows, 700 + c);
        kvp_tensor whole = kvp_tensor3(input, g->batch, g->capacity, d);
        double *ref = kvpt_doubles(rows);
        double *ref_keys = kvpt_doubles(kv_rows);
        double *ref_values = kvpt_doubles(kv_rows);
        double *out = kvpt_doubles(rows);
        double *keys = kvpt_doubles(kv_rows);
        double *values = kvpt_doubles(kv_rows);
        double *first = kvpt_doubles(rows);
        for (size_t t = 0; t < 3; t++) {
            kvp_dtype dtype = all_dtypes[t];
            kvp_error err;
            for (size_t l = 0; l < nlevels; l++) {
                assert_int_equal(kvpi_kernels_use(levels[l]), 0);
                kvpt_assert_ok(kvp_attention_reference_stored(layer, dtype, &whole, ref, rows,
                                                              ref_keys, ref_values, kv_rows,
                                                              &err),
                               &err);
                if (dtype == KVP_F64) {
                    /* The f64 entry point is exactly the old one. */
                    double *plain = kvpt_doubles(rows);
                    kvpt_assert_ok(kvp_attention_reference(layer, &whole, plain, rows, NULL, NULL,
                                                           0, &err),
                                   &err);
                    assert_memory_equal(plain, ref, rows * sizeof(double));
                    free(plain);
                }
                for (size_t i = 0; i < kv_rows; i++) {
                    assert_true(kvpt_same_bits(ref_keys[i], kvpi_dtype_round(dtype, ref_keys[i])));
                    assert_true(kvpt_same_bits(ref_values[i], kvpi_dtype_round(dtype, ref_values[i])));
                }
                for (size_t b = 0; b < KVPT_COUNT_OF(blocks); b++) {
                    decode(g, dtype, blocks[b], layer, input, out, keys, values);
                    if (memcmp(out, ref, rows * sizeof(double)) != 0 ||
                        memcmp(keys, ref_keys, kv_rows * sizeof(double)) != 0 ||
                        memcmp(values, ref_values, kv_rows * sizeof(double)) != 0) {
                        print_error("%s, level %s, block_tokens %zu, case %zu: incremental "
                                    "differs from the stored-dtype reference\n",
                                    kvp_dtype_name(dtype), kvpi_isa_name(levels[l]), blocks[b],
                                    c);
                        fail();
                    }
                }
                /* The same bits at every level. */
                if (l == 0) {
                    memcpy(first, ref, rows * sizeof(double));
                } else {
                    assert_memory_equal(ref, first, rows * sizeof(double));
                }
            }
        }
        free(input);
        free(ref);
        free(ref_keys);
        free(ref_values);
        free(out);
        free(keys);
        free(values);
        free(first);
        kvpt_destroy_layer(layer);
    }
}

/*
 * Error against the f64 reference on unit-scale random data: 32 random
 * geometries, inputs uniform in [-1, 1), kvp_layer_create_random weights.
 * The error of a run is max |y - y_f64| / max |y_f64| over all its outputs.
 * Because incremental == stored reference (the test above), measuring the
 * stored reference measures the incremental path.
 */
static void test_dtype_error_against_f64_is_bounded(void **state)
{
    (void)state;
    uint64_t seed = 2024;
    double worst[3] = {0.0, 0.0, 0.0};
    for (size_t run = 0; run < 32; run++) {
        geometry g;
        g.batch = 1 + kvpt_rand_next(&seed) % 3;
        g.heads = 1 + kvpt_rand_next(&seed) % 4;
        g.head_width = 2 * (1 + kvpt_rand_next(&seed) % 32);
        g.capacity = 1 + kvpt_rand_next(&seed) % 48;
        g.kv_heads = 0;
        size_t d = g.heads * g.head_width;
        size_t rows = g.batch * g.capacity * d;
        kvp_layer *layer = kvpt_random_layer(d, g.heads, g.capacity, 10000.0, 900 + run);
        double *input = kvpt_doubles(rows);
        kvpt_fill_random(input, rows, 1900 + run);
        kvp_tensor whole = kvp_tensor3(input, g.batch, g.capacity, d);
        double *ref = kvpt_doubles(rows);
        double *out = kvpt_doubles(rows);
        kvp_error err;
        kvpt_assert_ok(kvp_attention_reference(layer, &whole, ref, rows, NULL, NULL, 0, &err),
                       &err);
        double scale = 0.0;
        for (size_t i = 0; i < rows; i++) {
            scale = fmax(scale, fabs(ref[i]));
        }
        assert_true(scale > 0.0);
        for (size_t t = 1; t < 3; t++) {
            kvpt_assert_ok(kvp_attention_reference_stored(layer, all_dtypes[t], &whole, out, rows,
                                                          NULL, NULL, 0, &err),
                           &err);
            double e = kvpt_max_abs_diff(out, ref, rows) / scale;
            worst[t] = fmax(worst[t], e);
        }
        free(input);
        free(ref);
        free(out);
        kvpt_destroy_layer(layer);
    }
    printf("# error against f64 over 32 random geometries: f32 %.3e (bound %.0e), "
           "bf16 %.3e (bound %.0e)\n",
           worst[1], F32_BOUND, worst[2], BF16_BOUND);
    assert_true(worst[1] > 0.0); /* the rounding is real */
    assert_true(worst[1] <= F32_BOUND);
    assert_true(worst[2] > worst[1]);
    assert_true(worst[2] <= BF16_BOUND);
}

/*
 * Sequences take the pool's dtype with nothing to configure: a prefill
 * through a one-layer model over a `dtype` pool stores exactly the K/V of
 * the stored-dtype reference, for every dtype and block size.
 */
static void test_dtype_sequences_store_in_the_pools_dtype(void **state)
{
    (void)state;
    enum { B = 2, H = 2, HD = 6, D = H * HD, T = 11 };
    kvp_model *model = kvpt_random_model(1, D, H, T, 10000.0, 77);
    const kvp_layer *layer = kvp_model_layer(model, 0);
    double prompt[B * T * D];
    kvpt_fill_random(prompt, B * T * D, 78);
    kvp_tensor view = kvp_tensor3(prompt, B, T, D);
    static const size_t blocks[] = {1, 3, 16};
    for (size_t i = 0; i < 3; i++) {
        kvp_dtype dtype = all_dtypes[i];
        double ref[B * T * D];
        double ref_keys[B * T * D];
        double ref_values[B * T * D];
        kvp_error err;
        kvpt_assert_ok(kvp_attention_reference_stored(layer, dtype, &view, ref, B * T * D,
                                                      ref_keys, ref_values, B * T * D, &err),
                       &err);
        for (size_t b = 0; b < KVPT_COUNT_OF(blocks); b++) {
            size_t bt = blocks[b];
            kvp_pool *pool = kvpt_dtype_pool(bt, H, HD, B * KVPT_CEIL_DIV(T, bt), dtype);
            kvp_sequence *seq = kvpt_sequence(model, pool, B, T);
            double out[B * T * D];
            kvpt_assert_ok(kvp_sequence_prefill(seq, &view, NULL, NULL, out, B * T * D, &err),
                           &err);
            kvpt_assert_pool_ok(pool);
            double keys[B * T * D];
            double values[B * T * D];
            const kvp_cache *cache = kvp_sequence_cache(seq, 0);
            kvpt_assert_ok(kvp_cache_keys(cache, keys, B * T * D, &err), &err);
            kvpt_assert_ok(kvp_cache_values(cache, values, B * T * D, &err), &err);
            assert_memory_equal(keys, ref_keys, sizeof keys);
            assert_memory_equal(values, ref_values, sizeof values);
            kvpt_destroy_sequence(seq, pool);
            kvpt_destroy_pool(pool);
        }
    }
    kvpt_destroy_model(model);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    initial_level = kvpi_kernels_active()->isa;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names_and_sizes),
        cmocka_unit_test(test_dtype_conversion_edge_cases),
        cmocka_unit_test(test_dtype_conversion_matches_definition),
        cmocka_unit_test(test_dtype_pool_geometry_and_stats),
        cmocka_unit_test(test_dtype_cache_stores_rounded_rows),
        cmocka_unit_test(test_dtype_append_refuses_overflow_changing_nothing),
        cmocka_unit_test(test_dtype_prepare_and_reference_refuse_overflow),
        cmocka_unit_test_teardown(test_dtype_incremental_equals_stored_reference, restore_level),
        cmocka_unit_test(test_dtype_error_against_f64_is_bounded),
        cmocka_unit_test(test_dtype_sequences_store_in_the_pools_dtype),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
