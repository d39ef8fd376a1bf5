/*
 * test_paged.c: the public paged-attention call (kvpager/paged.h).
 *
 * Owns the checks that kvp_paged_attention, at the exact level:
 *   - on an attention cache, with the layer's heads and scale and the
 *     ticket's rotated query and candidate rows, gives the bits of the head
 *     outputs kvp_attention_prepare computed (the ticket's), for f64, f32 and
 *     bf16 pages, multi-head and grouped queries (H = 4 H_kv);
 *   - on an external cache holding the same rows (kvp_cache_append_rows of
 *     the attention cache's snapshots), gives the same bits; and without a
 *     candidate, on an external cache holding the candidate as its last
 *     retained row, the same bits again;
 *   - rounds candidate rows to the pool's dtype (raw and rounded rows give
 *     the same bits);
 *   - with f32 io, gives the f64 call's outputs on the widened f32 inputs,
 *     rounded once to f32;
 *   - on decoders of 1, 2 and 3 threads, at the finest partition and with
 *     the assist forced (held tasks), gives the serial bits;
 *   - refuses every bad argument, a candidate that cannot be stored, a busy
 *     decoder, a non-finite score and a failed workspace allocation with its
 *     typed status, changing nothing (snapshot) and writing no output;
 *   - accepts KVP_ACCUM_FAST with finite outputs (its bits are
 *     test_kernels' business);
 *   - allocates nothing on a call that needs no more workspace than the last;
 * and that kvp_pool_page_base gives every page's address as kvp_pool_page_data
 * does, and kvp_pool_page_data answers for a held page without the pool's
 * lock.
 * The audit runs after every operation that changes a cache.
 *
 * Unit test: reads the ticket's rows (attention/ticket_internal.h), sets the
 * gather's grain (attention/gather.h), forces the decoder's assist
 * (serve/decoder_internal.h) and arms the allocation fault injector.
 */
#include "support.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention/gather.h"
#include "attention/ticket_internal.h"
#include "pager/alloc.h"
#include "pager/dtype.h"
#include "pager/pool_internal.h"
#include "serve/decoder_internal.h"

enum { B = 2, H = 8, W = 16, BT = 3, LEN = 7, CAP = 12 };

/* The finest partition: a block per scores part, a row per softmax part, slices of 8. */
static const kvpi_gather_grain finest = {
    .chunk_bytes = 1, .min_parallel_bytes = 0, .softmax_elements = 1, .value_units = 1024};

static int teardown_grain(void **state)
{
    (void)state;
    kvpi_gather_grain_set(NULL);
    return 0;
}

/*
 * An attention cache of LEN rows (kvp_attention_forward), a ticket prepared
 * for the next token, and an external cache of the same pool holding the
 * same rows.
 */
typedef struct fixture {
    kvp_dtype dtype;
    size_t kv_heads;
    kvp_pool *pool;
    kvp_layer *layer;
    kvp_cache *cache;
    kvp_ticket *ticket;
    kvp_cache *ext;
} fixture;

