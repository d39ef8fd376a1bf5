/*
 * fuzz_paged_dtype.c: the typed sub-world's own ground truth for page dtypes
 * (fuzz_paged.h), written from pool.h's description and independent of
 * src/: rounding once from f64 to p significand bits above the dtype's
 * smallest normal exponent, ties to even (f32 24/-126, bf16 8/-126, f16
 * 11/-14, e4m3 4/-6; fp8 rounds x / scale and stands for e * scale); the
 * overflow thresholds pool.h documents; and encoders for source rows (f32,
 * bf16, f16 bits) and for elements written in place in the page format.
 * Called by fuzz_paged.c and fuzz_paged_attention.c.
 */
#include <math.h>
#include <string.h>

#include "fuzz_paged.h"

/* ---- the shadow's own dtypes -------------------------------------------- */

/* x rounded once to p significand bits, exponent at least emin, ties to even. */
static double round_bits(double x, int p, int emin)
{
    if (x == 0.0 || !isfinite(x)) {
        return x;
    }
    int e = ilogb(x);
    if (e < emin) {
        e = emin;
    }
    return ldexp(nearbyint(ldexp(x, p - 1 - e)), e - (p - 1));
}

/* The element a dtype stores for x (fp8: for x already divided by its scale). */
double pz_round(kvp_dtype dt, double x)
{
    switch (dt) {
    case KVP_F32:
        return round_bits(x, 24, -126);
    case KVP_BF16:
        return round_bits(x, 8, -126);
    case KVP_F16:
        return round_bits(x, 11, -14);
    case KVP_FP8_E4M3:
        return round_bits(x, 4, -6);
    default:
        return x;
    }
}

/* pool.h's overflow thresholds: 1 when the finite x cannot be stored. */
int pz_overflows(kvp_dtype dt, double scale, double x)
{
    double a = fabs(x);
    switch (dt) {
    case KVP_F32:
        return isfinite(x) && a >= 0x1.ffffffp+127;
    case KVP_BF16:
        return isfinite(x) && a >= 0x1.ffp+127;
    case KVP_F16:
        return isfinite(x) && a >= 65520.0;
    case KVP_FP8_E4M3:
        return isfinite(x) && a / scale > 464.0;
    default:
        return 0;
    }
}

/* What an export gives for x stored: the element, times the scale for fp8. */
double pz_store(kvp_dtype dt, double scale, double x)
{
    if (dt == KVP_FP8_E4M3) {
        return pz_round(dt, x / scale) * scale;
    }
    return pz_round(dt, x);
}

const char *pz_dtype_name(kvp_dtype dt)
{
    static const char *names[] = {"f64", "f32", "bf16", "f16", "fp8_e4m3"};
    return names[dt];
}

/* ---- encoders (value already on the type's grid, or special) ------------ */

static float enc_f32(double x)
{
    return fabs(x) >= 0x1.ffffffp+127 && isfinite(x) ? (float)copysign(INFINITY, x)
                                                      : (float)round_bits(x, 24, -126);
}

static uint16_t enc_bf16(double x)
{
    if (isnan(x)) {
        return 0x7fc0;
    }
    double r = fabs(x) >= 0x1.ffp+127 ? copysign(INFINITY, x) : round_bits(x, 8, -126);
    float f = (float)r;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static uint16_t enc_f16(double x)
{
    if (isnan(x)) {
        return 0x7e00;
    }
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x) >= 65520.0 ? INFINITY : fabs(round_bits(x, 11, -14));
    if (isinf(a)) {
        return sign | 0x7c00;
    }
    if (a >= 0x1p-14) {
        int e = ilogb(a);
        return sign | (uint16_t)((e + 15) << 10) | (uint16_t)(ldexp(a, 10 - e) - 1024.0);
    }
    return sign | (uint16_t)ldexp(a, 24);
}

/* e on the e4m3 grid, |e| <= 448, or NaN (0x7f). */
static uint8_t enc_e4m3(double e)
{
    if (isnan(e)) {
        return 0x7f;
    }
    uint8_t sign = signbit(e) ? 0x80 : 0;
    double a = fabs(e);
    if (a >= 0x1p-6) {
        int x = ilogb(a);
        return sign | (uint8_t)((x + 7) << 3) | (uint8_t)(ldexp(a, 3 - x) - 8.0);
    }
    return sign | (uint8_t)ldexp(a, 9);
}

/* Widened value of x given as a source row of src (f64, f32, bf16, f16). */
double pz_widened(kvp_dtype src, double x)
{
    switch (src) {
    case KVP_F32:
        return (double)enc_f32(x);
    case KVP_BF16: {
        uint32_t bits = (uint32_t)enc_bf16(x) << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return (double)f;
    }
    case KVP_F16:
        return isnan(x) ? NAN : fabs(x) >= 65520.0 ? copysign(INFINITY, x) : round_bits(x, 11, -14);
    default:
        return x;
    }
}

void pz_encode(kvp_dtype src, const double *x, size_t n, void *out)
{
    for (size_t i = 0; i < n; i++) {
        if (src == KVP_F32) {
            ((float *)out)[i] = enc_f32(x[i]);
        } else if (src == KVP_BF16) {
            ((uint16_t *)out)[i] = enc_bf16(x[i]);
        } else if (src == KVP_F16) {
            ((uint16_t *)out)[i] = enc_f16(x[i]);
        } else {
            ((double *)out)[i] = x[i];
        }
    }
}

/* One element in the page's format: x (finite, storable) or a NaN. */
void pz_page_write(kvp_dtype dt, double scale, unsigned char *at, double x, int nan)
{
    if (dt == KVP_F64) {
        double y = nan ? NAN : x;
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_F32) {
        float y = nan ? NAN : enc_f32(x);
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_BF16) {
        uint16_t y = enc_bf16(nan ? NAN : x);
        memcpy(at, &y, sizeof y);
    } else if (dt == KVP_F16) {
        uint16_t y = enc_f16(nan ? NAN : x);
        memcpy(at, &y, sizeof y);
    } else {
        *at = enc_e4m3(nan ? NAN : pz_round(dt, x / scale));
    }
}
