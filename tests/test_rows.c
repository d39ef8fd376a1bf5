/*
 * test_rows.c: an external cache's rows in the page's own formats
 * (kvp_cache_append_rows_typed, kvp_cache_commit_rows_typed) and written in
 * place (kvp_cache_reserved_slots, kvp_cache_commit_written), kvpager/cache.h.
 *
 * Owns the checks that:
 *   - rows in f64, f32, bf16 and f16 land as their widened f64 values
 *     appended with kvp_cache_append_rows would, in f64, f32 and bf16 pools
 *     (so rows already in the pool's dtype are stored bit for bit), through
 *     append and through reserve + commit in two parts;
 *   - typed rows are refused as f64 rows are (NONFINITE_KEY / VALUE on the
 *     widened value, overflow of the pool's dtype included; a bad
 *     src_dtype), changing nothing;
 *   - reserve, write in place through the spans, commit (whole or in two
 *     parts, with a copy-on-write partial page or not) gives the pages,
 *     bytes and digests of kvp_cache_append_rows of the same rows in a twin
 *     pool, the audit passing after each step; the spans tile the reserved
 *     rows block by block;
 *   - reserve, write, discard leaves the cache and the pool's counters as
 *     they were; a written non-finite element is refused by the commit,
 *     naming its flat index, changing nothing; every argument error of both
 *     calls changes nothing;
 *   - a reserved page borrowed from the prefix cache's evictable list is
 *     evicted when its slots are given out, and a discard then frees it.
 * Unit test: uses pager/dtype.h (the rounding rule).
 */
#include "support.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pager/dtype.h"

enum { BT = 3, H = 2, W = 5, B = 2, CAP = 14, PAGES = 2 * B * 5 + 4 };

/* A pool of zeroed pages (mmap), so two pools given the same operations have equal slabs. */
static kvp_pool *mmap_pool(kvp_dtype dtype)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = H;
    config.head_width = W;
    config.dtype = dtype;
    config.slab_source = KVP_SLAB_MMAP;
    config.budget_bytes = PAGES * 2 * H * BT * W * kvp_dtype_bytes(dtype);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    return pool;
}

static kvp_cache *external(kvp_pool *pool)
{
    kvp_binding binding;
    kvp_error err;
    kvpt_assert_ok(kvp_binding_init_external(&binding, H, W, CAP, 3, 1, &err), &err);
    return kvpt_cache(pool, &binding, B, CAP);
}

/* IEEE binary16 bits widened, written independently of the library's. */
static double f16_value(uint16_t h)
{
    int e = (h >> 10) & 31;
    double frac = (h & 1023) / 1024.0;
    double x = e == 0 ? frac * pow(2.0, -14) : (1.0 + frac) * pow(2.0, e - 15);
    return (h & 0x8000) ? -x : x;
}

/*
 * n rows in src_dtype at `out` (elements of that type) and their widened
 * values at `wide`: random, with a zero, a -0 and (f16, bf16) subnormals.
 */
static void make_rows(kvp_dtype src_dtype, size_t n, uint64_t seed, void *out, double *wide)
{
    uint64_t state = seed;
    for (size_t i = 0; i < n; i++) {
        double x = kvpt_rand_unit(&state) * 8.0;
        if (i % 17 == 3) {
            x = i % 2 ? 0.0 : -0.0;
        }
        switch (src_dtype) {
        case KVP_F32:
            ((float *)out)[i] = (float)x;
            wide[i] = ((float *)out)[i];
            break;
        case KVP_BF16:
            ((uint16_t *)out)[i] = i % 11 == 5 ? (uint16_t)(i & 0x7f) : kvpi_bf16_from_f64(x);
            wide[i] = kvpi_bf16_to_f64(((uint16_t *)out)[i]);
            break;
        case KVP_F16: {
            uint16_t bits = (uint16_t)(kvpt_rand_next(&state) & 0xffff);
            if ((bits & 0x7c00) == 0x7c00) {
                bits &= 0xbfff; /* no infinity or NaN: exponent 15 or below */
            }
            ((uint16_t *)out)[i] = bits;
            wide[i] = f16_value(bits);
            break;
        }
        default:
            ((double *)out)[i] = x;
            wide[i] = x;
            break;
        }
    }
}

