/*
 * test_kernels.c: the dispatched dot/axpy kernels (src/attention/kernels.h,
 * dispatch.c) at every ISA level this machine runs.
 *
 * Proves: the portable level sums in the documented order (checked against
 * the formula written out here); every other level gives the portable
 * level's bits for lengths 0..257 at unaligned addresses; the multi-row
 * kernels equal one call per row; projecting many rows at once equals one
 * projection per row; the f32 and bf16 row kernels equal the f64
 * kernel on the widened rows, bit for bit, at every level; the gather gives the same bits for
 * block_tokens 1, 3, 16 and 64 and the same bits at every level; incremental
 * attention equals the full-prefix reference bit for bit at every level; the
 * dispatch refuses levels it cannot run, changing nothing; KVP_ISA picks a
 * level in a fresh process, and a bad value falls back with a message; and
 * threads share the table while forcing each level in turn between phases.
 *
 * Levels are forced with kvpi_kernels_use. Valgrind runs AVX2 but not
 * AVX-512: under it the AVX-512 level is skipped, and the output says so.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <valgrind/valgrind.h>

#include "support.h"

#include "attention/gather.h"
#include "attention/kernels.h"
#include "attention/layer_internal.h"
#include "pager/cache_internal.h"

/* ---- levels ------------------------------------------------------------------ */

/* The levels to test: every one the CPU runs, minus AVX-512 under Valgrind. */
static size_t test_levels(const kvpi_kernels *out[KVPI_ISA_COUNT])
{
    static int said;
    size_t n = 0;
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        const kvpi_kernels *k = kvpi_kernels_level((kvpi_isa)isa);
        if (isa == KVPI_ISA_AVX512 && RUNNING_ON_VALGRIND) {
            if (!said) {
                printf("# level avx512: skipped under Valgrind, which has no AVX-512\n");
            }
            continue;
        }
        if (k == NULL) {
            if (!said) {
                printf("# level %s: not run by this CPU or build, skipped\n",
                       kvpi_isa_name((kvpi_isa)isa));
            }
            continue;
        }
        out[n++] = k;
    }
    said = 1;
    return n;
}

/* Restores the level the process started with (the tests change it). */
static kvpi_isa initial_level;

static int restore_level(void **state)
{
    (void)state;
    return kvpi_kernels_use(initial_level) == 0 ? 0 : -1;
}

static uint64_t rng = 88172645463325252ull;

static double unit(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* Random doubles of mixed magnitudes, so that the summation order shows in the bits. */
static void fill(double *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = unit() * (i % 3 == 0 ? 1e3 : i % 3 == 1 ? 1.0 : 1e-3);
    }
}

/* The documented order, written out independently of the library. */
static double documented_dot(const double *a, const double *b, size_t n)
{
    double s[8] = {0};
    size_t n8 = n / 8 * 8;
    for (size_t f = 0; f < n8; f++) {
        s[f % 8] = s[f % 8] + a[f] * b[f];
    }
    double sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for (size_t f = n8; f < n; f++) {
        sum = sum + a[f] * b[f];
    }
    return sum;
}

static void test_kernels_levels_and_refusals(void **state)
{
    (void)state;
    const kvpi_kernels *scalar = kvpi_kernels_level(KVPI_ISA_SCALAR);
    assert_non_null(scalar);
    assert_ptr_equal(scalar, &kvpi_kernels_scalar);
    kvpi_isa best = kvpi_kernels_best();
    assert_non_null(kvpi_kernels_level(best));
    for (int isa = best + 1; isa < KVPI_ISA_COUNT; isa++) {
        assert_null(kvpi_kernels_level((kvpi_isa)isa));
    }
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        kvpi_isa parsed = KVPI_ISA_COUNT;
        const kvpi_kernels *k = kvpi_kernels_level((kvpi_isa)isa);
        assert_int_equal(kvpi_isa_parse(kvpi_isa_name((kvpi_isa)isa), &parsed), 0);
        assert_int_equal(parsed, isa);
        if (k != NULL) {
            assert_int_equal(k->isa, isa);
            assert_string_equal(k->name, kvpi_isa_name((kvpi_isa)isa));
        }
    }
    kvpi_isa untouched = KVPI_ISA_AVX2;
    assert_int_equal(kvpi_isa_parse("AVX2", &untouched), -1);
    assert_int_equal(kvpi_isa_parse("", &untouched), -1);
    assert_int_equal(kvpi_isa_parse(NULL, &untouched), -1);
    assert_int_equal(untouched, KVPI_ISA_AVX2);

    /* Refusals change nothing: not a level, or (where there is one) a level the CPU lacks. */
    assert_int_equal(kvpi_kernels_use(KVPI_ISA_SCALAR), 0);
    assert_ptr_equal(kvpi_kernels_active(), scalar);
    assert_int_equal(kvpi_kernels_use(KVPI_ISA_COUNT), -1);
    assert_ptr_equal(kvpi_kernels_active(), scalar);
    if (best + 1 < KVPI_ISA_COUNT) {
        assert_int_equal(kvpi_kernels_use((kvpi_isa)(best + 1)), -1);
        assert_ptr_equal(kvpi_kernels_active(), scalar);
    }
    assert_int_equal(kvpi_kernels_use(best), 0);
    assert_ptr_equal(kvpi_kernels_active(), kvpi_kernels_level(best));
    assert_int_equal(kvpi_kernels_active()->isa, best);
    printf("# best level: %s\n", kvpi_isa_name(best));
}

/* ---- dot and axpy ------------------------------------------------------------- */

#define MAX_N 257
#define MAX_ROWS 9
#define PAD 11 /* stride = n + pad, pad < PAD */

