/*
 * test_dtype_codes.c: the f16 and fp8 e4m3 conversions of src/pager/dtype.h
 * (kvp_dtype, kvpager/pool.h).
 *
 * Proves: every f16 and every e4m3 code widens to its value by definition
 * and rounds back to itself (exhaustively; -0, subnormals and signs
 * included, e4m3 also through power-of-two scales); the midpoint of every
 * pair of neighbours ties to the even code and its f64 neighbours go to the
 * nearer code; f16 rounds once from f64 (never through f32) and e4m3 as
 * round(x / scale) (the quotient in f64, then once), both against a
 * rounding written from first principles on 200000 random values (ties
 * forced); the overflow boundaries (|x| >= 65520 for f16, |x / scale| > 464
 * for e4m3); and the documented error bounds of one stored element
 * (relative 2^-11 and 2^-4 in the normal ranges, absolute 2^-25 and 2^-10
 * below), which the measured maxima reach (printed).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

#include "pager/dtype.h"

static double f16(double x)
{
    return kvpi_dtype_round(KVP_F16, x);
}

static double e4m3(double x, double scale)
{
    return kvpi_dtype_round_scaled(KVP_FP8_E4M3, scale, x);
}

/* ---- conversions ------------------------------------------------------------ */

/* The value of an f16 code from the definition (finite codes only). */
static double f16_value(uint32_t h)
{
    unsigned exponent = (h >> 10) & 0x1f;
    double fraction = (double)(h & 0x3ff);
    double a = exponent == 0 ? ldexp(fraction, -24) : ldexp(1024.0 + fraction, (int)exponent - 25);
    return h & 0x8000 ? -a : a;
}

/* The value of an e4m3 code from the definition (every code but 0x7f, 0xff). */
static double e4m3_value(uint32_t b)
{
    unsigned exponent = (b >> 3) & 0xf;
    double fraction = (double)(b & 0x7);
    double a = exponent == 0 ? ldexp(fraction, -9) : ldexp(8.0 + fraction, (int)exponent - 10);
    return b & 0x80 ? -a : a;
}

static void test_narrow_names_sizes_and_codes(void **state)
{
    (void)state;
    assert_string_equal(kvp_dtype_name(KVP_F16), "f16");
    assert_string_equal(kvp_dtype_name(KVP_FP8_E4M3), "fp8_e4m3");
    assert_int_equal(kvp_dtype_bytes(KVP_F16), 2);
    assert_int_equal(kvp_dtype_bytes(KVP_FP8_E4M3), 1);
    /* Landmarks. */
    assert_int_equal(kvpi_f16_from_f64(1.0), 0x3c00);
    assert_int_equal(kvpi_f16_from_f64(-2.0), 0xc000);
    assert_int_equal(kvpi_f16_from_f64(65504.0), 0x7bff);
    assert_int_equal(kvpi_f16_from_f64(0x1p-24), 0x0001);
    assert_int_equal(kvpi_f16_from_f64(0x1p-14), 0x0400);
    assert_int_equal(kvpi_f16_from_f64(-0.0), 0x8000);
    assert_int_equal(kvpi_f16_from_f64(INFINITY), 0x7c00);
    assert_true(isnan(kvpi_f16_to_f64(kvpi_f16_from_f64(NAN))));
    assert_int_equal(kvpi_e4m3_from_f64(1.0), 0x38);
    assert_int_equal(kvpi_e4m3_from_f64(448.0), 0x7e);
    assert_int_equal(kvpi_e4m3_from_f64(-448.0), 0xfe);
    assert_int_equal(kvpi_e4m3_from_f64(0x1p-9), 0x01);
    assert_int_equal(kvpi_e4m3_from_f64(0x1p-6), 0x08);
    assert_int_equal(kvpi_e4m3_from_f64(-0.0), 0x80);
    assert_int_equal(kvpi_e4m3_from_f64(NAN), 0x7f);
    assert_true(isnan(kvpi_e4m3_to_f64(0x7f)));
    assert_true(isnan(kvpi_e4m3_to_f64(0xff)));
    assert_true(kvpt_same_bits(kvpi_e4m3_to_f64(0x7e), 448.0));
    assert_true(kvpt_same_bits(kvpi_e4m3_to_f64(0x80), -0.0));
}

