/*
 * test_window.c: sliding windows and attention sinks in attention (issue 21,
 * part 1 and the attention side of sinks; docs/DESIGN.md, "Sliding windows
 * and sinks").
 *
 * Checks:
 *   - the rule: kvpi_window_span_at against the definition written out
 *     (position p attends q when W = 0, q - p < W, or p < S), every W, S, q;
 *   - decode through pages equals the windowed reference (f64, 1e-12, and
 *     bit for bit) with the window's edges at and on either side of every
 *     block edge, W = 1, sinks inside, at and past a block edge and
 *     overlapping the window, block sizes 1, 2, 3, 16 bit for bit, and
 *     W >= length equal to full attention bit for bit; a step's result
 *     lists exactly the attended positions;
 *   - the gather on a windowed cache equals the gather on a full cache that
 *     holds only the attended rows, bit for bit, for every page dtype, both
 *     accumulation levels, every ISA level, serially and partitioned
 *     (finest grain, parts run in reverse), and across block sizes: the
 *     windowed gather is the full one on the attended rows, which
 *     test_fast.c checks against the documented fast reference;
 *   - the blocked prefill with windows equals the windowed reference
 *     (f64 and bf16 pages, serial and partitioned);
 *   - W and S in the record and digest (a full layer's record bytes are
 *     those from before windows), kvp_layer_info behind struct_size, the
 *     refusals of kvp_layer_set_window and of prepare
 *     (CACHE_WINDOW_MISMATCH), each changing nothing.
 */
#include "support.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <valgrind/valgrind.h>

#include "attention/gather.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "attention/prefill.h"
#include "pager/cache_internal.h"

static kvpi_isa initial_level;