static void test_kernels_dot_and_axpy_match_scalar(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    const kvpi_kernels *scalar = &kvpi_kernels_scalar;
    /* Unaligned by o doubles from the (16-byte aligned) malloc start, o = 0..3. */
    double *a = kvpt_doubles(MAX_N + 8);
    double *rows = kvpt_doubles(MAX_ROWS * (MAX_N + PAD) + 8);
    double *weights = kvpt_doubles(MAX_ROWS);
    double *expect = kvpt_doubles(MAX_N + 8);
    double *acc = kvpt_doubles(MAX_N + 8);
    double *start = kvpt_doubles(MAX_N + 8);
    double dots[MAX_ROWS];
    double expect_dots[MAX_ROWS];
    size_t checked = 0;
    for (size_t n = 0; n <= MAX_N; n++) {
        size_t o = n % 4;
        size_t stride = n + n % PAD;
        size_t count = n % (MAX_ROWS + 1);
        const double *x = a + o;
        const double *y = rows + (3 - o);
        fill(a, MAX_N + 8);
        fill(rows, MAX_ROWS * (MAX_N + PAD) + 8);
        fill(weights, MAX_ROWS);
        fill(start, MAX_N + 8);
        double scale = 0.125 + unit() * 0.01;

        /* The portable level is the documented order; below 8, the plain sum. */
        double reference = scalar->dot(x, y, n);
        assert_true(kvpt_same_bits(reference, documented_dot(x, y, n)));
        if (n < 8) {
            double plain = 0.0;
            for (size_t f = 0; f < n; f++) {
                plain += x[f] * y[f];
            }
            assert_true(kvpt_same_bits(reference, plain));
        }
        for (size_t r = 0; r < count; r++) {
            expect_dots[r] = scalar->dot(x, y + r * stride, n) * scale;
        }
        memcpy(expect, start, (MAX_N + 8) * sizeof(double));
        for (size_t r = 0; r < count; r++) {
            for (size_t f = 0; f < n; f++) {
                expect[o + f] = expect[o + f] + weights[r] * y[r * stride + f];
            }
        }

        for (size_t l = 0; l < nlevels; l++) {
            const kvpi_kernels *k = levels[l];
            if (!kvpt_same_bits(k->dot(x, y, n), reference)) {
                print_error("%s dot differs at n=%zu offset=%zu\n", k->name, n, o);
                fail();
            }
            kvpt_fill(dots, MAX_ROWS, 7.0);
            k->dot_rows(x, y, stride, count, n, scale, dots);
            assert_memory_equal(dots, expect_dots, count * sizeof(double));
            kvpt_assert_filled(dots + count, MAX_ROWS - count, 7.0);

            /* axpy one row at a time and all rows at once: the same bits, nothing else written. */
            memcpy(acc, start, (MAX_N + 8) * sizeof(double));
            for (size_t r = 0; r < count; r++) {
                k->axpy(acc + o, weights[r], y + r * stride, n);
            }
            assert_memory_equal(acc, expect, (MAX_N + 8) * sizeof(double));
            memcpy(acc, start, (MAX_N + 8) * sizeof(double));
            k->axpy_rows(acc + o, weights, y, stride, count, n);
            assert_memory_equal(acc, expect, (MAX_N + 8) * sizeof(double));
            checked++;
        }
    }
    assert_int_equal(checked, (MAX_N + 1) * nlevels);
    free(a);
    free(rows);
    free(weights);
    free(expect);
    free(acc);
    free(start);
}

/* ---- projections of many rows at once ---------------------------------------------- */

/*
 * kvpi_project_rows equals kvpi_project_rect row by row, and the documented
 * sum (+0.0, then + x[i] * w[i][j] for i in order) written out here, bit for
 * bit, at every level: row counts below, at and past the tile and packing
 * thresholds, widths past the packed slivers' 64 rows, column counts around
 * every level's tile width, strided x and y whose gaps stay untouched, and
 * inputs of mixed magnitudes and signed zeros (so order and the sign of a
 * zero sum both show in the bits).
 */
static void test_kernels_project_rows_equal_project_row(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    static const size_t row_counts[] = {1, 4, 5, 16, 17, 70};
    static const size_t widths[] = {0, 1, 8, 63, 65, 129};
    static const size_t col_counts[] = {1, 3, 7, 13, 32, 33, 70};
    enum { P_ROWS = 70, P_WIDTH = 129, P_COLS = 70, GAP = 3 };
    size_t x_stride = P_WIDTH + GAP;
    size_t y_stride = P_COLS + GAP;
    double *x = malloc(P_ROWS * x_stride * sizeof *x);
    double *w = malloc(P_WIDTH * P_COLS * sizeof *w);
    double *expect = malloc(P_ROWS * y_stride * sizeof *expect);
    double *row = malloc(P_COLS * sizeof *row);
    double *y = malloc(P_ROWS * y_stride * sizeof *y);
    assert_non_null(x);
    assert_non_null(w);
    assert_non_null(expect);
    assert_non_null(row);
    assert_non_null(y);
    fill(x, P_ROWS * x_stride);
    fill(w, P_WIDTH * P_COLS);
    /* Row 2's inputs are signed zeros: its sums must be +0.0 whatever W's signs. */
    for (size_t i = 0; i < P_WIDTH; i++) {
        x[2 * x_stride + i] = i % 2 ? -0.0 : 0.0;
    }
    size_t checked = 0;
    for (size_t a = 0; a < sizeof row_counts / sizeof *row_counts; a++) {
        for (size_t b = 0; b < sizeof widths / sizeof *widths; b++) {
            for (size_t c = 0; c < sizeof col_counts / sizeof *col_counts; c++) {
                size_t rows = row_counts[a];
                size_t width = widths[b];
                size_t cols = col_counts[c];
                kvpt_fill(expect, P_ROWS * y_stride, 7.0);
                for (size_t r = 0; r < rows; r++) {
                    for (size_t j = 0; j < cols; j++) {
                        double sum = 0.0;
                        for (size_t i = 0; i < width; i++) {
                            sum = sum + x[r * x_stride + i] * w[i * cols + j];
                        }
                        expect[r * y_stride + j] = sum;
                    }
                }
                for (size_t j = 0; j < cols && rows > 2; j++) {
                    assert_true(kvpt_same_bits(expect[2 * y_stride + j], 0.0));
                }
                for (size_t l = 0; l < nlevels; l++) {
                    assert_int_equal(kvpi_kernels_use(levels[l]->isa), 0);
                    kvpt_fill(y, P_ROWS * y_stride, 7.0);
                    kvpi_project_rows(x, x_stride, rows, w, width, cols, y, y_stride);
                    if (memcmp(y, expect, P_ROWS * y_stride * sizeof *y) != 0) {
                        print_error("%s project_rows differs at rows=%zu width=%zu cols=%zu\n",
                                    levels[l]->name, rows, width, cols);
                        fail();
                    }
                    for (size_t r = 0; r < rows; r++) {
                        kvpi_project_rect(x + r * x_stride, w, width, cols, row);
                        assert_memory_equal(row, y + r * y_stride, cols * sizeof *row);
                    }
                    checked++;
                }
            }
        }
    }
    assert_int_equal(checked, 6 * 6 * 7 * nlevels);
    /* A square W through kvpi_project_row, the call the projections used to make. */
    kvpi_project_rows(x, x_stride, 17, w, 65, 65, y, y_stride);
    for (size_t r = 0; r < 17; r++) {
        kvpi_project_row(x + r * x_stride, w, 65, row);
        assert_memory_equal(row, y + r * y_stride, 65 * sizeof *row);
    }
    free(x);
    free(w);
    free(expect);
    free(row);
    free(y);
}