static void assert_same_rows(kvp_cache *a, kvp_cache *b)
{
    kvp_error err;
    size_t n = B * H * CAP * W;
    double *ka = kvpt_doubles(n);
    double *kb = kvpt_doubles(n);
    double *va = kvpt_doubles(n);
    double *vb = kvpt_doubles(n);
    assert_int_equal(kvp_cache_len(a), kvp_cache_len(b));
    kvpt_assert_ok(kvp_cache_keys(a, ka, n, &err), &err);
    kvpt_assert_ok(kvp_cache_keys(b, kb, n, &err), &err);
    kvpt_assert_ok(kvp_cache_values(a, va, n, &err), &err);
    kvpt_assert_ok(kvp_cache_values(b, vb, n, &err), &err);
    assert_memory_equal(ka, kb, n * sizeof *ka);
    assert_memory_equal(va, vb, n * sizeof *va);
    free(ka);
    free(kb);
    free(va);
    free(vb);
}

/* Typed appends (whole, and reserve + two typed commits) equal f64 appends of the widened rows. */
static void check_typed(kvp_dtype pool_dtype, kvp_dtype src_dtype)
{
    kvp_pool *pool = mmap_pool(pool_dtype);
    kvp_cache *typed = external(pool);
    kvp_cache *parts = external(pool);
    kvp_cache *wide = external(pool);
    size_t rows = 7;
    size_t n = B * H * rows * W;
    unsigned char keys[B * H * 7 * W * 8];
    unsigned char values[B * H * 7 * W * 8];
    double wk[B * H * 7 * W];
    double wv[B * H * 7 * W];
    make_rows(src_dtype, n, 11 + src_dtype, keys, wk);
    make_rows(src_dtype, n, 23 + src_dtype, values, wv);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_append_rows(wide, wk, wv, rows, &err), &err);
    kvpt_assert_ok(kvp_cache_append_rows_typed(typed, src_dtype, keys, values, rows, &err), &err);
    kvpt_assert_pool_ok(pool);
    assert_same_rows(typed, wide);
    /* Reserve, then commit 3 rows and 4 rows: each part laid out with its own row count. */
    kvpt_assert_ok(kvp_cache_reserve_rows(parts, rows, &err), &err);
    size_t bytes = src_dtype == KVP_F16 ? 2 : kvp_dtype_bytes(src_dtype);
    for (size_t part = 0; part < 2; part++) {
        size_t first = part == 0 ? 0 : 3;
        size_t count = part == 0 ? 3 : 4;
        unsigned char pk[B * H * 7 * W * 8];
        unsigned char pv[B * H * 7 * W * 8];
        for (size_t lh = 0; lh < B * H; lh++) {
            memcpy(pk + lh * count * W * bytes, keys + (lh * rows + first) * W * bytes,
                   count * W * bytes);
            memcpy(pv + lh * count * W * bytes, values + (lh * rows + first) * W * bytes,
                   count * W * bytes);
        }
        kvpt_assert_ok(kvp_cache_commit_rows_typed(parts, src_dtype, pk, pv, count, &err), &err);
        kvpt_assert_pool_ok(pool);
    }
    assert_same_rows(parts, wide);
    if (src_dtype == pool_dtype) {
        /* Stored bit for bit: the widened rows are the rows. */
        double *k = kvpt_doubles(n);
        kvpt_assert_ok(kvp_cache_keys(typed, k, n, &err), &err);
        assert_memory_equal(k, wk, n * sizeof *k);
        free(k);
    }
    kvpt_destroy_cache(typed, pool);
    kvpt_destroy_cache(parts, pool);
    kvpt_destroy_cache(wide, pool);
    kvpt_destroy_pool(pool);
}

static void test_rows_typed_equal_widened(void **state)
{
    (void)state;
    static const kvp_dtype pools[] = {KVP_F64, KVP_F32, KVP_BF16};
    static const kvp_dtype sources[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16};
    for (size_t p = 0; p < KVPT_COUNT_OF(pools); p++) {
        for (size_t s = 0; s < KVPT_COUNT_OF(sources); s++) {
            check_typed(pools[p], sources[s]);
        }
    }
}