static int restore(void **state)
{
    (void)state;
    kvpi_gather_grain_set(NULL);
    return kvpi_kernels_use(initial_level) == 0 ? 0 : -1;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static double unit(void)
{
    return (double)(kvpt_rand_next(&rng) >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

static void fill_random(double *x, size_t n, uint64_t seed)
{
    rng = seed;
    for (size_t i = 0; i < n; i++) {
        x[i] = unit();
    }
}

/* An executor running the parts in reverse order on this thread: the partition, no threads. */
static void reverse_run(const kvpi_parallel *self, kvpi_part_fn fn, void *ctx, size_t parts)
{
    (void)self;
    for (size_t p = parts; p-- > 0;) {
        fn(ctx, p);
    }
}
static const kvpi_parallel reverse = {reverse_run, NULL};
static const kvpi_gather_grain finest = {
    .chunk_bytes = 1, .min_parallel_bytes = 0, .softmax_elements = 1, .value_units = 1024};

/* The definition: does the query at q attend to position p <= q? */
static int attends(size_t window, size_t sinks, size_t q, size_t p)
{
    return window == 0 || q - p < window || p < sinks;
}

/* The i-th position the query at q attends to, by the definition (SIZE_MAX past the last). */
static size_t nth_attended(size_t window, size_t sinks, size_t q, size_t i)
{
    for (size_t p = 0; p <= q; p++) {
        if (attends(window, sinks, q, p) && i-- == 0) {
            return p;
        }
    }
    return SIZE_MAX;
}

static size_t count_attended(size_t window, size_t sinks, size_t q)
{
    size_t n = 0;
    for (size_t p = 0; p <= q; p++) {
        n += (size_t)attends(window, sinks, q, p);
    }
    return n;
}

/* ---- the rule ------------------------------------------------------------------ */

static void test_window_rule_is_the_definition(void **state)
{
    (void)state;
    for (size_t w = 0; w <= 12; w++) {
        for (size_t s = 0; s <= (w == 0 ? 0 : 14); s++) {
            for (size_t q = 0; q <= 30; q++) {
                kvpi_window_span sp = kvpi_window_span_at(w, s, q);
                size_t keys = kvpi_window_keys(sp, q);
                assert_int_equal(keys, count_attended(w, s, q));
                for (size_t i = 0; i < keys; i++) {
                    size_t p = i < sp.sinks ? i : sp.lo + (i - sp.sinks);
                    assert_int_equal(p, nth_attended(w, s, q, i));
                }
            }
        }
    }
}

/* ---- decode and the reference ------------------------------------------------------ */

enum { D_WIDTH = 8, D_HEADS = 2, D_BATCH = 2, D_TOKENS = 40, D_POSITIONS = 64 };

static kvp_layer *windowed_layer(size_t kv_heads, size_t window, size_t sinks)
{
    kvp_layer *layer = NULL;
    kvp_error err;
    kvpt_assert_ok(kvp_layer_create_random_grouped(D_WIDTH, D_HEADS, kv_heads, D_POSITIONS,
                                                   10000.0, 21, &layer, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_set_window(layer, window, sinks, &err), &err);
    return layer;
}

/*
 * Decodes the [B, T, D] input token by token through a cache of block size
 * bt on `dtype` pages, writing the outputs [B, T, D]; checks each step's
 * result lists the attended positions, weights summing to 1.
 */
static void decode_all(kvp_layer *layer, kvp_dtype dtype, size_t bt, const double *input,
                       size_t tokens, double *out)
{
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvp_error err;
    kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
    kvp_pool *pool = kvpt_dtype_pool(bt, info.kv_heads, info.head_width,
                                     D_BATCH * KVPT_CEIL_DIV(tokens, bt), dtype);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, D_BATCH, tokens);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double row[D_BATCH * D_WIDTH];
    for (size_t t = 0; t < tokens; t++) {
        for (size_t b = 0; b < D_BATCH; b++) {
            memcpy(row + b * D_WIDTH, input + (b * tokens + t) * D_WIDTH, sizeof(double) * D_WIDTH);
        }
        kvp_tensor x = kvp_tensor3(row, D_BATCH, 1, D_WIDTH);
        kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
        kvp_attention_result r;
        kvpt_assert_ok(kvp_ticket_result(ticket, &r, &err), &err);
        assert_int_equal(r.keys, count_attended(info.window, info.sink_tokens, t));
        for (size_t h = 0; h < D_BATCH * D_HEADS; h++) {
            double sum = 0.0;
            for (size_t i = 0; i < r.keys; i++) {
                sum += r.weights[h * r.keys + i];
            }
            assert_true(fabs(sum - 1.0) < 1e-12);
        }
        for (size_t b = 0; b < D_BATCH; b++) {
            memcpy(out + (b * tokens + t) * D_WIDTH, r.output + b * D_WIDTH,
                   sizeof(double) * D_WIDTH);
        }
    }
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

static void assert_same_bits(const double *a, const double *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!kvpt_same_bits(a[i], b[i])) {
            print_error("element %zu: %.17g != %.17g\n", i, a[i], b[i]);
            fail();
        }
    }
}

/* Adds x to list[0..*n) unless it is there already or out of (0, limit]. */
static void add_unique(size_t *list, size_t *n, size_t x, size_t lowest, size_t limit)
{
    if (x < lowest || x > limit) {
        return;
    }
    for (size_t i = 0; i < *n; i++) {
        if (list[i] == x) {
            return;
        }
    }
    list[(*n)++] = x;
}

static void test_window_decode_equals_reference_at_every_block_edge(void **state)
{
    (void)state;
    const size_t bts[] = {16, 1, 2, 3};
    const size_t T = D_TOKENS;
    size_t n = D_BATCH * T * D_WIDTH;
    double *input = kvpt_doubles(n);
    double *ref = kvpt_doubles(n);
    double *out = kvpt_doubles(n);
    double *first = kvpt_doubles(n);
    double *full = kvpt_doubles(n);
    fill_random(input, n, 0x5EED);
    kvp_tensor x = kvp_tensor3(input, D_BATCH, T, D_WIDTH);
    kvp_error err;
    for (size_t kv_heads = 1; kv_heads <= 2; kv_heads++) {
        kvp_layer *plain = windowed_layer(kv_heads, 0, 0);
        kvpt_assert_ok(kvp_attention_reference(plain, &x, full, n, NULL, NULL, 0, &err), &err);
        kvpt_destroy_layer(plain);
        size_t cases = 0;
        for (size_t bi = 1; bi < KVPT_COUNT_OF(bts); bi++) {
            size_t bt = bts[bi];
            /* W and S at, and on either side of, the first two block edges; T and past T. */
            size_t ws[16], nw = 0;
            const size_t wcand[] = {1, bt - 1, bt, bt + 1, 2 * bt - 1, 2 * bt, 2 * bt + 1,
                                    16, 17, T - 1, T, T + 5};
            for (size_t i = 0; i < KVPT_COUNT_OF(wcand); i++) {
                add_unique(ws, &nw, wcand[i], 1, D_POSITIONS);
            }
            for (size_t wi = 0; wi < nw; wi++) {
                size_t w = ws[wi];
                size_t ss[16], ns = 0;
                const size_t scand[] = {0, 1, bt - 1, bt, bt + 1, w - 1, w, w + 1, 20};
                for (size_t i = 0; i < KVPT_COUNT_OF(scand); i++) {
                    add_unique(ss, &ns, scand[i], 0, D_POSITIONS);
                }
                for (size_t si = 0; si < ns; si++) {
                    kvp_layer *layer = windowed_layer(kv_heads, w, ss[si]);
                    kvpt_assert_ok(kvp_attention_reference(layer, &x, ref, n, NULL, NULL, 0, &err),
                                   &err);
                    /* Block size 16, then bt: both equal the reference, bit for bit. */
                    decode_all(layer, KVP_F64, 16, input, T, first);
                    decode_all(layer, KVP_F64, bt, input, T, out);
                    assert_true(kvpt_max_abs_diff(out, ref, n) <= 1e-12);
                    assert_same_bits(out, ref, n);
                    assert_same_bits(out, first, n);
                    /* Every token attending every position (W >= length, or sinks
                       covering the rest): full attention, bit for bit. */
                    int all = 1;
                    for (size_t t = 0; t < T; t++) {
                        all &= count_attended(w, ss[si], t) == t + 1;
                    }
                    assert_true(all || w < T);
                    if (all) {
                        assert_same_bits(out, full, n);
                    } else {
                        assert_true(kvpt_max_abs_diff(out, full, n) > 0.0);
                    }
                    kvpt_destroy_layer(layer);
                    cases++;
                }
            }
        }
        printf("# kv_heads %zu: %zu (bt, W, S) cases equal the reference bit for bit\n",
               kv_heads, cases);
    }
    free(input);
    free(ref);
    free(out);
    free(first);
    free(full);
}

/* Narrow pages: decode equals the windowed stored-dtype reference, bit for bit. */
static void test_window_decode_narrow_pages_equal_stored_reference(void **state)
{
    (void)state;
    const kvp_dtype dtypes[] = {KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    const size_t T = 24;
    size_t n = D_BATCH * T * D_WIDTH;
    double *input = kvpt_doubles(n);
    double *ref = kvpt_doubles(n);
    double *out = kvpt_doubles(n);
    fill_random(input, n, 0xD7);
    kvp_tensor x = kvp_tensor3(input, D_BATCH, T, D_WIDTH);
    kvp_error err;
    for (size_t i = 0; i < KVPT_COUNT_OF(dtypes); i++) {
        kvp_layer *layer = windowed_layer(1, 5, 3);
        kvpt_assert_ok(kvp_layer_set_kv_scales(layer, 0.5, 0.25, &err), &err);
        kvpt_assert_ok(kvp_attention_reference_stored(layer, dtypes[i], &x, ref, n, NULL, NULL, 0,
                                                      &err),
                       &err);
        for (size_t bt = 1; bt <= 4; bt++) {
            decode_all(layer, dtypes[i], bt, input, T, out);
            assert_same_bits(out, ref, n);
        }
        kvpt_destroy_layer(layer);
    }
    free(input);
    free(ref);
    free(out);
}

/* ---- the gather: a window is the full gather on the attended rows ------------------- */

enum { G_BATCH = 2, G_HEADS = 4, G_KV = 2, G_D = 16, G_LEN = 37 };

/* A pool of `dtype`, or NULL when pools refuse the dtype here. */
static kvp_pool *try_pool(size_t bt, size_t pages, kvp_dtype dtype)
{
    kvp_pool_config config;
    kvp_pool_config_init(&config);
    config.block_tokens = bt;
    config.heads = G_KV;
    config.head_width = G_D;
    config.budget_bytes = pages * 2 * G_KV * bt * G_D * kvp_dtype_bytes(dtype);
    config.dtype = dtype;
    kvp_pool *pool = NULL;
    if (kvp_pool_create(&config, &pool, NULL) != KVP_OK) {
        return NULL;
    }
    return pool;
}

/* Position p's key (value) row of KV head kv in `lane`, widened from the page. */
static void stored_row(const kvp_cache *c, size_t lane, size_t kv, size_t p, int value,
                       double *row)
{
    uint32_t page = kvpi_cache_lane_table(c, lane)[p / c->block_tokens];
    const void *rows = value ? kvpi_cache_page_values(c, page, kv) : kvpi_cache_page_keys(c, page, kv);
    for (size_t f = 0; f < G_D; f++) {
        row[f] = kvpi_rows_widen((kvpi_rows)kvpi_cache_dtype(c), rows,
                                 (p % c->block_tokens) * G_D + f);
    }
}

/* Appends to `to` the rows of `from` at the positions `pos[0..n)`, every lane and KV head. */
static void copy_rows(kvp_cache *to, const kvp_cache *from, const size_t *pos, size_t n)
{
    double k[G_BATCH * G_KV * G_D];
    double v[G_BATCH * G_KV * G_D];
    kvp_error err;
    for (size_t i = 0; i < n; i++) {
        for (size_t lane = 0; lane < G_BATCH; lane++) {
            for (size_t kv = 0; kv < G_KV; kv++) {
                stored_row(from, lane, kv, pos[i], 0, k + (lane * G_KV + kv) * G_D);
                stored_row(from, lane, kv, pos[i], 1, v + (lane * G_KV + kv) * G_D);
            }
        }
        kvp_tensor kt = kvp_tensor4(k, G_BATCH, G_KV, 1, G_D);
        kvp_tensor vt = kvp_tensor4(v, G_BATCH, G_KV, 1, G_D);
        kvpt_assert_ok(kvpi_cache_append(to, &kt, &vt, &err), &err);
    }
}

/* The weights and outputs of one gather job, widened to f64. */
typedef struct gathered {
    size_t keys;
    double w[G_BATCH * G_HEADS * (G_LEN + 1)];
    double o[G_BATCH * G_HEADS * G_D];
} gathered;

static void gather_run(const kvp_cache *cache, const double *queries, const double *keys,
                       const double *values, kvp_accum accum, int partitioned, gathered *g)
{
    kvpt_fill(g->w, KVPT_COUNT_OF(g->w), NAN);
    kvpt_fill(g->o, KVPT_COUNT_OF(g->o), NAN);
    kvpi_gather_job job = {.cache = cache, .queries = queries, .keys = keys, .values = values,
                           .scale = 1.0 / sqrt((double)G_D), .weights = g->w, .outputs = g->o,
                           .accum = accum};
    kvpi_gather_grain_set(partitioned ? &finest : NULL);
    kvpi_gather_attend_on(&job, partitioned ? &reverse : NULL);
    kvpi_gather_widen_weights(&job);
    kvpi_gather_grain_set(NULL);
    g->keys = kvpi_gather_job_keys(&job);
}

/* One dtype, one (W, S): windowed caches of every block size against compact full ones. */
static size_t check_gather_case(kvp_dtype dtype, size_t window, size_t sinks, gathered *want,
                                gathered *g)
{
    const size_t bts[] = {16, 1, 2, 3};
    size_t kvw = G_BATCH * G_KV * G_D;
    double rows[2 * G_LEN * G_BATCH * G_KV * G_D];
    double queries[G_BATCH * G_HEADS * G_D];
    double cand[2 * G_BATCH * G_KV * G_D];
    fill_random(rows, KVPT_COUNT_OF(rows), 0xA11 + window * 64 + sinks);
    fill_random(queries, KVPT_COUNT_OF(queries), 0xB22);
    fill_random(cand, KVPT_COUNT_OF(cand), 0xC33);
    size_t pos[G_LEN];
    size_t attended = 0;
    for (size_t p = 0; p < G_LEN; p++) {
        if (attends(window, sinks, G_LEN, p)) {
            pos[attended++] = p;
        }
    }
    kvp_error err;
    kvp_layer *layer = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(G_HEADS * G_D, G_HEADS, G_KV, 64, 10000.0, 3,
                                                   &layer, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_set_window(layer, window, sinks, &err), &err);
    kvp_binding windowed;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &windowed, &err), &err);
    kvpi_layer_record rec = kvpt_record(&windowed);
    rec.window = 0;
    rec.sink_tokens = 0;
    kvp_binding full = kvpt_rebind(&windowed, &rec);
    size_t runs = 0;
    for (size_t bi = 0; bi < KVPT_COUNT_OF(bts); bi++) {
        size_t bt = bts[bi];
        kvp_pool *pool = try_pool(bt, 2 * G_BATCH * KVPT_CEIL_DIV(G_LEN, bt), dtype);
        if (pool == NULL) {
            break;
        }
        kvp_cache *a = kvpt_cache(pool, &windowed, G_BATCH, G_LEN);
        for (size_t p = 0; p < G_LEN; p++) {
            kvp_tensor kt = kvp_tensor4(rows + 2 * p * kvw, G_BATCH, G_KV, 1, G_D);
            kvp_tensor vt = kvp_tensor4(rows + (2 * p + 1) * kvw, G_BATCH, G_KV, 1, G_D);
            kvpt_assert_ok(kvpi_cache_append(a, &kt, &vt, &err), &err);
        }
        kvp_cache *c = kvpt_cache(pool, &full, G_BATCH, G_LEN);
        copy_rows(c, a, pos, attended);
        double ck[G_BATCH * G_KV * G_D];
        double cv[G_BATCH * G_KV * G_D];
        memcpy(ck, cand, sizeof ck);
        memcpy(cv, cand + kvw, sizeof cv);
        kvpi_cache_round_rows(a, 0, ck, kvw);
        kvpi_cache_round_rows(a, 1, cv, kvw);
        for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
            if (kvpi_kernels_use((kvpi_isa)isa) != 0 ||
                (isa == KVPI_ISA_AVX512 && RUNNING_ON_VALGRIND)) {
                continue;
            }
            for (int accum = 0; accum < 2; accum++) {
                for (int part = 0; part < 2; part++) {
                    gather_run(a, queries, ck, cv, (kvp_accum)accum, part, g);
                    assert_int_equal(g->keys, attended + 1);
                    gather_run(c, queries, ck, cv, (kvp_accum)accum, part, want);
                    /* The compact full cache: the same weights and outputs, bit for bit. */
                    assert_int_equal(want->keys, g->keys);
                    assert_same_bits(g->w, want->w, G_BATCH * G_HEADS * g->keys);
                    assert_same_bits(g->o, want->o, KVPT_COUNT_OF(g->o));
                    runs++;
                }
            }
        }
        kvpt_destroy_cache(c, pool);
        kvpt_destroy_cache(a, pool);
        kvpt_destroy_pool(pool);
    }
    kvpt_destroy_layer(layer);
    return runs;
}

