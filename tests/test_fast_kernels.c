/*
 * test_fast_kernels.c: the grouped kernels and the fast accumulation level
 * of src/attention/kernels.h, at every ISA level this machine runs, on
 * arrays (no pool: f16 and fp8 pages do not exist in pools yet).
 *
 * Proves: f16 and e4m3 widen exactly to the values their formats define
 * (every code), and every level's grouped kernels widen every e4m3 code to
 * kvpi_e4m3_widen's bits (NaN codes and -0 included); at every level,
 * dot_group and axpy_group give the bits of the portable dot_rows and
 * axpy_rows on the widened rows, one head at a time, for every row format,
 * any number of heads, lengths, row counts and strides, writing nothing
 * else; the fast kernels give the bits of the fast order written out here
 * independently (16 fmaf lanes, the tree, the tail; fmaf chains for the
 * values), for f32, bf16, f16 and e4m3 rows; rows split into calls of 1, 3
 * and 16 (the block sizes) give the same bits; and the dispatched softmax
 * of each level equals the portable one; the fast softmax (f32, base 2) of
 * each level equals the documented order written out here, for every length
 * 0..300 and score spreads up to 3e38.
 * Levels are read with kvpi_kernels_level; under Valgrind AVX-512 is skipped.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <valgrind/valgrind.h>

#include "support.h"

#include "attention/kernels.h"

static size_t test_levels(const kvpi_kernels *out[KVPI_ISA_COUNT])
{
    size_t n = 0;
    for (int isa = 0; isa < KVPI_ISA_COUNT; isa++) {
        const kvpi_kernels *k = kvpi_kernels_level((kvpi_isa)isa);
        if (k != NULL && !(isa == KVPI_ISA_AVX512 && RUNNING_ON_VALGRIND)) {
            out[n++] = k;
        }
    }
    return n;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t next_u64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static double unit(void)
{
    return (double)(next_u64() >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}

/* Random doubles of mixed magnitudes, so that the summation order shows in the bits. */
static void fill(double *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = unit() * (i % 3 == 0 ? 1e2 : i % 3 == 1 ? 1.0 : 1e-3);
    }
}

/* ---- widening ------------------------------------------------------------------ */

/* IEEE binary16 by its definition. */
static double f16_value(uint16_t h)
{
    int e = (h >> 10) & 0x1F;
    int m = h & 0x3FF;
    double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (e == 31) {
        return m == 0 ? sign * INFINITY : NAN;
    }
    return sign * (e == 0 ? ldexp(m, -24) : ldexp(1.0 + m / 1024.0, e - 15));
}

/* OCP e4m3fn by its definition. */
static double e4m3_value(uint8_t x)
{
    int e = (x >> 3) & 0xF;
    int m = x & 7;
    double sign = (x & 0x80) ? -1.0 : 1.0;
    if (e == 15 && m == 7) {
        return NAN;
    }
    return sign * (e == 0 ? ldexp(m, -9) : ldexp(1.0 + m / 8.0, e - 7));
}

static void test_fast_widening_is_exact_for_every_code(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        double want = f16_value((uint16_t)h);
        double got = (double)kvpi_f16_widen((uint16_t)h);
        if (isnan(want)) {
            assert_true(isnan(got));
        } else {
            assert_true(memcmp(&want, &got, sizeof got) == 0); /* -0 too */
        }
    }
    for (uint32_t x = 0; x < 256; x++) {
        double want = e4m3_value((uint8_t)x);
        double got = (double)kvpi_e4m3_widen((uint8_t)x);
        if (isnan(want)) {
            assert_true(isnan(got));
        } else {
            assert_true(memcmp(&want, &got, sizeof got) == 0);
        }
    }
    assert_true(kvpi_e4m3_widen(0x7E) == 448.0f);
    assert_true(kvpi_e4m3_widen(0x01) == 0x1p-9f);
    assert_true(kvpi_f16_widen(0x7BFF) == 65504.0f);
}

/*
 * Every e4m3 code, widened by each level's grouped kernels: an axpy with
 * weight 1 onto -0 gives each element's widening itself (its bits, -0 and
 * the NaN codes' sign | KVPI_E4M3_NAN_BITS included), at the fast level (f32)
 * and the exact one (f64), each code in several lanes and in a tail.
 */