/* One refused call: the status, and the cache and the pool as they were. */
#define EXPECT_REFUSED(cache, pool, expected, call)                                          \
    do {                                                                                     \
        kvpt_state before_;                                                                  \
        kvpt_state_capture((cache), (pool), &before_);                                       \
        uint64_t digest_before_ = 0;                                                         \
        kvp_error d_;                                                                        \
        kvpt_assert_ok(kvp_cache_digest((cache), &digest_before_, &d_), &d_);                \
        memset(&e, 0x5A, sizeof e);                                                          \
        kvp_status got_ = (call);                                                            \
        assert_int_equal(got_, (expected));                                                  \
        assert_int_equal(e.status, (expected));                                              \
        kvpt_assert_state_unchanged(&before_, (cache), (pool), 0);                           \
        uint64_t digest_after_ = 0;                                                          \
        kvpt_assert_ok(kvp_cache_digest((cache), &digest_after_, &d_), &d_);                 \
        assert_true(digest_after_ == digest_before_);                                        \
        kvpt_state_free(&before_);                                                           \
    } while (0)

static void test_rows_typed_refusals(void **state)
{
    (void)state;
    kvp_pool *pool = mmap_pool(KVP_BF16);
    kvp_cache *cache = external(pool);
    kvp_error e;
    float keys[B * H * 2 * W];
    float values[B * H * 2 * W];
    for (size_t i = 0; i < B * H * 2 * W; i++) {
        keys[i] = (float)i / 8.0f;
        values[i] = -(float)i / 4.0f;
    }
    kvpt_assert_ok(kvp_cache_append_rows_typed(cache, KVP_F32, keys, values, 1, &e), &e);
    EXPECT_REFUSED(cache, pool, KVP_INVALID_ARGUMENT,
                   kvp_cache_append_rows_typed(cache, KVP_FP8_E4M3, keys, values, 2, &e));
    assert_string_equal(e.argument, "src_dtype");
    EXPECT_REFUSED(cache, pool, KVP_INVALID_ARGUMENT,
                   kvp_cache_append_rows_typed(cache, (kvp_dtype)99, keys, values, 0, &e));
    EXPECT_REFUSED(cache, pool, KVP_NULL_ARGUMENT,
                   kvp_cache_append_rows_typed(cache, KVP_F32, NULL, values, 2, &e));
    EXPECT_REFUSED(cache, pool, KVP_FULL,
                   kvp_cache_append_rows_typed(cache, KVP_F32, keys, values, CAP, &e));
    /* A value the bf16 pages cannot hold, as widened from f32. */
    values[7] = FLT_MAX;
    EXPECT_REFUSED(cache, pool, KVP_NONFINITE_VALUE,
                   kvp_cache_append_rows_typed(cache, KVP_F32, keys, values, 2, &e));
    assert_int_equal(e.index, 7);
    assert_string_equal(e.what, "bf16");
    values[7] = 1.0f;
    /* An f16 infinity, past the first widening chunk. */
    uint16_t k16[B * H * 20 * W];
    uint16_t v16[B * H * 20 * W];
    memset(k16, 0, sizeof k16);
    memset(v16, 0, sizeof v16);
    k16[150] = 0xfc00; /* -infinity */
    EXPECT_REFUSED(cache, pool, KVP_NONFINITE_KEY,
                   kvp_cache_append_rows_typed(cache, KVP_F16, k16, v16, 8, &e));
    assert_int_equal(e.index, 150);
    assert_null(e.what);
    assert_true(isinf(e.value) && e.value < 0);
    /* A reservation pending: ROWS_RESERVED before the dtype; commit checks the dtype first. */
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 2, &e), &e);
    EXPECT_REFUSED(cache, pool, KVP_ROWS_RESERVED,
                   kvp_cache_append_rows_typed(cache, (kvp_dtype)99, keys, values, 2, &e));
    EXPECT_REFUSED(cache, pool, KVP_INVALID_ARGUMENT,
                   kvp_cache_commit_rows_typed(cache, (kvp_dtype)99, keys, values, 3, &e));
    EXPECT_REFUSED(cache, pool, KVP_ROWS_NOT_RESERVED,
                   kvp_cache_commit_rows_typed(cache, KVP_F32, keys, values, 3, &e));
    keys[2] = NAN;
    EXPECT_REFUSED(cache, pool, KVP_NONFINITE_KEY,
                   kvp_cache_commit_rows_typed(cache, KVP_F32, keys, values, 2, &e));
    assert_int_equal(e.index, 2);
    assert_int_equal(kvp_cache_reserved_rows(cache), 2);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &e), &e);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* ---- writing in place ------------------------------------------------------------------ */