/* Every f16 code: its value by definition, and back to the same code. */
static void test_narrow_every_f16_round_trips(void **state)
{
    (void)state;
    size_t finite = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        double x = kvpi_f16_to_f64((uint16_t)h);
        if (((h >> 10) & 0x1f) == 0x1f) {
            assert_true((h & 0x3ff) != 0 ? isnan(x) : isinf(x) && signbit(x) == !!(h & 0x8000));
            continue;
        }
        finite++;
        if (!kvpt_same_bits(x, f16_value(h)) || kvpi_f16_from_f64(x) != h ||
            kvpi_dtype_overflows(KVP_F16, x)) {
            print_error("f16 code 0x%04x: widened %a, expected %a, back 0x%04x\n", h, x,
                        f16_value(h), kvpi_f16_from_f64(x));
            fail();
        }
        uint16_t stored;
        double back;
        kvpi_dtype_store(KVP_F16, &stored, &x, 1);
        kvpi_dtype_load(KVP_F16, &stored, &back, 1);
        assert_int_equal(stored, h);
        assert_true(kvpt_same_bits(back, x));
    }
    assert_int_equal(finite, 0x10000 - 2 * 1024);
}

/* Every e4m3 code, at scale 1 and at a power-of-two scale (where x / scale is exact). */
static void test_narrow_every_e4m3_round_trips(void **state)
{
    (void)state;
    for (uint32_t b = 0; b < 0x100; b++) {
        double x = kvpi_e4m3_to_f64((uint8_t)b);
        if ((b & 0x7f) == 0x7f) {
            assert_true(isnan(x));
            continue;
        }
        assert_true(kvpt_same_bits(x, e4m3_value(b)));
        assert_int_equal(kvpi_e4m3_from_f64(x), b);
        assert_false(kvpi_dtype_overflows(KVP_FP8_E4M3, x));
        for (int s = -3; s <= 3; s++) {
            double scale = ldexp(1.0, s * 7);
            double stood = x * scale; /* exact */
            assert_true(kvpt_same_bits(e4m3(stood, scale), x));
            uint8_t stored;
            double back;
            kvpi_dtype_store_scaled(KVP_FP8_E4M3, scale, &stored, &stood, 1);
            assert_int_equal(stored, b);
            kvpi_dtype_load_scaled(KVP_FP8_E4M3, scale, &stored, &back, 1);
            assert_true(kvpt_same_bits(back, stood));
            kvpi_dtype_load(KVP_FP8_E4M3, &stored, &back, 1);
            assert_true(kvpt_same_bits(back, x));
        }
    }
}

/*
 * Between every two neighbouring positive codes (and the step past the
 * largest finite one): the midpoint goes to the even code, its f64
 * neighbours to the nearer code, negatives likewise with the sign.
 */
static void check_midpoints(kvp_dtype dtype, uint32_t largest, double (*value)(uint32_t),
                            double past_largest, uint32_t sign_bit)
{
    for (uint32_t c = 0; c <= largest; c++) {
        double lo = value(c);
        double hi = c == largest ? past_largest : value(c + 1);
        double mid = lo + (hi - lo) / 2; /* exact: both are short */
        uint32_t even = (c & 1) == 0 ? c : c + 1;
        double below = nextafter(mid, 0.0);
        double above = nextafter(mid, INFINITY);
        for (int neg = 0; neg < 2; neg++) {
            double s = neg ? -1.0 : 1.0;
            uint32_t sign = neg ? sign_bit : 0;
            if (dtype == KVP_F16) {
                assert_int_equal(kvpi_f16_from_f64(s * below), c | sign);
                if (c == largest) {
                    /* The tie goes to 2^16, infinity: refused; so is all above. */
                    assert_true(kvpi_dtype_overflows(KVP_F16, s * mid));
                    assert_true(kvpi_dtype_overflows(KVP_F16, s * above));
                    assert_false(kvpi_dtype_overflows(KVP_F16, s * below));
                } else {
                    assert_int_equal(kvpi_f16_from_f64(s * mid), even | sign);
                    assert_int_equal(kvpi_f16_from_f64(s * above), (c + 1) | sign);
                }
            } else {
                assert_int_equal(kvpi_e4m3_from_f64(s * below), c | sign);
                /* At the top, 448 (0x7e) is the even one: 464 is stored as 448. */
                assert_int_equal(kvpi_e4m3_from_f64(s * mid), even | sign);
                assert_false(kvpi_dtype_overflows(KVP_FP8_E4M3, s * mid));
                if (c == largest) {
                    assert_true(kvpi_dtype_overflows(KVP_FP8_E4M3, s * above));
                } else {
                    assert_int_equal(kvpi_e4m3_from_f64(s * above), (c + 1) | sign);
                }
            }
        }
    }
}