static void test_fast_every_e4m3_code_at_every_level(void **state)
{
    (void)state;
    enum { N = 263 };
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    uint8_t codes[N];
    float fast[N];
    double exact[N];
    const float w1f = 1.0f;
    const double w1 = 1.0;
    for (size_t l = 0; l < nlevels; l++) {
        const kvpi_kernels *k = levels[l];
        for (size_t shift = 0; shift < 16; shift += 5) {
            for (size_t j = 0; j < N; j++) {
                codes[j] = (uint8_t)(j + shift);
                fast[j] = -0.0f;
                exact[j] = -0.0;
            }
            k->axpy_group_fast(KVPI_ROWS_E4M3, fast, N, &w1f, 1, 1, codes, N, 1, N, NULL);
            k->axpy_group(KVPI_ROWS_E4M3, exact, N, &w1, 1, 1, codes, N, 1, N, NULL);
            for (size_t j = 0; j < N; j++) {
                float want = kvpi_e4m3_widen(codes[j]);
                double want_d = (double)want;
                if (memcmp(&fast[j], &want, sizeof want) != 0 ||
                    memcmp(&exact[j], &want_d, sizeof want_d) != 0) {
                    print_error("%s: e4m3 code 0x%02x at %zu widened to %a / %a, not %a\n",
                                k->name, codes[j], j, (double)fast[j], exact[j], want_d);
                    fail();
                }
            }
        }
    }
}

/* ---- rows of every format -------------------------------------------------------- */

enum { MAX_G = 12, MAX_N = 140, MAX_COUNT = 17, PAD = 5 };
#define ROW_CAP ((size_t)MAX_COUNT * (MAX_N + PAD) + 32)

static const kvpi_rows all_kinds[] = {KVPI_ROWS_F64, KVPI_ROWS_F32, KVPI_ROWS_BF16,
                                      KVPI_ROWS_F16, KVPI_ROWS_E4M3};
static const char *const kind_names[] = {"f64", "f32", "bf16", "f16", "e4m3"};
static const size_t lengths[] = {0, 1, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 128, 140};
static const size_t groups[] = {1, 2, 3, 4, 7, 8, 12};
static const size_t counts[] = {0, 1, 3, 5, 16, 17};

/* Stored rows of one format and their exact widening. */
typedef struct rows_buf {
    unsigned char *bytes; /* ROW_CAP elements */
    double *wide;         /* ROW_CAP */
} rows_buf;

/* Random finite elements: every e4m3 code but NaN, f16 codes but inf/NaN, mixed magnitudes. */
static void fill_rows(rows_buf *b, kvpi_rows kind)
{
    for (size_t i = 0; i < ROW_CAP; i++) {
        double x = unit() * (i % 3 == 0 ? 1e2 : i % 3 == 1 ? 1.0 : 1e-3);
        uint64_t r = next_u64();
        switch (kind) {
        case KVPI_ROWS_F64:
            memcpy(b->bytes + 8 * i, &x, 8);
            break;
        case KVPI_ROWS_F32: {
            float f = (float)x;
            memcpy(b->bytes + 4 * i, &f, 4);
            break;
        }
        case KVPI_ROWS_BF16: {
            float f = (float)x;
            uint32_t bits;
            memcpy(&bits, &f, 4);
            uint16_t h = (uint16_t)(bits >> 16);
            memcpy(b->bytes + 2 * i, &h, 2);
            break;
        }
        case KVPI_ROWS_F16: {
            uint16_t h = (uint16_t)(r & 0xFFFF);
            if (((h >> 10) & 0x1F) == 0x1F) {
                h &= (uint16_t)~0x4000u; /* exponent 15: finite */
            }
            memcpy(b->bytes + 2 * i, &h, 2);
            break;
        }
        default: {
            uint8_t e = (uint8_t)(r & 0xFF);
            b->bytes[i] = (e & 0x7F) == 0x7F ? (uint8_t)(e & 0xFE) : e;
            break;
        }
        }
        b->wide[i] = kvpi_rows_widen(kind, b->bytes, i);
    }
}