static void fixture_make(fixture *f, kvp_dtype dtype, size_t kv_heads)
{
    kvp_error err;
    f->dtype = dtype;
    f->kv_heads = kv_heads;
    size_t pages = 3 * B * KVPT_CEIL_DIV(CAP, BT) + B;
    f->pool = kvpt_dtype_pool(BT, kv_heads, W, pages, dtype);
    kvpt_assert_ok(kvp_layer_create_random_grouped(H * W, H, kv_heads, CAP, 10000.0,
                                                   40 + kv_heads, &f->layer, &err),
                   &err);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(f->layer, &binding, &err), &err);
    f->cache = kvpt_cache(f->pool, &binding, B, CAP);
    f->ticket = kvpt_ticket(f->cache);
    double x[B * H * W];
    for (size_t t = 0; t <= LEN; t++) {
        kvpt_fill_random(x, B * H * W, 500 + t);
        kvp_tensor input = kvp_tensor3(x, B, 1, H * W);
        if (t < LEN) {
            kvpt_assert_ok(kvp_attention_forward(f->layer, &input, f->cache, f->ticket, &err),
                           &err);
        } else {
            kvpt_assert_ok(kvp_attention_prepare(f->layer, &input, f->cache, f->ticket, &err),
                           &err);
        }
        kvpt_assert_pool_ok(f->pool);
    }
    kvp_binding external;
    kvpt_assert_ok(kvp_binding_init_external(&external, kv_heads, W, CAP, 9, 1, &err), &err);
    f->ext = kvpt_cache(f->pool, &external, B, CAP);
    size_t n = B * kv_heads * LEN * W;
    double *keys = kvpt_doubles(n);
    double *values = kvpt_doubles(n);
    kvpt_assert_ok(kvp_cache_keys(f->cache, keys, n, &err), &err);
    kvpt_assert_ok(kvp_cache_values(f->cache, values, n, &err), &err);
    kvpt_assert_ok(kvp_cache_append_rows(f->ext, keys, values, LEN, &err), &err);
    kvpt_assert_pool_ok(f->pool);
    free(keys);
    free(values);
}

static void fixture_free(fixture *f)
{
    kvpt_destroy_cache(f->ext, f->pool);
    kvpt_destroy_ticket(f->ticket, f->pool);
    kvpt_destroy_cache(f->cache, f->pool);
    kvpt_destroy_layer(f->layer);
    kvpt_destroy_pool(f->pool);
}

static kvp_paged_attention_args args_of(const kvp_cache *cache, size_t heads, kvp_dtype io,
                                        const void *queries, const void *keys,
                                        const void *values, void *outputs)
{
    kvp_paged_attention_args a;
    kvp_paged_attention_args_init(&a);
    a.cache = cache;
    a.heads = heads;
    a.io_dtype = io;
    a.queries = queries;
    a.keys = keys;
    a.values = values;
    a.outputs = outputs;
    return a;
}

/* kvp_paged_attention, asserting success. */
static void paged_ok(const kvp_paged_attention_args *a, kvp_decoder *threads)
{
    kvp_error err;
    kvpt_assert_ok(kvp_paged_attention(a, threads, &err), &err);
}

static int same_bytes(const void *a, const void *b, size_t bytes)
{
    return memcmp(a, b, bytes) == 0;
}

static void test_paged_args_init_defaults(void **state)
{
    (void)state;
    kvp_paged_attention_args a;
    memset(&a, 0x5A, sizeof a);
    kvp_paged_attention_args_init(&a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.io_dtype, KVP_F64);
    assert_int_equal(a.accum, KVP_ACCUM_EXACT);
    assert_true(a.scale == 0.0);
    assert_int_equal(a.heads, 0);
    assert_null(a.cache);
    assert_null(a.queries);
    assert_null(a.keys);
    assert_null(a.values);
    assert_null(a.outputs);
    kvp_paged_attention_args_init(NULL);
}

/* Attention caches, external caches, with and without a candidate: the ticket's bits. */
static void check_equals_prepare(kvp_dtype dtype, size_t kv_heads)
{
    fixture f;
    fixture_make(&f, dtype, kv_heads);
    const kvp_ticket *t = f.ticket;
    size_t n = B * H * W;
    double *out = kvpt_doubles(n);

    kvpt_fill(out, n, NAN);
    kvp_paged_attention_args a = args_of(f.cache, H, KVP_F64, t->query, t->key, t->value, out);
    paged_ok(&a, NULL);
    assert_true(same_bytes(out, t->head_outputs, n * sizeof *out));

    /* heads 0: the binding's, the layer's H. */
    kvpt_fill(out, n, NAN);
    a.heads = 0;
    paged_ok(&a, NULL);
    assert_true(same_bytes(out, t->head_outputs, n * sizeof *out));

    /* The external cache of the same rows: its binding has H_kv heads, the call H. */
    kvpt_fill(out, n, NAN);
    a = args_of(f.ext, H, KVP_F64, t->query, t->key, t->value, out);
    paged_ok(&a, NULL);
    assert_true(same_bytes(out, t->head_outputs, n * sizeof *out));

    /* The candidate retained as row LEN, and no candidate: the same bits. */
    kvp_error err;
    kvpt_assert_ok(kvp_cache_append_rows(f.ext, t->key, t->value, 1, &err), &err);
    kvpt_assert_pool_ok(f.pool);
    kvpt_fill(out, n, NAN);
    a = args_of(f.ext, H, KVP_F64, t->query, NULL, NULL, out);
    paged_ok(&a, NULL);
    assert_true(same_bytes(out, t->head_outputs, n * sizeof *out));

    free(out);
    fixture_free(&f);
}