static void test_narrow_midpoints_tie_to_even(void **state)
{
    (void)state;
    check_midpoints(KVP_F16, 0x7bff, f16_value, 65536.0, 0x8000);
    check_midpoints(KVP_FP8_E4M3, 0x7e, e4m3_value, 480.0, 0x80);
    assert_true(kvpt_same_bits(f16(nextafter(KVPI_F16_OVERFLOW, 0.0)), KVPI_F16_MAX));
    assert_true(kvpi_dtype_overflows(KVP_F16, KVPI_F16_OVERFLOW));
    assert_true(kvpi_dtype_overflows(KVP_F16, DBL_MAX));
    assert_false(kvpi_dtype_overflows(KVP_F16, INFINITY)); /* not finite: not its business */
    assert_false(kvpi_dtype_overflows(KVP_FP8_E4M3, NAN));
    assert_true(kvpt_same_bits(e4m3(464.0, 1.0), 448.0));
    assert_true(kvpi_dtype_overflows_scaled(KVP_FP8_E4M3, 0.5, 232.0 + 0x1p-45));
    assert_false(kvpi_dtype_overflows_scaled(KVP_FP8_E4M3, 0.5, 232.0));
    /* x / scale overflowing f64 is above 464 too. */
    assert_true(kvpi_dtype_overflows_scaled(KVP_FP8_E4M3, 0x1p-1000, 0x1p+100));
    /* The scale is fp8's alone. */
    assert_false(kvpi_dtype_overflows_scaled(KVP_F16, 0x1p-20, 1.0));
    assert_true(kvpt_same_bits(kvpi_dtype_round_scaled(KVP_F16, 0x1p-20, 1.0 + 0x1p-12), 1.0));
}

static void test_narrow_rounding_edge_cases(void **state)
{
    (void)state;
    /* f16 rounds once: through f32, 1 + 2^-11 + 2^-40 becomes the tie 1 + 2^-11, then 1. */
    double twice = 1.0 + 0x1p-11 + 0x1p-40;
    assert_true(kvpt_same_bits((double)(float)twice, 1.0 + 0x1p-11));
    assert_true(kvpt_same_bits(f16((double)(float)twice), 1.0));
    assert_true(kvpt_same_bits(f16(twice), 1.0 + 0x1p-10));
    assert_true(kvpt_same_bits(f16(1.0 + 0x1p-11), 1.0));
    assert_true(kvpt_same_bits(f16(1.0 + 0x3p-11), 1.0 + 0x1p-9));
    assert_true(kvpt_same_bits(f16(0x1.ffcp0 + 0x1p-11), 2.0)); /* a tie, a carry into the exponent */
    /* Subnormals: to the nearest multiple of 2^-24, ties to even, up into the normals. */
    assert_true(kvpt_same_bits(f16(0x1p-25), 0.0));
    assert_true(kvpt_same_bits(f16(0x1.8p-25), 0x1p-24));
    assert_true(kvpt_same_bits(f16(0x3p-25), 0x1p-23));
    assert_true(kvpt_same_bits(f16(0x1.ff8p-15 + 0x1p-25), 0x1p-14));
    assert_true(kvpt_same_bits(f16(-0x1p-30), -0.0));
    assert_true(kvpt_same_bits(f16(-0.0), -0.0));
    /* e4m3: ties, carries, subnormals (quantum 2^-9), signs. */
    assert_true(kvpt_same_bits(e4m3(1.0 + 0x1p-4, 1.0), 1.0));
    assert_true(kvpt_same_bits(e4m3(1.0 + 0x3p-4, 1.0), 1.25));
    assert_true(kvpt_same_bits(e4m3(1.9375, 1.0), 2.0));
    assert_true(kvpt_same_bits(e4m3(0x1p-10, 1.0), 0.0));
    assert_true(kvpt_same_bits(e4m3(0x3p-10, 1.0), 0x1p-8));
    assert_true(kvpt_same_bits(e4m3(-0x1p-12, 1.0), -0.0));
    assert_true(kvpt_same_bits(e4m3(0x1.ep-7 + 0x1p-11, 1.0), 0x1p-6));
    /* Two roundings: the quotient's, then e4m3's. 0.1 / 0.1 is exactly 1. */
    assert_true(kvpt_same_bits(e4m3(0.1, 0.1), 1.0));
    assert_true(kvpt_same_bits(e4m3(3.0 * 1.125, 3.0), 1.125));
    assert_true(kvpt_same_bits(e4m3(-7.0, 0.5), -14.0));
}