/* ---- rows stored as f32 and bf16 ------------------------------------------------ */

/* bf16 bits of x by truncation: any bf16 will do here; the rounding is tested in test_dtype.c. */
static uint16_t bf16_bits(double x)
{
    float f = (float)x;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

/*
 * Every level's dot_rows_f32/bf16 and axpy_rows_f32/bf16 against the f64
 * kernels (the scalar one and the level's own) on the widened rows: the same
 * bits, for n = 0..MAX_N, strides n .. n + PAD - 1, 0..MAX_ROWS rows, rows
 * starting at odd element offsets, and nothing written past count or n.
 */
static void test_kernels_narrow_rows_match_f64_on_widened(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    const kvpi_kernels *scalar = &kvpi_kernels_scalar;
    size_t cap = MAX_ROWS * (MAX_N + PAD) + 8;
    double *a = kvpt_doubles(MAX_N + 8);
    double *source = kvpt_doubles(cap);
    float *rows32 = malloc(cap * sizeof *rows32);
    uint16_t *rows16 = malloc(cap * sizeof *rows16);
    double *wide32 = kvpt_doubles(cap);
    double *wide16 = kvpt_doubles(cap);
    double *weights = kvpt_doubles(MAX_ROWS);
    double *start = kvpt_doubles(MAX_N + 8);
    double *expect = kvpt_doubles(MAX_N + 8);
    double *acc = kvpt_doubles(MAX_N + 8);
    assert_non_null(rows32);
    assert_non_null(rows16);
    double dots[MAX_ROWS + 1];
    double expect_dots[MAX_ROWS];
    size_t checked = 0;
    for (size_t n = 0; n <= MAX_N; n++) {
        size_t o = n % 4;
        size_t stride = n + n % PAD;
        size_t count = n % (MAX_ROWS + 1);
        fill(a, MAX_N + 8);
        fill(source, cap);
        fill(weights, MAX_ROWS);
        fill(start, MAX_N + 8);
        for (size_t i = 0; i < cap; i++) {
            rows32[i] = (float)source[i];
            rows16[i] = bf16_bits(source[i]);
            wide32[i] = (double)rows32[i];
            wide16[i] = kvpi_bf16_widen(rows16[i]);
        }
        double scale = 0.125 + unit() * 0.01;
        const double *x = a + o;
        size_t at = 3 - o; /* odd and even element offsets of the rows */
        const double *const wide[2] = {wide32 + at, wide16 + at};
        for (size_t kind = 0; kind < 2; kind++) {
            scalar->dot_rows(x, wide[kind], stride, count, n, scale, expect_dots);
            memcpy(expect, start, (MAX_N + 8) * sizeof(double));
            scalar->axpy_rows(expect + o, weights, wide[kind], stride, count, n);
            for (size_t l = 0; l < nlevels; l++) {
                const kvpi_kernels *k = levels[l];
                /* The level's own f64 kernels agree with the scalar ones (tested above). */
                kvpt_fill(dots, MAX_ROWS + 1, 7.0);
                k->dot_rows(x, wide[kind], stride, count, n, scale, dots);
                assert_memory_equal(dots, expect_dots, count * sizeof(double));
                kvpt_fill(dots, MAX_ROWS + 1, 7.0);
                if (kind == 0) {
                    k->dot_rows_f32(x, rows32 + at, stride, count, n, scale, dots);
                } else {
                    k->dot_rows_bf16(x, rows16 + at, stride, count, n, scale, dots);
                }
                if (count > 0 && memcmp(dots, expect_dots, count * sizeof(double)) != 0) {
                    print_error("%s dot_rows_%s differs at n=%zu count=%zu stride=%zu\n",
                                k->name, kind == 0 ? "f32" : "bf16", n, count, stride);
                    fail();
                }
                kvpt_assert_filled(dots + count, MAX_ROWS + 1 - count, 7.0);
                memcpy(acc, start, (MAX_N + 8) * sizeof(double));
                if (kind == 0) {
                    k->axpy_rows_f32(acc + o, weights, rows32 + at, stride, count, n);
                } else {
                    k->axpy_rows_bf16(acc + o, weights, rows16 + at, stride, count, n);
                }
                if (memcmp(acc, expect, (MAX_N + 8) * sizeof(double)) != 0) {
                    print_error("%s axpy_rows_%s differs at n=%zu count=%zu stride=%zu\n",
                                k->name, kind == 0 ? "f32" : "bf16", n, count, stride);
                    fail();
                }
                checked++;
            }
        }
    }
    assert_int_equal(checked, 2 * (MAX_N + 1) * nlevels);
    free(a);
    free(source);
    free(rows32);
    free(rows16);
    free(wide32);
    free(wide16);
    free(weights);
    free(start);
    free(expect);
    free(acc);
}

/* ---- the gather ---------------------------------------------------------------- */

enum { GATHER_HEADS = 3, GATHER_LEN = 150, GATHER_LANES = 2 };

static const size_t gather_blocks[] = {1, 3, 16, 64};

/* One pool and cache per block size, holding the same rows (seeded). */
typedef struct gather_fixture {
    size_t d;
    kvp_pool *pools[4];
    kvp_cache *caches[4];
    double *query;      /* [H][d] */
    double *candidate;  /* [H][d] */
    double *keys;       /* the logical keys, [B][H][len][d] */
} gather_fixture;

static void gather_open(gather_fixture *g, size_t d)
{
    g->d = d;
    size_t hd = GATHER_HEADS * d;
    double *key = kvpt_doubles(GATHER_LANES * hd);
    double *value = kvpt_doubles(GATHER_LANES * hd);
    g->query = kvpt_doubles(hd);
    g->candidate = kvpt_doubles(hd);
    fill(g->query, hd);
    fill(g->candidate, hd);
    kvp_binding binding = kvpt_binding(GATHER_HEADS, d, GATHER_LEN);
    for (size_t i = 0; i < KVPT_COUNT_OF(gather_blocks); i++) {
        size_t bt = gather_blocks[i];
        g->pools[i] = kvpt_pool(bt, GATHER_HEADS, d, GATHER_LANES * KVPT_CEIL_DIV(GATHER_LEN, bt));
        g->caches[i] = kvpt_cache(g->pools[i], &binding, GATHER_LANES, GATHER_LEN);
    }
    uint64_t saved = rng;
    for (size_t i = 0; i < KVPT_COUNT_OF(gather_blocks); i++) {
        rng = saved;
        for (size_t p = 0; p < GATHER_LEN; p++) {
            fill(key, GATHER_LANES * hd);
            fill(value, GATHER_LANES * hd);
            kvp_tensor k = kvp_tensor4(key, GATHER_LANES, GATHER_HEADS, 1, d);
            kvp_tensor v = kvp_tensor4(value, GATHER_LANES, GATHER_HEADS, 1, d);
            kvp_error err;
            kvpt_assert_ok(kvpi_cache_append(g->caches[i], &k, &v, &err), &err);
        }
    }
    free(key);
    free(value);
    size_t kv = GATHER_LANES * GATHER_HEADS * GATHER_LEN * d;
    g->keys = kvpt_doubles(kv);
    kvp_error err;
    kvpt_assert_ok(kvp_cache_keys(g->caches[0], g->keys, kv, &err), &err);
}

static void gather_close(gather_fixture *g)
{
    for (size_t i = 0; i < KVPT_COUNT_OF(gather_blocks); i++) {
        kvpt_destroy_cache(g->caches[i], g->pools[i]);
        kvpt_destroy_pool(g->pools[i]);
    }
    free(g->query);
    free(g->candidate);
    free(g->keys);
}

/* Lane `lane`'s scores and outputs through cache i, at the active level. */
static void gather_run(const gather_fixture *g, size_t i, size_t lane, double *scores,
                       double *outputs)
{
    double scale = 1.0 / 8.0;
    kvpi_gather_scores(g->caches[i], g->query, g->candidate, lane, scale, scores);
    /* Mixed-sign weights of mixed size, so an order change would show. */
    for (size_t j = 0; j < GATHER_HEADS * (GATHER_LEN + 1); j++) {
        scores[j] = scores[j] * 0.5 + 0.25;
    }
    kvpi_gather_values(g->caches[i], scores, g->candidate, lane, outputs);
}

static void test_kernels_gather_same_bits_across_blocks_and_levels(void **state)
{
    (void)state;
    static const size_t widths[] = {64, 13, 8, 3};
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    size_t nscores = GATHER_HEADS * (GATHER_LEN + 1);
    for (size_t w = 0; w < KVPT_COUNT_OF(widths); w++) {
        gather_fixture g;
        gather_open(&g, widths[w]);
        size_t nout = GATHER_HEADS * g.d;
        double *first_scores = kvpt_doubles(nscores);
        double *first_out = kvpt_doubles(nout);
        double *scores = kvpt_doubles(nscores);
        double *out = kvpt_doubles(nout);
        for (size_t lane = 0; lane < GATHER_LANES; lane++) {
            assert_int_equal(kvpi_kernels_use(KVPI_ISA_SCALAR), 0);
            gather_run(&g, 0, lane, first_scores, first_out);
            /* The scalar scores are the documented dots over the lane's logical keys. */
            for (size_t h = 0; h < GATHER_HEADS; h++) {
                for (size_t p = 0; p < GATHER_LEN; p++) {
                    const double *key = g.keys + ((lane * GATHER_HEADS + h) * GATHER_LEN + p) * g.d;
                    double dot = documented_dot(g.query + h * g.d, key, g.d) * (1.0 / 8.0);
                    assert_true(kvpt_same_bits(first_scores[h * (GATHER_LEN + 1) + p],
                                          dot * 0.5 + 0.25));
                }
            }
            for (size_t l = 0; l < nlevels; l++) {
                assert_int_equal(kvpi_kernels_use(levels[l]->isa), 0);
                for (size_t i = 0; i < KVPT_COUNT_OF(gather_blocks); i++) {
                    kvpt_fill(scores, nscores, 9.0);
                    kvpt_fill(out, nout, 9.0);
                    gather_run(&g, i, lane, scores, out);
                    if (memcmp(scores, first_scores, nscores * sizeof(double)) != 0 ||
                        memcmp(out, first_out, nout * sizeof(double)) != 0) {
                        print_error("gather differs: level %s, block_tokens %zu, d_h %zu\n",
                                    levels[l]->name, gather_blocks[i], g.d);
                        fail();
                    }
                }
            }
        }
        free(first_scores);
        free(first_out);
        free(scores);
        free(out);
        gather_close(&g);
    }
}

/* ---- attention at every level -------------------------------------------------- */

typedef struct geometry {
    size_t batch, heads, head_width, block_tokens, capacity;
} geometry;

/*
 * Forward every position of a random [B, C, D] input through a fresh cache,
 * at the active level, with a layer of max_positions >= C; out gets the outputs as [C][B * D]. The reference's
 * outputs, [B, C, D], go to ref. Returns nothing; asserts every step.
 */
static void run_both_ways(const geometry *g, size_t max_positions, uint64_t seed, double *out,
                          double *ref)
{
    size_t d = g->heads * g->head_width;
    size_t rows = g->batch * g->capacity * d;
    kvp_error err;
    kvp_pool *pool = kvpt_pool(g->block_tokens, g->heads, g->head_width,
                               g->batch * KVPT_CEIL_DIV(g->capacity, g->block_tokens));
    kvp_layer *layer = kvpt_random_layer(d, g->heads, max_positions, 10000.0, seed);
    kvp_binding binding;
    kvpt_assert_ok(kvp_layer_binding_get(layer, &binding, &err), &err);
    kvp_cache *cache = kvpt_cache(pool, &binding, g->batch, g->capacity);
    kvp_ticket *ticket = kvpt_ticket(cache);
    double *sequence = kvpt_doubles(rows);
    double *step = kvpt_doubles(g->batch * d);
    kvpt_fill_random(sequence, rows, seed * 31 + 7);
    kvp_tensor whole = kvp_tensor3(sequence, g->batch, g->capacity, d);
    kvpt_assert_ok(kvp_attention_reference(layer, &whole, ref, rows, NULL, NULL, 0, &err), &err);
    for (size_t t = 0; t < g->capacity; t++) {
        for (size_t b = 0; b < g->batch; b++) {
            memcpy(step + b * d, sequence + (b * g->capacity + t) * d, d * sizeof(double));
        }
        kvp_tensor input = kvp_tensor3(step, g->batch, 1, d);
        kvpt_assert_ok(kvp_attention_forward(layer, &input, cache, ticket, &err), &err);
        kvp_attention_result result;
        kvpt_assert_ok(kvp_ticket_result(ticket, &result, &err), &err);
        memcpy(out + t * g->batch * d, result.output, g->batch * d * sizeof(double));
    }
    free(sequence);
    free(step);
    kvpt_destroy_ticket(ticket, pool);
    kvpt_destroy_cache(cache, pool);
    kvpt_destroy_layer(layer);
    kvpt_destroy_pool(pool);
}

static void test_kernels_attention_exact_at_every_level(void **state)
{
    (void)state;
    static const geometry cases[] = {
        {1, 2, 64, 16, 40}, {2, 3, 14, 3, 29}, {3, 1, 8, 1, 17}, {1, 4, 36, 64, 70},
    };
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        const geometry *g = &cases[c];
        size_t d = g->heads * g->head_width;
        size_t rows = g->batch * g->capacity * d;
        double *first = kvpt_doubles(rows);
        double *out = kvpt_doubles(rows);
        double *ref = kvpt_doubles(rows);
        for (size_t l = 0; l < nlevels; l++) {
            assert_int_equal(kvpi_kernels_use(levels[l]->isa), 0);
            run_both_ways(g, g->capacity, 500 + c, out, ref);
            /* Incremental == reference, bit for bit, at this level. */
            for (size_t t = 0; t < g->capacity; t++) {
                for (size_t b = 0; b < g->batch; b++) {
                    if (memcmp(out + (t * g->batch + b) * d, ref + (b * g->capacity + t) * d,
                               d * sizeof(double)) != 0) {
                        print_error("level %s case %zu: step %zu lane %zu differs from the "
                                    "reference\n", levels[l]->name, c, t, b);
                        fail();
                    }
                }
            }
            /* Every level gives the first level's (the portable one's) bits. */
            if (l == 0) {
                assert_int_equal(levels[0]->isa, KVPI_ISA_SCALAR);
                memcpy(first, out, rows * sizeof(double));
            } else {
                assert_memory_equal(out, first, rows * sizeof(double));
            }
        }
        free(first);
        free(out);
        free(ref);
    }
}