static int same(const double *a, const double *b, size_t n)
{
    return n == 0 || memcmp(a, b, n * sizeof *a) == 0;
}

/*
 * One geometry of the exact grouped kernels at one level against the
 * portable one-head kernels on the widened rows.
 */
static void check_exact_geometry(const kvpi_kernels *k, kvpi_rows kind, const rows_buf *b,
                                 const double *q, const double *w0, const double *acc0,
                                 size_t g, size_t n, size_t count)
{
    const kvpi_kernels *s = &kvpi_kernels_scalar;
    size_t stride = n + (n + count) % PAD;
    size_t at = count % 3; /* rows starting at odd element offsets */
    size_t esz = kvpi_rows_bytes(kind);
    size_t out_stride = MAX_COUNT + 2;
    double got[MAX_G * (MAX_COUNT + 2)];
    double want[MAX_G * (MAX_COUNT + 2)];
    kvpt_fill(got, MAX_G * out_stride, 7.0);
    kvpt_fill(want, MAX_G * out_stride, 7.0);
    for (size_t h = 0; h < g; h++) {
        s->dot_rows(q + h * n, b->wide + at, stride, count, n, 0.375, want + h * out_stride);
    }
    /* With a prefetch hint (the rows themselves): it must change no bit. */
    k->dot_group(kind, q, g, b->bytes + at * esz, stride, count, n, 0.375, got, out_stride,
                 b->bytes);
    if (!same(got, want, MAX_G * out_stride)) {
        print_error("%s dot_group %s g=%zu n=%zu count=%zu differs\n", k->name,
                    kind_names[kind], g, n, count);
        fail();
    }
    /* accumulators [g][n + 3] (stride), weights [g][MAX_COUNT + 1] */
    size_t acc_stride = n + 3;
    size_t w_stride = MAX_COUNT + 1;
    double acc_got[MAX_G * (MAX_N + 3)];
    double acc_want[MAX_G * (MAX_N + 3)];
    memcpy(acc_got, acc0, sizeof acc_got);
    memcpy(acc_want, acc0, sizeof acc_want);
    for (size_t h = 0; h < g; h++) {
        s->axpy_rows(acc_want + h * acc_stride, w0 + h * w_stride, b->wide + at, stride, count,
                     n);
    }
    k->axpy_group(kind, acc_got, acc_stride, w0, w_stride, g, b->bytes + at * esz, stride, count,
                  n, b->bytes);
    if (!same(acc_got, acc_want, MAX_G * (MAX_N + 3))) {
        print_error("%s axpy_group %s g=%zu n=%zu count=%zu differs\n", k->name,
                    kind_names[kind], g, n, count);
        fail();
    }
}

static void test_fast_exact_group_equals_one_head_at_a_time(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    rows_buf b = {malloc(ROW_CAP * 8), kvpt_doubles(ROW_CAP)};
    double *q = kvpt_doubles(MAX_G * MAX_N);
    double *w0 = kvpt_doubles(MAX_G * (MAX_COUNT + 1));
    double *acc0 = kvpt_doubles(MAX_G * (MAX_N + 3));
    assert_non_null(b.bytes);
    size_t checked = 0;
    for (size_t ki = 0; ki < sizeof all_kinds / sizeof *all_kinds; ki++) {
        fill_rows(&b, all_kinds[ki]);
        for (size_t ni = 0; ni < sizeof lengths / sizeof *lengths; ni++) {
            fill(q, MAX_G * MAX_N);
            fill(w0, MAX_G * (MAX_COUNT + 1));
            fill(acc0, MAX_G * (MAX_N + 3));
            for (size_t gi = 0; gi < sizeof groups / sizeof *groups; gi++) {
                for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
                    for (size_t l = 0; l < nlevels; l++) {
                        check_exact_geometry(levels[l], all_kinds[ki], &b, q, w0, acc0,
                                             groups[gi], lengths[ni], counts[ci]);
                        checked++;
                    }
                }
            }
        }
    }
    printf("# %zu exact grouped geometries x levels checked\n", checked);
    free(b.bytes);
    free(b.wide);
    free(q);
    free(w0);
    free(acc0);
}