static void test_paged_equals_prepare(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16};
    for (size_t i = 0; i < KVPT_COUNT_OF(dtypes); i++) {
        check_equals_prepare(dtypes[i], H);
        check_equals_prepare(dtypes[i], H / 4);
    }
}

/* f32 io: the f64 call on the widened f32 inputs, rounded once to f32. */
static void check_f32_io(kvp_dtype dtype)
{
    fixture f;
    fixture_make(&f, dtype, H / 4);
    const kvp_ticket *t = f.ticket;
    size_t n = B * H * W;
    size_t kv = B * (H / 4) * W;
    float q32[B * H * W];
    float k32[B * H * W];
    float v32[B * H * W];
    double q64[B * H * W];
    double k64[B * H * W];
    double v64[B * H * W];
    for (size_t i = 0; i < n; i++) {
        q32[i] = (float)t->query[i];
        q64[i] = q32[i];
    }
    for (size_t i = 0; i < kv; i++) {
        k32[i] = (float)(t->key[i] * 3.0);
        v32[i] = (float)(t->value[i] * 3.0);
        k64[i] = k32[i];
        v64[i] = v32[i];
    }
    double *want = kvpt_doubles(n);
    kvp_paged_attention_args a = args_of(f.ext, H, KVP_F64, q64, k64, v64, want);
    paged_ok(&a, NULL);
    float want32[B * H * W];
    for (size_t i = 0; i < n; i++) {
        assert_true(isfinite(want[i]));
        want32[i] = (float)want[i];
    }
    float got[B * H * W];
    memset(got, 0x5A, sizeof got);
    a = args_of(f.ext, H, KVP_F32, q32, k32, v32, got);
    paged_ok(&a, NULL);
    assert_true(same_bytes(got, want32, sizeof got));
    /* The attention cache: the same rows, the same bits. */
    memset(got, 0x5A, sizeof got);
    a = args_of(f.cache, H, KVP_F32, q32, k32, v32, got);
    paged_ok(&a, NULL);
    assert_true(same_bytes(got, want32, sizeof got));
    free(want);
    fixture_free(&f);
}

static void test_paged_f32_io(void **state)
{
    (void)state;
    check_f32_io(KVP_F64);
    check_f32_io(KVP_F32);
    check_f32_io(KVP_BF16);
}