static void test_window_gather_is_full_gather_on_attended_rows(void **state)
{
    (void)state;
    const kvp_dtype dtypes[] = {KVP_F64, KVP_F32, KVP_BF16, KVP_F16, KVP_FP8_E4M3};
    /* (W, S): W = 1; inside a block; edges of 16; sinks past a block edge and over the window. */
    const size_t cases[][2] = {{1, 0}, {1, 3}, {5, 0}, {16, 2}, {17, 16}, {15, 17}, {7, 20},
                               {3, G_LEN}, {G_LEN + 1, 0}, {G_LEN, 0}};
    gathered *want = calloc(1, sizeof *want);
    gathered *g = calloc(1, sizeof *g);
    assert_true(want != NULL && g != NULL);
    for (size_t d = 0; d < KVPT_COUNT_OF(dtypes); d++) {
        size_t runs = 0;
        for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
            runs += check_gather_case(dtypes[d], cases[c][0], cases[c][1], want, g);
        }
        printf("# dtype %s: %zu windowed gathers equal the compact full ones\n",
               kvp_dtype_name(dtypes[d]), runs);
    }
    free(want);
    free(g);
}

/* Across block sizes: the windowed gather's bits do not depend on bt (each level, each ISA). */
static void test_window_gather_bits_do_not_depend_on_block_size(void **state)
{
    (void)state;
    const kvp_dtype dtypes[] = {KVP_F64, KVP_BF16, KVP_FP8_E4M3};
    const size_t bts[] = {16, 1, 2, 3};
    size_t kvw = G_BATCH * G_KV * G_D;
    double rows[2 * G_LEN * G_BATCH * G_KV * G_D];
    double queries[G_BATCH * G_HEADS * G_D];
    double cand[2 * G_BATCH * G_KV * G_D];
    fill_random(rows, KVPT_COUNT_OF(rows), 0xE55);
    fill_random(queries, KVPT_COUNT_OF(queries), 0xF66);
    fill_random(cand, KVPT_COUNT_OF(cand), 0x177);
    kvp_error err;
    kvp_layer *layer = NULL;
    kvpt_assert_ok(kvp_layer_create_random_grouped(G_HEADS * G_D, G_HEADS, G_KV, 64, 10000.0, 3,
                                                   &layer, &err),
                   &err);
    kvpt_assert_ok(kvp_layer_set_window(layer, 9, 3, &err), &err);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    gathered *first = calloc(2 * KVPI_ISA_COUNT, sizeof *first);
    gathered *g = calloc(1, sizeof *g);
    assert_true(first != NULL && g != NULL);
    for (size_t d = 0; d < KVPT_COUNT_OF(dtypes); d++) {
        for (size_t bi = 0; bi < KVPT_COUNT_OF(bts); bi++) {
            kvp_pool *pool =
                try_pool(bts[bi], G_BATCH * KVPT_CEIL_DIV(G_LEN, bts[bi]), dtypes[d]);
            if (pool == NULL) {
                break;
            }
            kvp_cache *a = kvpt_cache(pool, &binding, G_BATCH, G_LEN);
            for (size_t p = 0; p < G_LEN; p++) {
                kvp_tensor kt = kvp_tensor4(rows + 2 * p * kvw, G_BATCH, G_KV, 1, G_D);
                kvp_tensor vt = kvp_tensor4(rows + (2 * p + 1) * kvw, G_BATCH, G_KV, 1, G_D);
                kvpt_assert_ok(kvpi_cache_append(a, &kt, &vt, &err), &err);
            }
            double ck[G_BATCH * G_KV * G_D];
            double cv[G_BATCH * G_KV * G_D];
            memcpy(ck, cand, sizeof ck);
            memcpy(cv, cand + kvw, sizeof cv);
            kvpi_cache_round_rows(a, 0, ck, kvw);
            kvpi_cache_round_rows(a, 1, cv, kvw);
            for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
                if (kvpi_kernels_use((kvpi_isa)isa) != 0 ||
                    (isa == KVPI_ISA_AVX512 && RUNNING_ON_VALGRIND)) {
                    continue;
                }
                for (int accum = 0; accum < 2; accum++) {
                    gathered *want = first + (isa * 2 + accum);
                    gather_run(a, queries, ck, cv, (kvp_accum)accum, bi % 2, bi == 0 ? want : g);
                    if (bi > 0) {
                        assert_int_equal(g->keys, want->keys);
                        assert_same_bits(g->w, want->w, G_BATCH * G_HEADS * g->keys);
                        assert_same_bits(g->o, want->o, KVPT_COUNT_OF(g->o));
                    }
                }
            }
            kvpt_destroy_cache(a, pool);
            kvpt_destroy_pool(pool);
        }
    }
    kvpt_destroy_layer(layer);
    free(first);
    free(g);
}