/* ---- exp and softmax ------------------------------------------------------------- */

/* Doubles in the order of their values (negative ones below -0), so ulp distance is a difference. */
static int64_t ordered(double x)
{
    int64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits < 0 ? INT64_MIN - bits : bits;
}

#define EXP_GRID (1u << 18) /* points of [-750, 0]: a step of about 0.0029 */

/* The grid of [-750, 0], then special values: zeros, tiny and huge magnitudes, -inf, the ends. */
static size_t exp_inputs(double *x)
{
    size_t n = 0;
    for (size_t i = 0; i <= EXP_GRID; i++) {
        x[n++] = -750.0 * (double)i / (double)EXP_GRID;
    }
    for (int e = 0; e <= 1074; e++) {
        x[n++] = -ldexp(1.0, -e); /* -1, -2^-1 .. -2^-1074 (the smallest subnormal) */
        x[n++] = -ldexp(1.5, -e) * 1.0000001;
    }
    static const double special[] = {0.0, -0.0, -DBL_MIN, -DBL_EPSILON, -0x1p-54,
                                     -708.3964185322641, -708.4, -709.0, -744.4400719213812,
                                     -745.0, -745.1332191019411, -745.1332191019412, -745.2,
                                     -746.0, -1e4, -1e308, -DBL_MAX, -INFINITY};
    for (size_t i = 0; i < KVPT_COUNT_OF(special); i++) {
        x[n++] = special[i];
    }
    x[n++] = KVPI_EXP_MIN;
    x[n++] = nextafter(KVPI_EXP_MIN, 0.0);
    x[n++] = nextafter(KVPI_EXP_MIN, -INFINITY);
    return n;
}