/* Candidate rows are rounded to the pool's dtype: unrounded and rounded rows, the same bits. */
static void test_paged_candidates_are_rounded(void **state)
{
    (void)state;
    static const kvp_dtype dtypes[] = {KVP_F32, KVP_BF16};
    for (size_t i = 0; i < KVPT_COUNT_OF(dtypes); i++) {
        fixture f;
        fixture_make(&f, dtypes[i], H / 4);
        size_t kv = B * (H / 4) * W;
        double raw[2][B * H * W];
        double rounded[2][B * H * W];
        kvpt_fill_random(raw[0], kv, 71);
        kvpt_fill_random(raw[1], kv, 72);
        size_t changed = 0;
        for (size_t j = 0; j < kv; j++) {
            rounded[0][j] = kvpi_dtype_round(dtypes[i], raw[0][j]);
            rounded[1][j] = kvpi_dtype_round(dtypes[i], raw[1][j]);
            changed += rounded[0][j] != raw[0][j];
        }
        assert_true(changed > 0);
        double want[B * H * W];
        double got[B * H * W];
        kvp_paged_attention_args a =
            args_of(f.ext, H, KVP_F64, f.ticket->query, rounded[0], rounded[1], want);
        paged_ok(&a, NULL);
        a = args_of(f.ext, H, KVP_F64, f.ticket->query, raw[0], raw[1], got);
        paged_ok(&a, NULL);
        assert_true(same_bytes(got, want, sizeof got));
        fixture_free(&f);
    }
}

/* Decoders of 1, 2 and 3 threads, the assist forced at the finest grain: the serial bits. */
static void check_threads(kvp_dtype dtype, size_t kv_heads, kvp_decoder *const *decoders)
{
    fixture f;
    fixture_make(&f, dtype, kv_heads);
    const kvp_ticket *t = f.ticket;
    size_t n = B * H * W;
    double *serial = kvpt_doubles(n);
    double *out = kvpt_doubles(n);
    kvpi_gather_grain_set(&finest);
    const kvp_cache *caches[2] = {f.cache, f.ext};
    for (size_t c = 0; c < 2; c++) {
        kvp_paged_attention_args a =
            args_of(caches[c], H, KVP_F64, t->query, t->key, t->value, serial);
        paged_ok(&a, NULL);
        assert_true(same_bytes(serial, t->head_outputs, n * sizeof *serial));
        a.outputs = out;
        for (size_t d = 0; d < 3; d++) {
            kvpt_fill(out, n, NAN);
            uint64_t before = kvpi_decoder_assisted_parts(decoders[d]);
            kvpi_decoder_hold_tasks(decoders[d], SIZE_MAX);
            paged_ok(&a, decoders[d]);
            kvpi_decoder_hold_tasks(decoders[d], 0);
            assert_true(same_bytes(out, serial, n * sizeof *out));
            /* Every phase was posted and held: another thread helped with each. */
            uint64_t helped = kvpi_decoder_assisted_parts(decoders[d]) - before;
            assert_true(d == 0 ? helped == 0 : helped >= 3);
        }
    }
    kvpi_gather_grain_set(NULL);
    free(serial);
    free(out);
    fixture_free(&f);
}

static void test_paged_threads_same_bits(void **state)
{
    (void)state;
    kvp_decoder *decoders[3] = {kvpt_decoder(1), kvpt_decoder(2), kvpt_decoder(3)};
    check_threads(KVP_F64, H / 4, decoders);
    check_threads(KVP_BF16, H, decoders);
    check_threads(KVP_F32, 1, decoders);
    for (size_t d = 0; d < 3; d++) {
        kvpt_destroy_decoder(decoders[d]);
    }
}

static void test_paged_fast_is_accepted(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, KVP_BF16, H / 4);
    const kvp_ticket *t = f.ticket;
    size_t n = B * H * W;
    double *out = kvpt_doubles(n);
    kvpt_fill(out, n, NAN);
    kvp_paged_attention_args a = args_of(f.ext, H, KVP_F64, t->query, t->key, t->value, out);
    a.accum = KVP_ACCUM_FAST;
    paged_ok(&a, NULL);
    for (size_t i = 0; i < n; i++) {
        assert_true(isfinite(out[i]));
    }
    free(out);
    fixture_free(&f);
}

/* ---- refusals ------------------------------------------------------------------- */

/*
 * One failing call: its status in the return value and in err, the pool and
 * both caches unchanged (snapshot), and the output buffer untouched.
 */