/* ---- prefill ------------------------------------------------------------------------ */

/*
 * `pre` tokens decoded, then the next `count` through kvpi_prefill_layer on
 * `par`: the block's outputs equal the windowed (stored-dtype) reference.
 */
static void check_prefill(kvp_layer *layer, kvp_dtype dtype, size_t bt, size_t pre, size_t count,
                          const kvpi_parallel *par, const double *input, const double *ref,
                          size_t tokens)
{
    kvp_error err;
    kvp_layer_info info;
    kvp_layer_info_init(&info);
    kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
    size_t kv_width = info.kv_heads * info.head_width;
    kvp_pool *pool = kvpt_dtype_pool(bt, info.kv_heads, info.head_width,
                                     D_BATCH * KVPT_CEIL_DIV(tokens, bt), dtype);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, D_BATCH, tokens);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double row[D_BATCH * D_WIDTH];
    for (size_t t = 0; t < pre; t++) {
        for (size_t b = 0; b < D_BATCH; b++) {
            memcpy(row + b * D_WIDTH, input + (b * tokens + t) * D_WIDTH, sizeof row / D_BATCH);
        }
        kvp_tensor x = kvp_tensor3(row, D_BATCH, 1, D_WIDTH);
        kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    }
    size_t per = kvpi_prefill_work_doubles(D_BATCH, D_WIDTH, D_HEADS, kv_width, tokens, 1);
    double *storage = kvpt_doubles(per * count);
    kvpi_prefill_work work;
    kvpi_prefill_work_init(&work, storage, count, D_BATCH, D_WIDTH, D_HEADS, kv_width, tokens, 1);
    for (size_t t = 0; t < count; t++) {
        for (size_t b = 0; b < D_BATCH; b++) {
            memcpy(work.input + (t * D_BATCH + b) * D_WIDTH,
                   input + (b * tokens + pre + t) * D_WIDTH, sizeof(double) * D_WIDTH);
        }
    }
    kvp_error failure;
    memset(&failure, 0, sizeof failure);
    assert_int_equal(kvpi_prefill_layer(layer, cache, 0, &work, count, par, &failure), count);
    for (size_t t = 0; t < count; t++) {
        for (size_t b = 0; b < D_BATCH; b++) {
            assert_same_bits(work.output + (t * D_BATCH + b) * D_WIDTH,
                             ref + (b * tokens + pre + t) * D_WIDTH, D_WIDTH);
        }
    }
    free(storage);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
}