#define EXP_INPUTS (EXP_GRID + 1 + 2 * 1075 + 32)

static void test_kernels_exp_matches_scalar_and_libm(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    double *x = kvpt_doubles(EXP_INPUTS);
    double *expect = kvpt_doubles(EXP_INPUTS);
    double *got = kvpt_doubles(EXP_INPUTS + 8);
    size_t n = exp_inputs(x);
    assert_true(n <= EXP_INPUTS);
    kvpi_kernels_scalar.exps(x, expect, n);

    /* The documented bound against libm, and the exact values the softmax relies on. */
    int64_t worst = 0;
    for (size_t i = 0; i < n; i++) {
        assert_true(kvpt_same_bits(expect[i], kvpi_exp(x[i])));
        int64_t ulps = llabs(ordered(expect[i]) - ordered(exp(x[i])));
        if (ulps > KVPI_EXP_MAX_ULP) {
            print_error("exp(%a) = %a, libm %a: %lld ulp\n", x[i], expect[i], exp(x[i]),
                        (long long)ulps);
            fail();
        }
        worst = ulps > worst ? ulps : worst;
        if (x[i] < KVPI_EXP_MIN) {
            assert_true(kvpt_same_bits(expect[i], 0.0)); /* +0, never -0 or garbage */
        }
    }
    assert_true(kvpt_same_bits(kvpi_exp(0.0), 1.0));
    assert_true(kvpt_same_bits(kvpi_exp(-0.0), 1.0));
    assert_true(kvpt_same_bits(kvpi_exp(-INFINITY), 0.0));
    assert_true(kvpt_same_bits(kvpi_exp(-0x1p-1074), 1.0));
    assert_true(kvpt_same_bits(kvpi_exp(-745.0), 0x1p-1074)); /* libm's too: a subnormal */
    assert_true(kvpt_same_bits(kvpi_exp(-1.0), exp(-1.0)));
    printf("# exp: %zu inputs, at most %lld ulp from libm (bound %d)\n", n, (long long)worst,
           KVPI_EXP_MAX_ULP);

    /* Every level gives the portable bits, at every alignment and tail length. */
    for (size_t l = 0; l < nlevels; l++) {
        for (size_t o = 0; o < 4; o++) {
            memset(got, 0xff, (EXP_INPUTS + 8) * sizeof *got);
            levels[l]->exps(x, got + o, n);
            assert_memory_equal(got + o, expect, n * sizeof *got);
            assert_true(kvpt_same_bits(got[o + n], got[EXP_INPUTS + 7])); /* nothing past n */
        }
        for (size_t len = 0; len <= 19; len++) {
            for (size_t from = 0; from + len <= n; from += 9973) {
                levels[l]->exps(x + from, got + 1, len);
                assert_memory_equal(got + 1, expect + from, len * sizeof *got);
            }
        }
    }
    free(x);
    free(expect);
    free(got);
}