/* ---- the fast level ------------------------------------------------------------- */

/* The fast order, written out here from the documentation, not the library. */
static float documented_fast_dot(const float *q, const double *wide, size_t n)
{
    float s[16] = {0};
    size_t n16 = n / 16 * 16;
    for (size_t f = 0; f < n16; f++) {
        s[f % 16] = fmaf(q[f], (float)wide[f], s[f % 16]);
    }
    float t[8];
    for (int l = 0; l < 8; l++) {
        t[l] = s[l] + s[l + 8];
    }
    float u[4];
    for (int l = 0; l < 4; l++) {
        u[l] = t[l] + t[l + 4];
    }
    float sum = (u[0] + u[2]) + (u[1] + u[3]);
    for (size_t f = n16; f < n; f++) {
        sum = fmaf(q[f], (float)wide[f], sum);
    }
    return sum;
}

/*
 * One geometry of the fast kernels at one level against the documented
 * order; the rows handed over in calls of `split` rows (a block size), the
 * accumulators carried across calls as the gather does.
 */
static void check_fast_geometry(const kvpi_kernels *k, kvpi_rows kind, const rows_buf *b,
                                const float *q, const float *w0, const float *acc0, size_t g,
                                size_t n, size_t count, size_t split)
{
    size_t stride = n + (n + count) % PAD;
    size_t at = count % 3;
    size_t esz = kvpi_rows_bytes(kind);
    size_t out_stride = MAX_COUNT + 2;
    float got[MAX_G * (MAX_COUNT + 2)];
    float want[MAX_G * (MAX_COUNT + 2)];
    for (size_t i = 0; i < MAX_G * out_stride; i++) {
        got[i] = want[i] = 7.0f;
    }
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            want[h * out_stride + r] = documented_fast_dot(q + h * n, b->wide + at + r * stride, n);
        }
    }
    for (size_t r0 = 0; r0 < count; r0 += split) {
        size_t c = count - r0 < split ? count - r0 : split;
        /* Every other call with a prefetch hint: it must change no bit. */
        const void *ahead = r0 / split % 2 == 0 ? b->bytes : NULL;
        k->dot_group_fast(kind, q, g, b->bytes + (at + r0 * stride) * esz, stride, c, n,
                          got + r0, out_stride, ahead);
    }
    if (memcmp(got, want, sizeof got) != 0) {
        print_error("%s dot_group_fast %s g=%zu n=%zu count=%zu split=%zu differs\n", k->name,
                    kind_names[kind], g, n, count, split);
        fail();
    }
    size_t acc_stride = n + 3;
    size_t w_stride = MAX_COUNT + 1;
    float acc_got[MAX_G * (MAX_N + 3)];
    float acc_want[MAX_G * (MAX_N + 3)];
    memcpy(acc_got, acc0, sizeof acc_got);
    memcpy(acc_want, acc0, sizeof acc_want);
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            for (size_t f = 0; f < n; f++) {
                float *a = acc_want + h * acc_stride + f;
                *a = fmaf(w0[h * w_stride + r], (float)b->wide[at + r * stride + f], *a);
            }
        }
    }
    for (size_t r0 = 0; r0 < count; r0 += split) {
        size_t c = count - r0 < split ? count - r0 : split;
        const void *ahead = r0 / split % 2 == 0 ? NULL : b->bytes;
        k->axpy_group_fast(kind, acc_got, acc_stride, w0 + r0, w_stride, g,
                           b->bytes + (at + r0 * stride) * esz, stride, c, n, ahead);
    }
    if (memcmp(acc_got, acc_want, sizeof acc_got) != 0) {
        print_error("%s axpy_group_fast %s g=%zu n=%zu count=%zu split=%zu differs\n", k->name,
                    kind_names[kind], g, n, count, split);
        fail();
    }
}

static void fill_f32(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)(unit() * (i % 3 == 0 ? 1e2 : i % 3 == 1 ? 1.0 : 1e-3));
    }
}