/* Writes element (lane, head, row r, feature f) of [B, H, rows, W] f64 rows through the spans. */
static void write_spans(kvp_cache *cache, kvp_dtype dtype, const double *keys,
                        const double *values, size_t rows)
{
    kvp_error err;
    size_t esize = kvp_dtype_bytes(dtype);
    for (size_t lane = 0; lane < B; lane++) {
        size_t count = SIZE_MAX;
        kvpt_assert_ok(kvp_cache_reserved_slots(cache, lane, NULL, 0, &count, &err), &err);
        kvp_slot_span spans[8];
        assert_true(count <= 8);
        size_t got = SIZE_MAX;
        kvpt_assert_ok(kvp_cache_reserved_slots(cache, lane, spans, 8, &got, &err), &err);
        assert_int_equal(got, count);
        size_t next = 0;
        for (size_t s = 0; s < count; s++) {
            assert_int_equal(spans[s].row, next);
            assert_true(spans[s].rows >= 1 && spans[s].rows <= BT);
            assert_int_equal(spans[s].row_stride_bytes, W * esize);
            assert_int_equal(spans[s].head_stride_bytes, BT * W * esize);
            for (size_t i = 0; i < spans[s].rows; i++) {
                size_t r = spans[s].row + i;
                for (size_t h = 0; h < H; h++) {
                    size_t at = ((lane * H + h) * rows + r) * W;
                    size_t off = h * spans[s].head_stride_bytes + i * spans[s].row_stride_bytes;
                    kvpi_dtype_store(dtype, (unsigned char *)spans[s].keys + off, keys + at, W);
                    kvpi_dtype_store(dtype, (unsigned char *)spans[s].values + off, values + at,
                                     W);
                }
            }
            next += spans[s].rows;
        }
        assert_int_equal(next, kvp_cache_reserved_rows(cache));
    }
}

/* Both pools' slabs and both caches' digests equal, and the audits pass. */
static void assert_twins(kvp_pool *pa, kvp_cache *a, kvp_pool *pb, kvp_cache *b)
{
    kvp_error err;
    kvpt_assert_pool_ok(pa);
    kvpt_assert_pool_ok(pb);
    uint64_t da = 0;
    uint64_t db = 0;
    kvpt_assert_ok(kvp_cache_digest(a, &da, &err), &err);
    kvpt_assert_ok(kvp_cache_digest(b, &db, &err), &err);
    assert_true(da == db);
    kvpt_assert_ok(kvp_pool_digest(pa, &da, &err), &err);
    kvpt_assert_ok(kvp_pool_digest(pb, &db, &err), &err);
    assert_true(da == db);
    assert_same_rows(a, b);
}

/*
 * The cache holds, whatever wrote them, `start` rows laid out [B, H, start,
 * W] and then `total` rows laid out [B, H, stride_rows, W], in rows0 (keys)
 * and rows1 (values), each rounded to `dtype`.
 */
static void assert_rows_are(kvp_cache *cache, kvp_dtype dtype, const double *rows0,
                            const double *rows1, size_t start, size_t total, size_t stride_rows)
{
    kvp_error err;
    size_t len = start + total;
    assert_int_equal(kvp_cache_len(cache), len);
    double *k = kvpt_doubles(B * H * len * W);
    double *v = kvpt_doubles(B * H * len * W);
    kvpt_assert_ok(kvp_cache_keys(cache, k, B * H * len * W, &err), &err);
    kvpt_assert_ok(kvp_cache_values(cache, v, B * H * len * W, &err), &err);
    for (size_t lh = 0; lh < B * H; lh++) {
        for (size_t p = 0; p < len; p++) {
            for (size_t f = 0; f < W; f++) {
                size_t src = p < start ? (lh * start + p) * W + f
                                       : (lh * stride_rows + p - start) * W + f;
                size_t at = (lh * len + p) * W + f;
                assert_true(k[at] == kvpi_dtype_round(dtype, rows0[src]));
                assert_true(v[at] == kvpi_dtype_round(dtype, rows1[src]));
            }
        }
    }
    free(k);
    free(v);
}

/*
 * Two twin pools: `start` rows appended to both (and forked mid-block when
 * `fork`: the partial page is then copied on write), then 9 rows written in
 * place and committed in parts `first` and 9 - first into one, appended in
 * the same parts into the other.
 */