static void test_window_prefill_equals_reference(void **state)
{
    (void)state;
    const size_t T = 30;
    size_t n = D_BATCH * T * D_WIDTH;
    double *input = kvpt_doubles(n);
    double *ref = kvpt_doubles(n);
    fill_random(input, n, 0x9F);
    kvp_tensor x = kvp_tensor3(input, D_BATCH, T, D_WIDTH);
    const size_t cases[][2] = {{1, 0}, {4, 0}, {4, 2}, {16, 17}, {5, 20}, {3, 3}, {0, 0}};
    const kvp_dtype dtypes[] = {KVP_F64, KVP_BF16};
    const size_t bts[] = {1, 3, 16};
    const size_t pres[] = {0, 7, 17};
    kvp_error err;
    size_t runs = 0;
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        kvp_layer *layer = windowed_layer(1, cases[c][0], cases[c][1]);
        for (size_t d = 0; d < KVPT_COUNT_OF(dtypes); d++) {
            kvpt_assert_ok(kvp_attention_reference_stored(layer, dtypes[d], &x, ref, n, NULL, NULL,
                                                          0, &err),
                           &err);
            for (size_t bi = 0; bi < KVPT_COUNT_OF(bts); bi++) {
                for (size_t pi = 0; pi < KVPT_COUNT_OF(pres); pi++) {
                    for (int part = 0; part < 2; part++) {
                        kvpi_gather_grain_set(part ? &finest : NULL);
                        check_prefill(layer, dtypes[d], bts[bi], pres[pi], T - pres[pi],
                                      part ? &reverse : NULL, input, ref, T);
                        kvpi_gather_grain_set(NULL);
                        runs++;
                    }
                }
            }
        }
        kvpt_destroy_layer(layer);
    }
    printf("# %zu windowed prefills equal the reference bit for bit\n", runs);
    free(input);
    free(ref);
}