static void test_fast_kernels_equal_documented_order(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    static const size_t splits[] = {1, 3, 16};
    rows_buf b = {malloc(ROW_CAP * 8), kvpt_doubles(ROW_CAP)};
    float *q = malloc(MAX_G * MAX_N * sizeof *q);
    float *w0 = malloc(MAX_G * (MAX_COUNT + 1) * sizeof *w0);
    float *acc0 = malloc(MAX_G * (MAX_N + 3) * sizeof *acc0);
    assert_true(b.bytes != NULL && q != NULL && w0 != NULL && acc0 != NULL);
    size_t checked = 0;
    for (size_t ki = 1; ki < sizeof all_kinds / sizeof *all_kinds; ki++) {
        fill_rows(&b, all_kinds[ki]);
        for (size_t ni = 0; ni < sizeof lengths / sizeof *lengths; ni++) {
            fill_f32(q, MAX_G * MAX_N);
            fill_f32(w0, MAX_G * (MAX_COUNT + 1));
            fill_f32(acc0, MAX_G * (MAX_N + 3));
            for (size_t gi = 0; gi < sizeof groups / sizeof *groups; gi++) {
                for (size_t ci = 0; ci < sizeof counts / sizeof *counts; ci++) {
                    for (size_t l = 0; l < nlevels; l++) {
                        size_t split = splits[(ni + gi + ci + l) % 3];
                        check_fast_geometry(levels[l], all_kinds[ki], &b, q, w0, acc0,
                                            groups[gi], lengths[ni], counts[ci], split);
                        checked++;
                    }
                }
            }
        }
    }
    printf("# %zu fast geometries x levels checked\n", checked);
    free(b.bytes);
    free(b.wide);
    free(q);
    free(w0);
    free(acc0);
}

/* The fast level is not the exact one: f32 rows of d 128 differ from the f64 sums somewhere. */
static void test_fast_level_differs_from_exact(void **state)
{
    (void)state;
    rows_buf b = {malloc(ROW_CAP * 8), kvpt_doubles(ROW_CAP)};
    assert_non_null(b.bytes);
    fill_rows(&b, KVPI_ROWS_F32);
    double q[128];
    float q32[128];
    fill(q, 128);
    for (size_t i = 0; i < 128; i++) {
        q32[i] = (float)q[i];
    }
    double exact[16];
    float fast[16];
    const kvpi_kernels *k = kvpi_kernels_active();
    k->dot_group(KVPI_ROWS_F32, q, 1, b.bytes, 128, 16, 128, 1.0, exact, 0, NULL);
    k->dot_group_fast(KVPI_ROWS_F32, q32, 1, b.bytes, 128, 16, 128, fast, 0, NULL);
    int differ = 0;
    for (size_t i = 0; i < 16; i++) {
        differ |= exact[i] != (double)fast[i];
    }
    assert_true(differ);
    free(b.bytes);
    free(b.wide);
}

/* Every level's softmax (the table entry) equals the portable one, bit for bit. */
static void test_fast_softmax_entry_same_bits(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    double x[300];
    double want[300];
    double got[300];
    for (size_t n = 1; n <= 300; n += (n < 40 ? 1 : 37)) {
        fill(x, n);
        x[n / 2] = -0.0;
        memcpy(want, x, n * sizeof *x);
        kvpi_kernels_scalar.softmax(want, n);
        for (size_t l = 0; l < nlevels; l++) {
            memcpy(got, x, n * sizeof *x);
            levels[l]->softmax(got, n);
            assert_memory_equal(got, want, n * sizeof *got);
        }
    }
}

/*
 * kvpi_exp2f against libm's exp2 (f64): within 1.14 * 2^-24 relative plus
 * 2^-150 (a subnormal's rounding) on a grid of [-160, 0] and a finer one of
 * [-1/2, 1/2] (the polynomial's whole domain; the bound was found
 * exhaustively over every f32 there); exact at integers, +0 far below.
 */