#define EXPECT_REFUSED(f, expected, args, threads)                                          \
    do {                                                                                    \
        kvpt_snapshot snap_;                                                                \
        kvpt_snapshot_init(&snap_, (f)->pool);                                              \
        kvpt_snapshot_add_cache(&snap_, (f)->cache);                                        \
        kvpt_snapshot_add_cache(&snap_, (f)->ext);                                          \
        kvpt_snapshot_add_ticket(&snap_, (f)->ticket);                                      \
        kvpt_snapshot_take(&snap_);                                                         \
        kvpt_fill(out_, B *H *W, -7.0);                                                     \
        kvp_error e_;                                                                       \
        memset(&e_, 0x5A, sizeof e_);                                                       \
        kvp_status got_ = kvp_paged_attention((args), (threads), &e_);                      \
        if (got_ != (expected) || e_.status != (expected)) {                                \
            print_error("%s:%d: got %s (err %s), expected %s\n", __FILE__, __LINE__,        \
                        kvp_status_name(got_), kvp_status_name(e_.status),                  \
                        kvp_status_name(expected));                                         \
            fail();                                                                         \
        }                                                                                   \
        kvpt_assert_unchanged(&snap_, 0);                                                   \
        kvpt_assert_filled(out_, B *H *W, -7.0);                                            \
        last_error_ = e_;                                                                   \
    } while (0)

/* The decoder's solo job: the same call on the same decoder, which is stepping. */
typedef struct busy_ctx {
    const kvp_paged_attention_args *args;
    kvp_decoder *decoder;
    kvp_status status;
    kvp_error err;
} busy_ctx;

static void call_inside(void *ctx, const kvpi_parallel *par)
{
    (void)par;
    busy_ctx *b = ctx;
    b->status = kvp_paged_attention(b->args, b->decoder, &b->err);
}