/* ---- the layer: settings, record, digest, refusals ------------------------------------ */

static void test_window_layer_settings_and_refusals(void **state)
{
    (void)state;
    kvp_layer *layer = windowed_layer(1, 0, 0);
    kvp_error err;
    kvp_binding before;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &before, &err), &err);
    /* A full layer's record: the window words are zero, so its bytes predate windows. */
    kvpi_layer_record rec = kvpt_record(&before);
    assert_int_equal(rec.window, 0);
    assert_int_equal(rec.sink_tokens, 0);
    for (size_t i = offsetof(kvpi_layer_record, window); i < KVP_BINDING_RECORD_BYTES; i++) {
        assert_int_equal(before.record[i], 0);
    }
    /* Refusals, in order, each naming its field and changing nothing. */
    assert_int_equal(kvp_layer_set_window(NULL, 1, 0, &err), KVP_NULL_ARGUMENT);
    assert_string_equal(err.argument, "layer");
    kvpt_assert_ok(kvp_layer_set_window(layer, 4, 2, &err), &err);
    kvp_binding set;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &set, &err), &err);
    const size_t bad[][2] = {{D_POSITIONS + 1, 0}, {D_POSITIONS + 1, D_POSITIONS + 1},
                             {4, D_POSITIONS + 1}, {0, 1}};
    const char *field[] = {"window", "window", "sink_tokens", "sink_tokens"};
    for (size_t i = 0; i < KVPT_COUNT_OF(bad); i++) {
        assert_int_equal(kvp_layer_set_window(layer, bad[i][0], bad[i][1], &err),
                         KVP_INVALID_ARGUMENT);
        assert_string_equal(err.argument, field[i]);
        kvp_layer_info info;
        kvp_layer_info_init(&info);
        kvpt_assert_ok(kvp_layer_info_get(layer, &info, &err), &err);
        assert_int_equal(info.window, 4);
        assert_int_equal(info.sink_tokens, 2);
        kvp_binding now;
        kvpt_assert_ok(kvp_layer_binding_get(layer, &now, &err), &err);
        assert_memory_equal(now.owner_digest, set.owner_digest, sizeof now.owner_digest);
        assert_memory_equal(now.record, set.record, sizeof now.record);
    }
    /* W and S at the RoPE positions are accepted. */
    kvpt_assert_ok(kvp_layer_set_window(layer, D_POSITIONS, D_POSITIONS, &err), &err);
    /* Digests: differ by W and by S, equal for equal settings. */
    kvp_binding b[4];
    const size_t settings[4][2] = {{4, 0}, {5, 0}, {4, 1}, {4, 0}};
    for (size_t i = 0; i < 4; i++) {
        kvpt_assert_ok(kvp_layer_set_window(layer, settings[i][0], settings[i][1], &err), &err);
        kvpt_assert_ok(kvp_layer_binding_get(layer, &b[i], &err), &err);
        assert_memory_not_equal(b[i].owner_digest, before.owner_digest, sizeof before.owner_digest);
    }
    assert_memory_not_equal(b[0].owner_digest, b[1].owner_digest, sizeof b[0].owner_digest);
    assert_memory_not_equal(b[0].owner_digest, b[2].owner_digest, sizeof b[0].owner_digest);
    assert_memory_not_equal(b[1].owner_digest, b[2].owner_digest, sizeof b[0].owner_digest);
    assert_memory_equal(b[0].owner_digest, b[3].owner_digest, sizeof b[0].owner_digest);
    assert_int_equal(kvpt_record(&b[2]).sink_tokens, 1);
    /* Back to full attention: the digest from before. */
    kvpt_assert_ok(kvp_layer_set_window(layer, 0, 0, &err), &err);
    kvp_binding again;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &again, &err), &err);
    assert_memory_equal(again.owner_digest, before.owner_digest, sizeof before.owner_digest);
    /* An info of the size before windows: W and S are not written. */
    kvpt_assert_ok(kvp_layer_set_window(layer, 7, 3, &err), &err);
    unsigned char raw[sizeof(kvp_layer_info) + 8];
    memset(raw, 0xAB, sizeof raw);
    kvp_layer_info old;
    memset(&old, 0, sizeof old);
    old.struct_size = offsetof(kvp_layer_info, window);
    memcpy(raw, &old, sizeof old.struct_size);
    kvpt_assert_ok(kvp_layer_info_get(layer, (kvp_layer_info *)(void *)raw, &err), &err);
    for (size_t i = offsetof(kvp_layer_info, window); i < sizeof raw; i++) {
        assert_int_equal(raw[i], 0xAB);
    }
    kvp_layer_info now;
    kvp_layer_info_init(&now);
    kvpt_assert_ok(kvp_layer_info_get(layer, &now, &err), &err);
    assert_int_equal(now.window, 7);
    assert_int_equal(now.sink_tokens, 3);
    kvpt_destroy_layer(layer);
}