static void check_in_place(kvp_dtype dtype, size_t start, size_t first, int fork)
{
    enum { ROWS = 9 };
    kvp_pool *pa = mmap_pool(dtype);
    kvp_pool *pb = mmap_pool(dtype);
    kvp_cache *a = external(pa);
    kvp_cache *b = external(pb);
    kvp_cache *fa = NULL;
    kvp_cache *fb = NULL;
    kvp_error err;
    double rows[2][B * H * ROWS * W];
    kvpt_fill_random(rows[0], B * H * ROWS * W, 5 + start);
    kvpt_fill_random(rows[1], B * H * ROWS * W, 6 + start);
    if (start > 0) {
        kvpt_assert_ok(kvp_cache_append_rows(a, rows[0], rows[1], start, &err), &err);
        kvpt_assert_ok(kvp_cache_append_rows(b, rows[0], rows[1], start, &err), &err);
    }
    if (fork) {
        kvpt_assert_ok(kvp_cache_fork(a, &fa, &err), &err);
        kvpt_assert_ok(kvp_cache_fork(b, &fb, &err), &err);
    }
    assert_twins(pa, a, pb, b);
    kvpt_assert_ok(kvp_cache_reserve_rows(a, ROWS, &err), &err);
    kvpt_assert_ok(kvp_cache_reserve_rows(b, ROWS, &err), &err);
    size_t parts[2] = {first, ROWS - first};
    for (size_t p = 0; p < 2; p++) {
        size_t n = parts[p];
        double k[B * H * ROWS * W];
        double v[B * H * ROWS * W];
        size_t from = p == 0 ? 0 : first;
        for (size_t lh = 0; lh < B * H; lh++) {
            memcpy(k + lh * n * W, rows[0] + (lh * ROWS + from) * W, n * W * sizeof *k);
            memcpy(v + lh * n * W, rows[1] + (lh * ROWS + from) * W, n * W * sizeof *v);
        }
        /* The kernel writes every reserved row; the commit takes the first n. */
        size_t pending = kvp_cache_reserved_rows(a);
        double wk[B * H * ROWS * W];
        double wv[B * H * ROWS * W];
        for (size_t lh = 0; lh < B * H; lh++) {
            memcpy(wk + lh * pending * W, rows[0] + (lh * ROWS + from) * W,
                   pending * W * sizeof *wk);
            memcpy(wv + lh * pending * W, rows[1] + (lh * ROWS + from) * W,
                   pending * W * sizeof *wv);
        }
        for (size_t i = 0; i < B * H * pending * W; i++) {
            wk[i] = kvpi_dtype_round(dtype, wk[i]);
            wv[i] = kvpi_dtype_round(dtype, wv[i]);
        }
        write_spans(a, dtype, wk, wv, pending);
        kvpt_assert_pool_ok(pa);
        kvpt_assert_ok(kvp_cache_commit_written(a, n, &err), &err);
        kvpt_assert_ok(kvp_cache_commit_rows(b, k, v, n, &err), &err);
        if (p == 0) {
            /* Slots past len differ (the kernel wrote them all): compare rows and tables. */
            kvpt_assert_pool_ok(pa);
            assert_same_rows(a, b);
        }
    }
    assert_int_equal(kvp_cache_reserved_rows(a), 0);
    assert_twins(pa, a, pb, b);
    assert_rows_are(a, dtype, rows[0], rows[1], start, ROWS, ROWS);
    if (fork) {
        assert_same_rows(fa, fb);
        assert_int_equal(kvp_cache_len(fa), start);
        kvpt_destroy_cache(fa, pa);
        kvpt_destroy_cache(fb, pb);
    }
    kvpt_destroy_cache(a, pa);
    kvpt_destroy_cache(b, pb);
    kvpt_destroy_pool(pa);
    kvpt_destroy_pool(pb);
}

static void test_rows_written_in_place_equal_appended(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16};
    for (size_t t = 0; t < KVPT_COUNT_OF(dtypes); t++) {
        check_in_place(dtypes[t], 0, 9, 0);  /* from an empty cache, at once */
        check_in_place(dtypes[t], 2, 9, 0);  /* from mid-block: 4 spans per lane */
        check_in_place(dtypes[t], 2, 4, 0);  /* in two parts, ending mid-block */
        check_in_place(dtypes[t], 4, 3, 1);  /* a shared partial page: copy-on-write */
    }
}