static void test_paged_refusals_change_nothing(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, KVP_F32, H / 4);
    const kvp_ticket *t = f.ticket;
    double out_[B * H * W];
    kvp_error last_error_;
    kvp_paged_attention_args good = args_of(f.ext, H, KVP_F64, t->query, t->key, t->value, out_);

    EXPECT_REFUSED(&f, KVP_NULL_ARGUMENT, NULL, NULL);
    assert_string_equal(last_error_.argument, "args");
    kvp_paged_attention_args a = good;
    a.struct_size = 0;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "struct_size");
    a = good;
    a.cache = NULL;
    EXPECT_REFUSED(&f, KVP_NULL_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "cache");
    a = good;
    a.queries = NULL;
    EXPECT_REFUSED(&f, KVP_NULL_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "queries");
    a = good;
    a.outputs = NULL;
    EXPECT_REFUSED(&f, KVP_NULL_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "outputs");
    a = good;
    a.heads = H / 4 + 1;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "heads");
    a = good;
    a.io_dtype = KVP_BF16;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "io_dtype");
    a = good;
    a.accum = (kvp_accum)2;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "accum");
    a = good;
    a.values = NULL;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "values");
    a = good;
    a.keys = NULL;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "keys");
    static const double bad_scales[] = {NAN, INFINITY, -0.5};
    for (size_t i = 0; i < KVPT_COUNT_OF(bad_scales); i++) {
        a = good;
        a.scale = bad_scales[i];
        EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
        assert_string_equal(last_error_.argument, "scale");
    }
    /* A too long struct whose unknown tail is set. */
    struct {
        kvp_paged_attention_args args;
        uint64_t tail;
    } longer = {good, 1};
    longer.args.struct_size = sizeof longer;
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &longer.args, NULL);
    assert_string_equal(last_error_.argument, "struct_size");

    /* An empty cache without a candidate. */
    kvp_error err;
    kvp_binding binding;
    kvpt_assert_ok(kvp_binding_init_external(&binding, H / 4, W, CAP, 9, 1, &err), &err);
    kvp_cache *empty = kvpt_cache(f.pool, &binding, B, CAP);
    a = args_of(empty, H, KVP_F64, t->query, NULL, NULL, out_);
    EXPECT_REFUSED(&f, KVP_INVALID_ARGUMENT, &a, NULL);
    assert_string_equal(last_error_.argument, "keys");
    kvpt_destroy_cache(empty, f.pool);

    /* The candidate: a NaN key, then a value the f32 pages cannot hold. */
    size_t kv = B * (H / 4) * W;
    double keys[B * H * W];
    double values[B * H * W];
    memcpy(keys, t->key, kv * sizeof *keys);
    memcpy(values, t->value, kv * sizeof *values);
    keys[kv - 2] = NAN;
    values[3] = 1e300;
    a = args_of(f.ext, H, KVP_F64, t->query, keys, values, out_);
    EXPECT_REFUSED(&f, KVP_NONFINITE_KEY, &a, NULL);
    assert_int_equal(last_error_.index, kv - 2);
    assert_null(last_error_.what);
    keys[kv - 2] = t->key[kv - 2];
    EXPECT_REFUSED(&f, KVP_NONFINITE_VALUE, &a, NULL);
    assert_int_equal(last_error_.index, 3);
    assert_string_equal(last_error_.what, "f32");
    /* The same through f32 io: an infinite f32 key. */
    float q32[B * H * W];
    float k32[B * H * W];
    float v32[B * H * W];
    for (size_t i = 0; i < B * H * W; i++) {
        q32[i] = (float)t->query[i];
        k32[i] = i < kv ? (float)t->key[i] : 0.0f;
        v32[i] = i < kv ? (float)t->value[i] : 0.0f;
    }
    k32[5] = INFINITY;
    a = args_of(f.cache, H, KVP_F32, q32, k32, v32, out_);
    EXPECT_REFUSED(&f, KVP_NONFINITE_KEY, &a, NULL);
    assert_int_equal(last_error_.index, 5);

    /* A query that overflows a score: NONFINITE_SCORE before any output is written. */
    double q[B * H * W];
    memcpy(q, t->query, sizeof q);
    q[W * 3] = NAN; /* lane 0, head 3 */
    a = args_of(f.ext, H, KVP_F64, q, t->key, t->value, out_);
    EXPECT_REFUSED(&f, KVP_NONFINITE_SCORE, &a, NULL);
    assert_int_equal(last_error_.index, 3 * (LEN + 1));
    kvp_decoder *decoder = kvpt_decoder(2);
    kvpi_gather_grain_set(&finest);
    EXPECT_REFUSED(&f, KVP_NONFINITE_SCORE, &a, decoder);
    kvpi_gather_grain_set(NULL);

    /* A decoder that is running: DECODER_BUSY, from a call made inside its step. */
    busy_ctx busy = {&good, decoder, KVP_OK, {0}};
    kvpt_fill(out_, B * H * W, -7.0);
    kvpt_assert_ok(kvpi_decoder_run(decoder, call_inside, &busy, &err), &err);
    assert_int_equal(busy.status, KVP_DECODER_BUSY);
    assert_int_equal(busy.err.status, KVP_DECODER_BUSY);
    kvpt_assert_filled(out_, B * H * W, -7.0);
    kvpt_destroy_decoder(decoder);

    /* A workspace too large to size. */
    a = good;
    a.heads = (SIZE_MAX / 8) / (H / 4) * (H / 4);
    EXPECT_REFUSED(&f, KVP_ALLOCATION_FAILED, &a, NULL);
    fixture_free(&f);
}

/* A thread's first call, its workspace allocation failed by the injector. */
typedef struct fault_ctx {
    const kvp_paged_attention_args *args;
    kvpt_fault_step step;
} fault_ctx;

static void *first_call_fails(void *arg)
{
    fault_ctx *c = arg;
    kvpt_fault_step_arm(&c->step, 1);
    kvp_status status = kvp_paged_attention(c->args, NULL, &c->step.err);
    kvpt_fault_step_finish(&c->step, status);
    return NULL;
}