/* The documented sum of e[0..n): eight lane sums in increasing f, the tree, then the tail. */
static double documented_sum(const double *e, size_t n)
{
    double s[8] = {0};
    size_t n8 = n / 8 * 8;
    for (size_t f = 0; f < n8; f++) {
        s[f % 8] = s[f % 8] + e[f];
    }
    double sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for (size_t f = n8; f < n; f++) {
        sum = sum + e[f];
    }
    return sum;
}

static void test_kernels_softmax_same_bits_at_every_level(void **state)
{
    (void)state;
    enum { LONGEST = 8193 };
    static const size_t lengths[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 64, 100, 1024, LONGEST};
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    double *scores = kvpt_doubles(LONGEST + 1);
    double *expect = kvpt_doubles(LONGEST + 1);
    double *got = kvpt_doubles(LONGEST + 1);
    double *e = kvpt_doubles(LONGEST);
    for (size_t c = 0; c < KVPT_COUNT_OF(lengths); c++) {
        for (size_t spread = 0; spread < 3; spread++) {
            size_t n = lengths[c];
            size_t o = c % 2;
            for (size_t i = 0; i < n; i++) {
                scores[o + i] = unit() * (spread == 0 ? 1.0 : spread == 1 ? 40.0 : 400.0);
            }
            if (spread == 2 && n > 2) {
                scores[o + n / 2] = 1e308;   /* the maximum ... */
                scores[o + n - 1] = -1e308;  /* ... minus this is -inf: exp gives +0 */
                scores[o] = -0.0;
            }
            double max = scores[o];
            size_t at = 0;
            for (size_t i = 1; i < n; i++) {
                if (scores[o + i] > max) {
                    max = scores[o + i];
                    at = i;
                }
            }
            /* The portable exp, the documented order, then the division. */
            for (size_t i = 0; i < n; i++) {
                e[i] = kvpi_exp(scores[o + i] - max);
            }
            assert_true(kvpt_same_bits(e[at], 1.0)); /* the maximum contributes exactly 1 */
            double sum = documented_sum(e, n);
            for (size_t i = 0; i < n; i++) {
                expect[i] = e[i] / sum;
            }
            for (size_t l = 0; l < nlevels; l++) {
                memcpy(got + o, scores + o, n * sizeof *got);
                assert_true(kvpt_same_bits(levels[l]->exp_sum(got + o, n, max), sum));
                assert_memory_equal(got + o, e, n * sizeof *got);
                assert_int_equal(kvpi_kernels_use(levels[l]->isa), 0);
                memcpy(got + o, scores + o, n * sizeof *got);
                kvpi_softmax(got + o, n);
                if (memcmp(got + o, expect, n * sizeof *got) != 0) {
                    print_error("level %s: softmax of %zu scores (spread %zu) differs\n",
                                levels[l]->name, n, spread);
                    fail();
                }
            }
            double total = 0.0;
            for (size_t i = 0; i < n; i++) {
                assert_true(expect[i] >= 0.0 && expect[i] <= 1.0);
                total += expect[i];
            }
            assert_true(fabs(total - 1.0) <= (double)n * DBL_EPSILON);
        }
    }
    free(scores);
    free(expect);
    free(got);
    free(e);
}

/* ---- RoPE tables ------------------------------------------------------------------- */