/* Reserve, write, discard: the cache, the pool's counters and the tables as they were. */
static void test_rows_written_then_discarded(void **state)
{
    (void)state;
    kvp_pool *pool = mmap_pool(KVP_F32);
    kvp_cache *cache = external(pool);
    kvp_error err;
    double k[B * H * 8 * W];
    double v[B * H * 8 * W];
    kvpt_fill_random(k, B * H * 8 * W, 1);
    kvpt_fill_random(v, B * H * 8 * W, 2);
    kvpt_assert_ok(kvp_cache_append_rows(cache, k, v, 4, &err), &err);
    kvpt_state before;
    kvpt_state_capture(cache, pool, &before);
    uint64_t digest = 0;
    kvpt_assert_ok(kvp_cache_digest(cache, &digest, &err), &err);
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 8, &err), &err);
    for (size_t i = 0; i < B * H * 8 * W; i++) {
        k[i] = kvpi_dtype_round(KVP_F32, k[i]);
        v[i] = kvpi_dtype_round(KVP_F32, v[i]);
    }
    write_spans(cache, KVP_F32, k, v, 8);
    kvpt_assert_pool_ok(pool);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err);
    kvpt_assert_state_unchanged(&before, cache, pool, 0);
    uint64_t after = 0;
    kvpt_assert_ok(kvp_cache_digest(cache, &after, &err), &err);
    assert_true(after == digest);
    kvpt_state_free(&before);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

/* A non-finite element written in place, and every argument error: nothing changes. */
static void test_rows_written_refusals(void **state)
{
    (void)state;
    kvp_pool *pool = mmap_pool(KVP_BF16);
    kvp_cache *cache = external(pool);
    kvp_error e;
    double k[B * H * 5 * W];
    double v[B * H * 5 * W];
    kvpt_fill_random(k, B * H * 5 * W, 8);
    kvpt_fill_random(v, B * H * 5 * W, 9);
    kvpt_assert_ok(kvp_cache_append_rows(cache, k, v, 2, &e), &e);
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 5, &e), &e);
    for (size_t i = 0; i < B * H * 5 * W; i++) {
        k[i] = kvpi_dtype_round(KVP_BF16, k[i]);
        v[i] = kvpi_dtype_round(KVP_BF16, v[i]);
    }
    /* Lane 1, head 1, reserved row 3, feature 2; then a value of lane 0. */
    size_t bad_key = ((1 * H + 1) * 5 + 3) * W + 2;
    k[bad_key] = NAN;
    v[7] = -INFINITY;
    write_spans(cache, KVP_BF16, k, v, 5);
    EXPECT_REFUSED(cache, pool, KVP_NONFINITE_KEY, kvp_cache_commit_written(cache, 5, &e));
    assert_int_equal(e.index, bad_key);
    assert_true(isnan(e.value));
    assert_null(e.what);
    /* Only the first 3 rows are checked by a commit of 3: the bad key is row 3. */
    EXPECT_REFUSED(cache, pool, KVP_NONFINITE_VALUE, kvp_cache_commit_written(cache, 3, &e));
    assert_int_equal(e.index, 7);
    assert_int_equal(kvp_cache_reserved_rows(cache), 5);
    k[bad_key] = 0.5;
    v[7] = 0.25;
    write_spans(cache, KVP_BF16, k, v, 5);
    EXPECT_REFUSED(cache, pool, KVP_ROWS_NOT_RESERVED, kvp_cache_commit_written(cache, 6, &e));
    assert_int_equal(e.available, 5);
    EXPECT_REFUSED(cache, pool, KVP_NULL_ARGUMENT, kvp_cache_commit_written(NULL, 1, &e));
    kvp_slot_span spans[2];
    size_t count = 0;
    EXPECT_REFUSED(cache, pool, KVP_NULL_ARGUMENT,
                   kvp_cache_reserved_slots(NULL, 0, spans, 2, &count, &e));
    assert_string_equal(e.argument, "cache");
    EXPECT_REFUSED(cache, pool, KVP_NULL_ARGUMENT,
                   kvp_cache_reserved_slots(cache, 0, spans, 2, NULL, &e));
    assert_string_equal(e.argument, "count");
    EXPECT_REFUSED(cache, pool, KVP_NULL_ARGUMENT,
                   kvp_cache_reserved_slots(cache, 0, NULL, 2, &count, &e));
    assert_string_equal(e.argument, "out");
    EXPECT_REFUSED(cache, pool, KVP_OUT_OF_RANGE,
                   kvp_cache_reserved_slots(cache, B, spans, 2, &count, &e));
    /* Rows 2 .. 6 touch blocks 0, 1 and 2: three spans do not fit in two. */
    EXPECT_REFUSED(cache, pool, KVP_BUFFER_TOO_SMALL,
                   kvp_cache_reserved_slots(cache, 0, spans, 2, &count, &e));
    assert_int_equal(e.needed, 3);
    kvpt_assert_ok(kvp_cache_commit_written(cache, 5, &e), &e);
    kvpt_assert_pool_ok(pool);
    assert_int_equal(kvp_cache_len(cache), 7);
    /* No reservation: no span. */
    count = 9;
    kvpt_assert_ok(kvp_cache_reserved_slots(cache, 1, spans, 2, &count, &e), &e);
    assert_int_equal(count, 0);
    kvpt_destroy_cache(cache, pool);

    /* A layer-bound cache has no raw rows. */
    kvp_binding binding = kvpt_binding(H, W, CAP);
    kvp_cache *bound = kvpt_cache(pool, &binding, B, CAP);
    EXPECT_REFUSED(bound, pool, KVP_CACHE_LAYER_BOUND,
                   kvp_cache_reserved_slots(bound, 0, spans, 2, &count, &e));
    EXPECT_REFUSED(bound, pool, KVP_CACHE_LAYER_BOUND, kvp_cache_commit_written(bound, 1, &e));
    kvpt_destroy_cache(bound, pool);
    kvpt_destroy_pool(pool);
}