static void test_paged_workspace(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, KVP_F64, H / 4);
    const kvp_ticket *t = f.ticket;
    double out[B * H * W];
    kvpt_fill(out, B * H * W, -7.0);
    kvp_paged_attention_args a = args_of(f.ext, H, KVP_F64, t->query, t->key, t->value, out);
    kvpt_snapshot snap;
    kvpt_snapshot_init(&snap, f.pool);
    kvpt_snapshot_add_cache(&snap, f.ext);
    kvpt_snapshot_take(&snap);
    fault_ctx c = {&a, {0}};
    pthread_t thread;
    assert_int_equal(pthread_create(&thread, NULL, first_call_fails, &c), 0);
    assert_int_equal(pthread_join(thread, NULL), 0);
    kvpt_assert_fault_failed(&c.step, 1);
    kvpt_assert_unchanged(&snap, 0);
    kvpt_assert_filled(out, B * H * W, -7.0);
    /*
     * The workspace stays: after one call of a shape, the next allocates
     * nothing (the injector, armed never to fire, counts every allocation
     * of the library).
     */
    kvp_error err;
    kvpt_assert_ok(kvp_paged_attention(&a, NULL, &err), &err);
    kvpt_fault_step again;
    kvpt_fault_step_arm(&again, UINT64_MAX);
    kvp_status status = kvp_paged_attention(&a, NULL, &again.err);
    kvpt_fault_step_finish(&again, status);
    kvpt_assert_ok(status, &again.err);
    assert_int_equal(again.calls, 0);
    assert_true(same_bytes(out, t->head_outputs, sizeof out));
    fixture_free(&f);
}

/* ---- page addresses without the pool's lock ------------------------------------ */

/*
 * kvp_pool_page_base: base + page * stride is kvp_pool_page_data's address
 * of every page of every block table, the stride is page_bytes, and the
 * answer is the slab's, the same on every call.
 */