/* A cache made under one window is refused under another, changing nothing. */
static void test_window_prepare_refuses_other_window(void **state)
{
    (void)state;
    kvp_layer *layer = windowed_layer(2, 4, 0);
    kvp_error err;
    kvp_pool *pool = kvpt_pool(2, 2, D_WIDTH / D_HEADS, 16);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, D_BATCH, 8);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double row[D_BATCH * D_WIDTH];
    fill_random(row, KVPT_COUNT_OF(row), 0x71);
    kvp_tensor x = kvp_tensor3(row, D_BATCH, 1, D_WIDTH);
    for (size_t t = 0; t < 3; t++) {
        kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    }
    const size_t settings[][2] = {{5, 0}, {0, 0}, {4, 1}};
    const char *what[] = {"window", "window", "sink_tokens"};
    const size_t layer_size[] = {5, 0, 1};
    const size_t cache_size[] = {4, 4, 0};
    for (size_t i = 0; i < KVPT_COUNT_OF(settings); i++) {
        kvpt_assert_ok(kvp_layer_set_window(layer, settings[i][0], settings[i][1], &err), &err);
        kvpt_state before;
        kvpt_state_capture(cache, pool, &before);
        assert_int_equal(kvp_attention_forward(layer, &x, cache, ticket, &err),
                         KVP_CACHE_WINDOW_MISMATCH);
        assert_string_equal(err.what, what[i]);
        assert_int_equal(err.layer_size, layer_size[i]);
        assert_int_equal(err.cache_size, cache_size[i]);
        kvp_attention_result r;
        assert_int_equal(kvp_ticket_result(ticket, &r, &err), KVP_TICKET_EMPTY);
        kvpt_assert_state_unchanged(&before, cache, pool, 0);
        kvpt_state_free(&before);
    }
    /* The layer's own window again: the cache works. */
    kvpt_assert_ok(kvp_layer_set_window(layer, 4, 0, &err), &err);
    kvpt_assert_ok(kvp_attention_forward(layer, &x, cache, ticket, &err), &err);
    kvpt_assert_pool_ok(pool);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_pool(pool);
    kvpt_destroy_layer(layer);
}

int main(void)
{
    initial_level = kvpi_kernels_active()->isa;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_window_rule_is_the_definition),
        cmocka_unit_test(test_window_decode_equals_reference_at_every_block_edge),
        cmocka_unit_test(test_window_decode_narrow_pages_equal_stored_reference),
        cmocka_unit_test_teardown(test_window_gather_is_full_gather_on_attended_rows, restore),
        cmocka_unit_test_teardown(test_window_gather_bits_do_not_depend_on_block_size, restore),
        cmocka_unit_test_teardown(test_window_prefill_equals_reference, restore),
        cmocka_unit_test(test_window_layer_settings_and_refusals),
        cmocka_unit_test(test_window_prepare_refuses_other_window),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