/* theta_i, written out as the rotation always computed it. */
static double direct_theta(double base, size_t width, size_t i)
{
    double w = (double)width;
    return pow(base, -(double)(2 * i) / w);
}

/* a and b rotated by the layer (table or thetas) equal the direct rotation, bit for bit. */
static void expect_layer_rope_direct(const kvp_layer *layer, size_t position)
{
    size_t hd = layer->head_width;
    size_t count = 2 * layer->heads + 1;
    double *a = kvpt_doubles(count * hd);
    double *b = kvpt_doubles(count * hd);
    double *direct = kvpt_doubles(count * hd);
    fill(a, count * hd);
    fill(b, count * hd);
    memcpy(direct, a, count * hd * sizeof *direct);
    kvpi_rope_apply_rows(&layer->rope, direct, hd, count, position);
    double *one = kvpt_doubles(hd);
    memcpy(one, b + hd, hd * sizeof *one);
    kvp_error err;
    kvpt_assert_ok(kvp_rope_rotate(&layer->rope, one, position, &err), &err);
    kvpi_layer_rope(layer, a, b, count, position);
    assert_memory_equal(a, direct, count * hd * sizeof *a);
    assert_memory_equal(b + hd, one, hd * sizeof *one); /* the public rotation too */
    kvpi_layer_rope(layer, direct, NULL, count, position);
    kvpi_rope_apply_rows(&layer->rope, a, hd, count, position);
    assert_memory_equal(a, direct, count * hd * sizeof *a);
    free(a);
    free(b);
    free(direct);
    free(one);
}

static void test_kernels_rope_table_matches_formulas(void **state)
{
    (void)state;
    typedef struct rope_case {
        size_t width, heads, positions;
        double base;
    } rope_case;
    static const rope_case cases[] = {
        {4, 2, 8, 10000.0}, {16, 2, 64, 10000.0}, {12, 3, 33, 0.5}, {128, 1, 100, 1e6},
    };
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        const rope_case *rc = &cases[c];
        kvp_layer *layer = kvpt_random_layer(rc->width, rc->heads, rc->positions, rc->base, 3);
        size_t hd = rc->width / rc->heads;
        size_t half = hd / 2;
        assert_non_null(layer->rope_table);
        for (size_t i = 0; i < half; i++) {
            assert_true(kvpt_same_bits(layer->rope_theta[i], direct_theta(rc->base, hd, i)));
        }
        for (size_t p = 0; p < rc->positions; p++) {
            for (size_t i = 0; i < half; i++) {
                double angle = (double)p * direct_theta(rc->base, hd, i);
                assert_true(kvpt_same_bits(layer->rope_table[(p * half + i) * 2], cos(angle)));
                assert_true(kvpt_same_bits(layer->rope_table[(p * half + i) * 2 + 1], sin(angle)));
            }
        }
        for (size_t p = 0; p < rc->positions; p += 1 + p / 3) {
            expect_layer_rope_direct(layer, p);
        }
        expect_layer_rope_direct(layer, rc->positions - 1);
        kvpt_destroy_layer(layer);
    }

    /* The cap: 8192 positions of d_h = 64 take 4 MiB and get a table; one more does not. */
    size_t base_bytes = sizeof(struct kvp_layer) + 32 * sizeof(double);
    assert_int_equal(kvpi_layer_alloc_bytes(64, 8192), base_bytes + 8192 * 64 * sizeof(double));
    assert_int_equal(8192 * 64 * sizeof(double), KVPI_ROPE_TABLE_MAX_BYTES);
    assert_int_equal(kvpi_layer_alloc_bytes(64, 8193), base_bytes);
    assert_int_equal(kvpi_layer_alloc_bytes(2, SIZE_MAX), sizeof(struct kvp_layer) + 8);
    kvp_layer *wide = kvpt_random_layer(64, 1, 8193, 10000.0, 4);
    assert_null(wide->rope_table);
    for (size_t i = 0; i < 32; i++) {
        assert_true(kvpt_same_bits(wide->rope_theta[i], direct_theta(10000.0, 64, i)));
    }
    expect_layer_rope_direct(wide, 0);
    expect_layer_rope_direct(wide, 1);
    expect_layer_rope_direct(wide, 8192);
    kvpt_destroy_layer(wide);
    kvp_layer *endless = kvpt_random_layer(4, 2, SIZE_MAX, 10000.0, 5);
    assert_null(endless->rope_table);
    expect_layer_rope_direct(endless, 7);
    expect_layer_rope_direct(endless, (size_t)1 << 40);
    kvpt_destroy_layer(endless);
}

/* With a table or without (above the cap), attention gives the same bits, at every level. */
static void test_kernels_attention_same_bits_with_and_without_table(void **state)
{
    (void)state;
    static const geometry cases[] = {{1, 2, 64, 16, 40}, {2, 3, 14, 3, 29}};
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    for (size_t c = 0; c < KVPT_COUNT_OF(cases); c++) {
        const geometry *g = &cases[c];
        size_t d = g->heads * g->head_width;
        size_t rows = g->batch * g->capacity * d;
        /* Enough positions that the table would pass the cap. */
        size_t untabled = KVPI_ROPE_TABLE_MAX_BYTES / sizeof(double) / g->head_width + 1;
        double *out = kvpt_doubles(rows);
        double *ref = kvpt_doubles(rows);
        double *out2 = kvpt_doubles(rows);
        double *ref2 = kvpt_doubles(rows);
        for (size_t l = 0; l < nlevels; l++) {
            assert_int_equal(kvpi_kernels_use(levels[l]->isa), 0);
            run_both_ways(g, g->capacity, 900 + c, out, ref);
            run_both_ways(g, untabled, 900 + c, out2, ref2);
            assert_memory_equal(out, out2, rows * sizeof(double));
            assert_memory_equal(ref, ref2, rows * sizeof(double));
        }
        free(out);
        free(ref);
        free(out2);
        free(ref2);
    }
}

/* ---- KVP_ISA in a fresh process ----------------------------------------------- */