static void test_paged_page_base(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, KVP_BF16, H / 4);
    kvp_error err;
    void *base = NULL;
    size_t stride = 0;
    size_t pages = 0;
    kvpt_assert_ok(kvp_pool_page_base(f.pool, &base, &stride, &pages, &err), &err);
    kvp_pool_stats stats = kvpt_stats(f.pool);
    assert_true((uintptr_t)base == stats.slab_address);
    assert_int_equal(stride, stats.page_bytes);
    assert_int_equal(pages, stats.total_pages);
    void *again = NULL;
    size_t stride_again = 0;
    kvpt_assert_ok(kvp_pool_page_base(f.pool, &again, &stride_again, NULL, &err), &err);
    assert_ptr_equal(again, base);
    assert_int_equal(stride_again, stride);
    const kvp_cache *caches[2] = {f.cache, f.ext};
    size_t checked = 0;
    for (size_t c = 0; c < 2; c++) {
        for (size_t lane = 0; lane < B; lane++) {
            const uint32_t *table = NULL;
            size_t blocks = 0;
            kvpt_assert_ok(kvp_cache_block_table(caches[c], lane, &table, &blocks, &err), &err);
            for (size_t b = 0; b < blocks; b++) {
                const void *k = NULL;
                const void *v = NULL;
                kvp_page_layout layout;
                kvp_page_layout_init(&layout);
                kvpt_assert_ok(kvp_pool_page_data(f.pool, table[b], &k, &v, &layout, &err),
                               &err);
                const unsigned char *at = (const unsigned char *)base + table[b] * stride;
                assert_ptr_equal(k, at);
                assert_ptr_equal(v, at + layout.values_offset_bytes);
                assert_int_equal(layout.page_bytes, stride);
                checked++;
            }
        }
    }
    assert_int_equal(checked, 2 * B * KVPT_CEIL_DIV(LEN, BT));
    assert_int_equal(kvp_pool_page_base(NULL, &base, &stride, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "pool");
    assert_int_equal(kvp_pool_page_base(f.pool, NULL, &stride, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "base");
    assert_int_equal(kvp_pool_page_base(f.pool, &base, NULL, NULL, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "page_stride");
    fixture_free(&f);
}

/* A thread reading every held page's data while the test holds the pool's lock. */
typedef struct unlocked_reader {
    kvp_pool *pool;
    const uint32_t *pages;
    size_t count;
    pthread_mutex_t lock; /* guards done and status */
    pthread_cond_t finished;
    int done;
    kvp_status status;
} unlocked_reader;

static void *read_pages(void *arg)
{
    unlocked_reader *r = arg;
    kvp_status status = KVP_OK;
    for (size_t i = 0; i < r->count && status == KVP_OK; i++) {
        const void *k = NULL;
        const void *v = NULL;
        status = kvp_pool_page_data(r->pool, r->pages[i], &k, &v, NULL, NULL);
    }
    pthread_mutex_lock(&r->lock);
    r->status = status;
    r->done = 1;
    pthread_cond_signal(&r->finished);
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

/*
 * kvp_pool_page_data takes no lock for a held page: it answers while
 * another thread holds the pool's mutex (the test waits up to 60 s for it,
 * then releases the lock either way, so a regression fails instead of
 * hanging). A free page's refusal still says "free".
 */
static void test_paged_page_data_takes_no_lock(void **state)
{
    (void)state;
    fixture f;
    fixture_make(&f, KVP_F64, H / 4);
    const uint32_t *table = NULL;
    size_t blocks = 0;
    kvp_error err;
    kvpt_assert_ok(kvp_cache_block_table(f.ext, 1, &table, &blocks, &err), &err);
    unlocked_reader r = {.pool = f.pool, .pages = table, .count = blocks,
                         .status = KVP_INVALID_ARGUMENT};
    pthread_mutex_init(&r.lock, NULL);
    pthread_cond_init(&r.finished, NULL);
    kvpi_pool_lock(f.pool);
    pthread_t thread;
    int started = pthread_create(&thread, NULL, read_pages, &r) == 0;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 60;
    pthread_mutex_lock(&r.lock);
    while (started && !r.done) {
        if (pthread_cond_timedwait(&r.finished, &r.lock, &deadline) != 0) {
            break; /* timed out: page_data is waiting for the pool's lock */
        }
    }
    int done = r.done;
    pthread_mutex_unlock(&r.lock);
    kvpi_pool_unlock(f.pool);
    assert_true(started);
    assert_int_equal(pthread_join(thread, NULL), 0);
    pthread_cond_destroy(&r.finished);
    pthread_mutex_destroy(&r.lock);
    assert_true(done);
    assert_int_equal(r.status, KVP_OK);
    /* Every page is free in a fresh pool of one page: the refusal, under the lock. */
    kvp_pool *one = kvpt_pool(BT, 1, W, 1);
    const void *k = NULL;
    const void *v = NULL;
    assert_int_equal(kvp_pool_page_data(one, 0, &k, &v, NULL, &err), KVP_PAGE_NOT_HELD);
    assert_string_equal(err.what, "free");
    kvpt_destroy_pool(one);
    fixture_free(&f);
}

int main(void)
{
    kvpt_watchdog("test_paged", 120);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_paged_args_init_defaults),
        cmocka_unit_test(test_paged_equals_prepare),
        cmocka_unit_test(test_paged_f32_io),
        cmocka_unit_test(test_paged_candidates_are_rounded),
        cmocka_unit_test_teardown(test_paged_threads_same_bits, teardown_grain),
        cmocka_unit_test(test_paged_fast_is_accepted),
        cmocka_unit_test_teardown(test_paged_refusals_change_nothing, teardown_grain),
        cmocka_unit_test_teardown(test_paged_workspace, kvpt_disarm),
        cmocka_unit_test(test_paged_page_base),
        cmocka_unit_test(test_paged_page_data_takes_no_lock),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