/*
 * A pool whose every page is cached and evictable: the reservation borrows
 * them; giving out their slots evicts them (counted), and the discard frees
 * them instead of putting them back on the LRU list.
 */
static void test_rows_borrowed_pages_are_evicted(void **state)
{
    (void)state;
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = BT;
    config.heads = H;
    config.head_width = W;
    config.budget_bytes = B * 2 * H * BT * W * sizeof(double);
    kvp_pool *pool = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_pool_create(&config, &pool, &err), &err);
    kvp_cache *cache = external(pool);
    double k[B * H * BT * W];
    double v[B * H * BT * W];
    kvpt_fill_random(k, B * H * BT * W, 3);
    kvpt_fill_random(v, B * H * BT * W, 4);
    kvpt_assert_ok(kvp_cache_append_rows(cache, k, v, BT, &err), &err);
    kvp_block_key keys[B];
    for (size_t lane = 0; lane < B; lane++) {
        kvpt_assert_ok(kvp_block_key_chain(NULL, cache, &lane, sizeof lane, NULL, &keys[lane],
                                           &err),
                       &err);
        kvpt_assert_ok(kvp_cache_publish_block(cache, lane, 0, &keys[lane], &err), &err);
    }
    kvpt_assert_ok(kvp_cache_reset(cache, &err), &err);
    kvp_pool_stats cached = kvpt_stats(pool);
    assert_int_equal(cached.evictable_pages, B);
    assert_int_equal(cached.free_pages, 0);
    kvpt_assert_ok(kvp_cache_reserve_rows(cache, 2, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_slot_span span;
    size_t count = 0;
    kvpt_assert_ok(kvp_cache_reserved_slots(cache, 0, &span, 1, &count, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats evicted = kvpt_stats(pool);
    assert_int_equal(evicted.evictions, cached.evictions + B);
    assert_int_equal(evicted.cached_pages, 0);
    kvpt_assert_ok(kvp_cache_discard_rows(cache, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvp_pool_stats after = kvpt_stats(pool);
    assert_int_equal(after.free_pages, B);
    assert_int_equal(after.evictable_pages, 0);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows_typed_equal_widened),
        cmocka_unit_test(test_rows_typed_refusals),
        cmocka_unit_test(test_rows_written_in_place_equal_appended),
        cmocka_unit_test(test_rows_written_then_discarded),
        cmocka_unit_test(test_rows_written_refusals),
        cmocka_unit_test(test_rows_borrowed_pages_are_evicted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