/* Runs this program with KVP_ISA=value and --print-level; returns its output (both streams). */
static void run_child(const char *value, char *text, size_t size)
{
    char self[4096];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(len > 0);
    self[len] = '\0';
    char command[4300];
    snprintf(command, sizeof command, "KVP_ISA='%s' '%s' --print-level 2>&1", value, self);
    FILE *child = popen(command, "r");
    assert_non_null(child);
    size_t got = fread(text, 1, size - 1, child);
    text[got] = '\0';
    assert_int_equal(pclose(child), 0);
}

static void test_kernels_env_override_and_fallback(void **state)
{
    (void)state;
    /* The child runs natively, even under Valgrind, so it may use every level. */
    char text[512];
    char expected[512];
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        if (kvpi_kernels_level((kvpi_isa)isa) == NULL) {
            continue;
        }
        run_child(kvpi_isa_name((kvpi_isa)isa), text, sizeof text);
        snprintf(expected, sizeof expected, "level %s\n", kvpi_isa_name((kvpi_isa)isa));
        assert_string_equal(text, expected);
    }
    if (RUNNING_ON_VALGRIND) {
        printf("# KVP_ISA fallback: checked natively only (the child's best level is the "
               "CPU's, not Valgrind's)\n");
        return;
    }
    const char *best = kvpi_isa_name(kvpi_kernels_best());
    run_child("sse9", text, sizeof text);
    snprintf(expected, sizeof expected,
             "kvpager: KVP_ISA='sse9' is not scalar, avx2 or avx512; using %s\nlevel %s\n", best,
             best);
    assert_string_equal(text, expected);
    if (kvpi_kernels_best() + 1 < KVPI_ISA_COUNT) {
        const char *missing = kvpi_isa_name((kvpi_isa)(kvpi_kernels_best() + 1));
        run_child(missing, text, sizeof text);
        snprintf(expected, sizeof expected,
                 "kvpager: KVP_ISA=%s is not supported by this CPU or build; using %s\n"
                 "level %s\n", missing, best, best);
        assert_string_equal(text, expected);
    }
    run_child("", text, sizeof text);
    snprintf(expected, sizeof expected, "level %s\n", best);
    assert_string_equal(text, expected);
}

/* ---- threads share the table ----------------------------------------------------- */

enum { WORKERS = 2, PHASES = KVPI_ISA_COUNT };

typedef struct shared_run {
    pthread_barrier_t barrier;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels;
    const double *a;
    const double *b;
    double expected;
    int wrong[WORKERS];
} shared_run;

typedef struct worker_arg {
    shared_run *run;
    size_t id;
} worker_arg;

/*
 * In each phase the main thread forces a level, then every worker computes
 * dots through the active table between two barriers, so a level changes
 * only while no worker reads it; all must get the same bits.
 */
static void *worker(void *p)
{
    worker_arg *arg = p;
    shared_run *run = arg->run;
    for (size_t phase = 0; phase < run->nlevels; phase++) {
        pthread_barrier_wait(&run->barrier);
        for (int i = 0; i < 50; i++) {
            const kvpi_kernels *k = kvpi_kernels_active();
            if (!kvpt_same_bits(kvpi_dot(run->a, run->b, 100), run->expected) ||
                k != run->levels[phase]) {
                run->wrong[arg->id]++;
            }
        }
        pthread_barrier_wait(&run->barrier);
    }
    return NULL;
}

static void test_kernels_threads_share_the_table(void **state)
{
    (void)state;
    shared_run run;
    memset(&run, 0, sizeof run);
    run.nlevels = test_levels(run.levels);
    double a[100];
    double b[100];
    fill(a, 100);
    fill(b, 100);
    run.a = a;
    run.b = b;
    run.expected = kvpi_kernels_scalar.dot(a, b, 100);
    assert_int_equal(pthread_barrier_init(&run.barrier, NULL, WORKERS + 1), 0);
    pthread_t threads[WORKERS];
    worker_arg args[WORKERS];
    for (size_t i = 0; i < WORKERS; i++) {
        args[i] = (worker_arg){&run, i};
        assert_int_equal(pthread_create(&threads[i], NULL, worker, &args[i]), 0);
    }
    for (size_t phase = 0; phase < run.nlevels; phase++) {
        assert_int_equal(kvpi_kernels_use(run.levels[phase]->isa), 0);
        pthread_barrier_wait(&run.barrier);
        pthread_barrier_wait(&run.barrier);
    }
    for (size_t i = 0; i < WORKERS; i++) {
        assert_int_equal(pthread_join(threads[i], NULL), 0);
        assert_int_equal(run.wrong[i], 0);
    }
    pthread_barrier_destroy(&run.barrier);
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "--print-level") == 0) {
        printf("level %s\n", kvpi_kernels_active()->name);
        return 0;
    }
    initial_level = kvpi_kernels_active()->isa;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_kernels_levels_and_refusals, restore_level),
        cmocka_unit_test_teardown(test_kernels_dot_and_axpy_match_scalar, restore_level),
        cmocka_unit_test_teardown(test_kernels_project_rows_equal_project_row, restore_level),
        cmocka_unit_test_teardown(test_kernels_narrow_rows_match_f64_on_widened, restore_level),
        cmocka_unit_test_teardown(test_kernels_gather_same_bits_across_blocks_and_levels,
                                  restore_level),
        cmocka_unit_test_teardown(test_kernels_attention_exact_at_every_level, restore_level),
        cmocka_unit_test_teardown(test_kernels_exp_matches_scalar_and_libm, restore_level),
        cmocka_unit_test_teardown(test_kernels_softmax_same_bits_at_every_level, restore_level),
        cmocka_unit_test(test_kernels_rope_table_matches_formulas),
        cmocka_unit_test_teardown(test_kernels_attention_same_bits_with_and_without_table,
                                  restore_level),
        cmocka_unit_test_teardown(test_kernels_env_override_and_fallback, restore_level),
        cmocka_unit_test_teardown(test_kernels_threads_share_the_table, restore_level),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