static void test_narrow_rounding_matches_definition(void **state)
{
    (void)state;
    uint64_t seed = 8675309;
    size_t ties = 0;
    for (size_t i = 0; i < 200000; i++) {
        double m = 1.0 + kvpt_rand_unit(&seed) * 0.5 + 0.5;
        int e = (int)(kvpt_rand_next(&seed) % 50) - 34; /* 2^-34 .. 2^15, past both ranges */
        double x = ldexp(m, e);
        if (i % 5 == 0) {
            /* An exact tie of f16 (42 dropped bits) or e4m3 (49). */
            uint64_t bits = kvpi_f64_bits(x);
            int shift = i % 2 ? 41 : 48;
            bits = (bits & ~(((uint64_t)1 << (shift + 1)) - 1)) | ((uint64_t)1 << shift);
            x = kvpi_f64_from_bits(bits);
            ties++;
        }
        if (i % 2) {
            x = -x;
        }
        if (!kvpi_dtype_overflows(KVP_F16, x)) {
            double want = kvpt_round_to_format(x, 11, -14);
            if (!kvpt_same_bits(f16(x), want)) {
                print_error("f16(%a) = %a, expected %a\n", x, f16(x), want);
                fail();
            }
        }
        /* A random scale (not a power of two): e = round(fl(x / scale)). */
        double scale = ldexp(1.0 + 0.5 * (kvpt_rand_unit(&seed) + 1.0), (int)(i % 9) - 4);
        double q = x / scale;
        if (!kvpi_dtype_overflows_scaled(KVP_FP8_E4M3, scale, x)) {
            double want = kvpt_round_to_format(q, 4, -6);
            if (!kvpt_same_bits(e4m3(x, scale), want)) {
                print_error("e4m3(%a / %a) = %a, expected %a\n", x, scale, e4m3(x, scale), want);
                fail();
            }
        } else {
            assert_true(fabs(q) > 464.0);
        }
        if (!kvpi_dtype_overflows(KVP_FP8_E4M3, x)) {
            assert_true(kvpt_same_bits(e4m3(x, 1.0), kvpt_round_to_format(x, 4, -6)));
        }
    }
    assert_true(ties > 20000);
}

/*
 * The error bound of one stored element (docs/DESIGN.md): relative 2^-11
 * (f16) and 2^-4 (e4m3, of x / scale) in the normal ranges, absolute half a
 * subnormal quantum below them (2^-25, 2^-10); the measured maxima reach
 * the bounds (they are tight).
 */
static void test_narrow_element_error_bounds(void **state)
{
    (void)state;
    uint64_t seed = 31337;
    double worst_rel[2] = {0.0, 0.0};
    double worst_abs[2] = {0.0, 0.0};
    for (size_t i = 0; i < 400000; i++) {
        double m = 1.0 + (kvpt_rand_unit(&seed) + 1.0) * 0.5;
        double x = ldexp(m, (int)(kvpt_rand_next(&seed) % 46) - 30) * (i % 2 ? -1.0 : 1.0);
        if (!kvpi_dtype_overflows(KVP_F16, x)) {
            double err = fabs(f16(x) - x);
            if (fabs(x) >= 0x1p-14) {
                worst_rel[0] = fmax(worst_rel[0], err / fabs(x));
            } else {
                worst_abs[0] = fmax(worst_abs[0], err);
            }
        }
        double q = x / 3.0; /* the element rounds the computed quotient */
        if (!kvpi_dtype_overflows_scaled(KVP_FP8_E4M3, 3.0, x)) {
            double err = fabs(e4m3(x, 3.0) - q);
            if (fabs(q) >= 0x1p-6) {
                worst_rel[1] = fmax(worst_rel[1], err / fabs(q));
            } else {
                worst_abs[1] = fmax(worst_abs[1], err);
            }
        }
    }
    printf("# one element: f16 relative %.4e (bound 2^-11 = %.4e), absolute %.4e (2^-25); "
           "e4m3 relative %.4e (bound 2^-4), absolute %.4e (2^-10)\n",
           worst_rel[0], 0x1p-11, worst_abs[0], worst_rel[1], worst_abs[1]);
    assert_true(worst_rel[0] <= 0x1p-11 && worst_rel[0] > 0.99 * 0x1p-11);
    assert_true(worst_abs[0] <= 0x1p-25 && worst_abs[0] > 0.99 * 0x1p-25);
    assert_true(worst_rel[1] <= 0x1p-4 && worst_rel[1] > 0.9 * 0x1p-4);
    assert_true(worst_abs[1] <= 0x1p-10 && worst_abs[1] > 0.99 * 0x1p-10);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_narrow_names_sizes_and_codes),
        cmocka_unit_test(test_narrow_every_f16_round_trips),
        cmocka_unit_test(test_narrow_every_e4m3_round_trips),
        cmocka_unit_test(test_narrow_midpoints_tie_to_even),
        cmocka_unit_test(test_narrow_rounding_edge_cases),
        cmocka_unit_test(test_narrow_rounding_matches_definition),
        cmocka_unit_test(test_narrow_element_error_bounds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