static void test_fast_exp2f_error(void **state)
{
    (void)state;
    double worst = 0.0;
    size_t checked = 0;
    for (int pass = 0; pass < 2; pass++) {
        double lo = pass == 0 ? -160.0 : -0.5;
        double hi = pass == 0 ? 0.0 : 0.5;
        double step = pass == 0 ? 0x1p-10 : 0x1p-19;
        for (double t = lo; t <= hi; t += step) {
            float y = kvpi_exp2f((float)t);
            double e = exp2((double)(float)t);
            double err = fabs((double)y - e);
            assert_true(err <= 1.14 * 0x1p-24 * e + 0x1p-150);
            if (e >= 0x1p-126) {
                worst = fmax(worst, err / e);
            }
            checked++;
        }
    }
    for (int k = -149; k <= 0; k++) {
        assert_true(kvpi_exp2f((float)k) == ldexpf(1.0f, k));
    }
    assert_true(kvpi_exp2f(-0.0f) == 1.0f);
    assert_true(kvpi_exp2f(-INFINITY) == 0.0f && !signbit(kvpi_exp2f(-INFINITY)));
    assert_true(kvpi_exp2f(-200.0f) == 0.0f && kvpi_exp2f(-3e38f) == 0.0f);
    printf("# exp2f: %zu points, worst relative error %.3f * 2^-24\n", checked,
           worst / 0x1p-24);
}

/* Scores of one of several shapes: spreads from 1 to 3e38 (differences that overflow to -inf). */
static void fill_scores(float *x, size_t n, int shape)
{
    static const double spread[] = {1.0, 30.0, 150.0, 1e4, 1e30, 3e38};
    for (size_t i = 0; i < n; i++) {
        double u = unit(); /* [-1, 1) */
        x[i] = (float)(u * spread[shape]);
        if (shape == 2 && i % 7 == 3) {
            x[i] = (float)(-126.0 - 30.0 * (unit() + 1.0) / 2.0); /* subnormal exps */
        }
    }
    if (n > 0 && shape == 0) {
        x[n / 2] = -0.0f;
    }
}

/* softmax_fast at every level equals the documented order (and the portable level), bit for bit. */
static void test_fast_softmax_same_bits(void **state)
{
    (void)state;
    const kvpi_kernels *levels[KVPI_ISA_COUNT];
    size_t nlevels = test_levels(levels);
    enum { MAXN = 300 };
    float x[MAXN + 1];
    float want[MAXN + 1];
    float got[MAXN + 1];
    size_t checked = 0;
    for (size_t n = 0; n <= MAXN; n++) {
        for (int shape = 0; shape < 6; shape++) {
            fill_scores(x, n, shape);
            for (size_t i = n; i <= MAXN; i++) {
                x[i] = 123.0f; /* past the end: never touched */
            }
            memcpy(want, x, sizeof x);
            kvpt_documented_softmax_fast(want, n);
            memcpy(got, x, sizeof x);
            kvpi_softmax_fast_ref(got, n);
            assert_memory_equal(got, want, sizeof got);
            for (size_t l = 0; l < nlevels; l++) {
                memcpy(got, x, sizeof x);
                levels[l]->softmax_fast(got, n);
                if (memcmp(got, want, sizeof got) != 0) {
                    print_error("%s softmax_fast n=%zu shape %d differs\n", levels[l]->name, n,
                                shape);
                    fail();
                }
                checked++;
            }
            float total = 0.0f;
            for (size_t i = 0; i < n; i++) {
                assert_true(want[i] >= 0.0f && want[i] <= 1.0f);
                total += want[i];
            }
            assert_true(n == 0 || fabsf(total - 1.0f) <= 1e-4f);
        }
    }
    printf("# %zu fast softmaxes x levels equal the documented order\n", checked);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_widening_is_exact_for_every_code),
        cmocka_unit_test(test_fast_every_e4m3_code_at_every_level),
        cmocka_unit_test(test_fast_exact_group_equals_one_head_at_a_time),
        cmocka_unit_test(test_fast_kernels_equal_documented_order),
        cmocka_unit_test(test_fast_level_differs_from_exact),
        cmocka_unit_test(test_fast_softmax_entry_same_bits),
        cmocka_unit_test(test_fast_softmax_same_bits),
        cmocka_unit_test(test_fast_exp2f_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
