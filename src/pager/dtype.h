/*
 * dtype.h: conversions between f64 and the pages' storage types (kvp_dtype,
 * kvpager/pool.h).
 *
 * Owns: the one rounding rule of each type and its overflow boundary, so the
 * append (cache.c), the candidate row of a prepare (incremental.c), a
 * prefill's rows (prefill.c) and the stored-dtype reference (reference.c)
 * round identically.
 *
 * Rules:
 *   - f64 -> f32: the C conversion, round to nearest, ties to even (the FPU's
 *     default mode; kvpager never changes it). Only called on values below
 *     the overflow boundary, so the conversion is always defined.
 *   - f64 -> bf16: rounded once, directly from the f64 bits (normal range:
 *     keep 7 fraction bits, ties to even, a carry may raise the exponent;
 *     below 2^-126: to the nearest multiple of 2^-133, bf16's subnormal
 *     quantum), never through f32, which would round twice.
 *   - f64 -> f16 (IEEE binary16): rounded once, directly from the f64 bits
 *     (normal range, |x| >= 2^-14: keep 10 fraction bits, ties to even, a
 *     carry may raise the exponent; below: to the nearest multiple of
 *     2^-24, f16's subnormal quantum), never through f32.
 *   - f64 -> fp8 e4m3 (OCP "e4m3fn": 1 sign, 4 exponent bits of bias 7, 3
 *     fraction bits, no infinities, 0x7f and 0xff are NaN, largest finite
 *     448, subnormal quantum 2^-9): an element x is stored as
 *     e = round(x / scale), the scale being the cache's K or V scale
 *     (kvp_binding.k_scale / v_scale). The quotient is computed in f64 (one
 *     rounding, exact when the scale is a power of two), then rounded once
 *     to e4m3 from its f64 bits (normal range, |q| >= 2^-6: keep 3 fraction
 *     bits, ties to even; below: the nearest multiple of 2^-9). So two
 *     roundings in all: the division's (relative 2^-53) and e4m3's. The
 *     element e is what a page holds and what a read widens (exactly); the
 *     value it stands for is e * scale, which only exports and attention's
 *     final multiplications form (kvpi_cache_kv_scales). The scale is
 *     ignored by every other type.
 *   - widening f32, bf16, f16 or e4m3 to f64 is exact.
 *   - a finite f64 overflows a type when it rounds past the largest finite
 *     value: |x| >= 0x1.ffffffp+127 (f32), |x| >= 0x1.ffp+127 (bf16),
 *     |x| >= 65520 (f16): the midpoints between the largest finite value
 *     and the next power of two, where ties go to the even neighbour, the
 *     power of two, that is infinity. For e4m3, |x / scale| > 464: 464 is
 *     the midpoint between 448 (fraction 110, even) and 480 (which would be
 *     fraction 111 at the top exponent, the NaN encoding), so a tie at 464
 *     rounds down to 448 and is stored, anything above is refused (nothing
 *     saturates; see DESIGN.md, Storage precision). An x / scale that
 *     overflows f64 is above 464 too.
 * Signs are kept: -0 stays -0, a negative value that rounds to zero gives -0.
 * Callers: src/pager, src/attention, tests.
 */
#ifndef KVPAGER_PAGER_DTYPE_H
#define KVPAGER_PAGER_DTYPE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvpager/pool.h"

/* The refusal text of a value that is not a kvp_dtype (pool creation, the stored reference). */
#define KVPI_DTYPE_VALUES "must be KVP_F64, KVP_F32, KVP_BF16, KVP_F16 or KVP_FP8_E4M3"

#define KVPI_F32_OVERFLOW 0x1.ffffffp+127
#define KVPI_BF16_OVERFLOW 0x1.ffp+127
#define KVPI_F16_OVERFLOW 65520.0
#define KVPI_F16_MAX 65504.0
/* e4m3: x / scale above this overflows (464 itself rounds to 448). */
#define KVPI_E4M3_OVERFLOW 464.0
#define KVPI_E4M3_MAX 448.0

static inline uint64_t kvpi_f64_bits(double x)
{
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static inline double kvpi_f64_from_bits(uint64_t bits)
{
    double x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/*
 * 1 when the finite x would round past the largest finite element of
 * `dtype` (to infinity, or for e4m3 to NaN), x / scale for e4m3 (scale is
 * ignored by the other types); never for f64.
 */
static inline int kvpi_dtype_overflows_scaled(kvp_dtype dtype, double scale, double x)
{
    double a = fabs(x);
    switch (dtype) {
    case KVP_F32:
        return isfinite(x) && a >= KVPI_F32_OVERFLOW;
    case KVP_BF16:
        return isfinite(x) && a >= KVPI_BF16_OVERFLOW;
    case KVP_F16:
        return isfinite(x) && a >= KVPI_F16_OVERFLOW;
    case KVP_FP8_E4M3:
        return isfinite(x) && fabs(x / scale) > KVPI_E4M3_OVERFLOW;
    default:
        return 0;
    }
}

/* kvpi_dtype_overflows_scaled with scale 1. */
static inline int kvpi_dtype_overflows(kvp_dtype dtype, double x)
{
    return kvpi_dtype_overflows_scaled(dtype, 1.0, x);
}

/* f64 -> f32, to nearest even. Infinite x stays infinite; x must not overflow (above). */
static inline float kvpi_f32_from_f64(double x)
{
    return (float)x;
}

/* f64 -> bf16 bits, to nearest even, once. Infinities map to bf16's; x must not overflow. */
static inline uint16_t kvpi_bf16_from_f64(double x)
{
    uint64_t sign = kvpi_f64_bits(x) >> 63;
    double a = fabs(x);
    float f;
    if (!isfinite(a)) {
        f = (float)a; /* infinity, or a NaN (never stored: appends refuse them) */
    } else if (a < 0x1p-126) {
        /* a + 1.5 * 2^-81 has ulp 2^-133, so the sum rounds a to bf16's subnormal grid. */
        f = (float)((a + 0x1.8p-81) - 0x1.8p-81);
    } else {
        uint64_t bits = kvpi_f64_bits(a);
        bits += (((uint64_t)1 << 44) - 1) + ((bits >> 45) & 1);
        bits &= ~(((uint64_t)1 << 45) - 1);
        f = (float)kvpi_f64_from_bits(bits); /* exact: 8 significant bits, in range */
    }
    uint32_t fbits;
    memcpy(&fbits, &f, sizeof fbits);
    return (uint16_t)((fbits >> 16) | (sign << 15));
}

/* bf16 bits -> f64, exact. */
static inline double kvpi_bf16_to_f64(uint16_t h)
{
    uint32_t fbits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &fbits, sizeof f);
    return (double)f;
}

/* f64 -> f16 bits, to nearest even, once. Infinities and NaN map to f16's; x must not overflow. */
static inline uint16_t kvpi_f16_from_f64(double x)
{
    uint16_t sign = (uint16_t)((kvpi_f64_bits(x) >> 63) << 15);
    double a = fabs(x);
    if (isnan(a)) {
        return (uint16_t)(sign | 0x7e00);
    }
    if (a >= KVPI_F16_OVERFLOW) {
        return (uint16_t)(sign | 0x7c00); /* infinity (never stored: appends refuse it) */
    }
    if (a < 0x1p-14) {
        /* a + 1.5 * 2^28 has ulp 2^-24, so the sum rounds a to f16's subnormal grid. */
        double r = (a + 0x1.8p+28) - 0x1.8p+28;
        return (uint16_t)(sign | (uint16_t)(r * 0x1p+24)); /* 1024 is 2^-14, the first normal */
    }
    uint64_t bits = kvpi_f64_bits(a);
    bits += (((uint64_t)1 << 41) - 1) + ((bits >> 42) & 1);
    int exponent = (int)(bits >> 52) - 1023; /* -14 .. 15: a < 65520 rounds to <= 65504 */
    uint16_t fraction = (uint16_t)((bits >> 42) & 0x3ff);
    return (uint16_t)(sign | (uint16_t)((exponent + 15) << 10) | fraction);
}

/* f16 bits -> f64, exact. */
static inline double kvpi_f16_to_f64(uint16_t h)
{
    uint64_t sign = (uint64_t)(h >> 15) << 63;
    unsigned exponent = (h >> 10) & 0x1f;
    uint64_t fraction = h & 0x3ff;
    if (exponent == 0) {
        double r = (double)fraction * 0x1p-24;
        return kvpi_f64_from_bits(kvpi_f64_bits(r) | sign);
    }
    if (exponent == 0x1f) {
        return kvpi_f64_from_bits(sign | ((uint64_t)0x7ff << 52) | (fraction << 42));
    }
    return kvpi_f64_from_bits(sign | ((uint64_t)(exponent - 15 + 1023) << 52) | (fraction << 42));
}

/*
 * q (already x / scale) -> e4m3 bits, to nearest even, once. NaN gives 0x7f
 * (with q's sign); q must not overflow (|q| <= 464).
 */
static inline uint8_t kvpi_e4m3_from_f64(double q)
{
    uint8_t sign = (uint8_t)((kvpi_f64_bits(q) >> 63) << 7);
    double a = fabs(q);
    if (!(a <= KVPI_E4M3_OVERFLOW)) {
        return (uint8_t)(sign | 0x7f); /* NaN, or an overflow (never stored: refused) */
    }
    if (a < 0x1p-6) {
        /* a + 1.5 * 2^43 has ulp 2^-9, so the sum rounds a to e4m3's subnormal grid. */
        double r = (a + 0x1.8p+43) - 0x1.8p+43;
        return (uint8_t)(sign | (uint8_t)(r * 0x1p+9)); /* 8 is 2^-6, the first normal */
    }
    uint64_t bits = kvpi_f64_bits(a);
    bits += (((uint64_t)1 << 48) - 1) + ((bits >> 49) & 1);
    int exponent = (int)(bits >> 52) - 1023; /* -6 .. 8: a <= 464 rounds to <= 448 */
    uint8_t fraction = (uint8_t)((bits >> 49) & 0x7);
    return (uint8_t)(sign | (uint8_t)((exponent + 7) << 3) | fraction);
}

/* e4m3 bits -> f64, exact (the element, not multiplied by any scale). */
static inline double kvpi_e4m3_to_f64(uint8_t b)
{
    uint64_t sign = (uint64_t)(b >> 7) << 63;
    unsigned exponent = (b >> 3) & 0xf;
    uint64_t fraction = b & 0x7;
    if (exponent == 0) {
        double r = (double)fraction * 0x1p-9;
        return kvpi_f64_from_bits(kvpi_f64_bits(r) | sign);
    }
    if (exponent == 0xf && fraction == 0x7) {
        return kvpi_f64_from_bits(sign | ((uint64_t)0x7ff << 52) | ((uint64_t)1 << 51)); /* NaN */
    }
    return kvpi_f64_from_bits(sign | ((uint64_t)(exponent - 7 + 1023) << 52) | (fraction << 49));
}

/*
 * x as `dtype` stores it, widened back: what a read of the stored element
 * gives. For e4m3 that is the element e = round(x / scale), not e * scale.
 */
static inline double kvpi_dtype_round_scaled(kvp_dtype dtype, double scale, double x)
{
    switch (dtype) {
    case KVP_F32:
        return (double)kvpi_f32_from_f64(x);
    case KVP_BF16:
        return kvpi_bf16_to_f64(kvpi_bf16_from_f64(x));
    case KVP_F16:
        return kvpi_f16_to_f64(kvpi_f16_from_f64(x));
    case KVP_FP8_E4M3:
        return kvpi_e4m3_to_f64(kvpi_e4m3_from_f64(x / scale));
    default:
        return x;
    }
}

/* x rounded to `dtype` and widened back, scale 1 (kvpi_dtype_round_scaled). */
static inline double kvpi_dtype_round(kvp_dtype dtype, double x)
{
    return kvpi_dtype_round_scaled(dtype, 1.0, x);
}

/*
 * Rounds n values in place to the elements `dtype` stores (a no-op for f64;
 * for e4m3 each becomes round(x / scale)); none may overflow.
 */
static inline void kvpi_dtype_round_rows_scaled(kvp_dtype dtype, double scale, double *values,
                                                size_t n)
{
    if (dtype == KVP_F64) {
        return;
    }
    for (size_t i = 0; i < n; i++) {
        values[i] = kvpi_dtype_round_scaled(dtype, scale, values[i]);
    }
}

/* kvpi_dtype_round_rows_scaled with scale 1. */
static inline void kvpi_dtype_round_rows(kvp_dtype dtype, double *values, size_t n)
{
    kvpi_dtype_round_rows_scaled(dtype, 1.0, values, n);
}

/* Index of the first value of values[0..n) that overflows `dtype` (at `scale`), or n. */
static inline size_t kvpi_dtype_first_overflow_scaled(kvp_dtype dtype, double scale,
                                                      const double *values, size_t n)
{
    if (dtype == KVP_F64) {
        return n;
    }
    for (size_t i = 0; i < n; i++) {
        if (kvpi_dtype_overflows_scaled(dtype, scale, values[i])) {
            return i;
        }
    }
    return n;
}

/* kvpi_dtype_first_overflow_scaled with scale 1. */
static inline size_t kvpi_dtype_first_overflow(kvp_dtype dtype, const double *values, size_t n)
{
    return kvpi_dtype_first_overflow_scaled(dtype, 1.0, values, n);
}

/*
 * Stores x[0..n) as `dtype` at dst (n elements of that type); none may
 * overflow. For e4m3 each x is divided by `scale` first (scale 1 stores
 * elements already rounded, exactly); the other types ignore it.
 */
static inline void kvpi_dtype_store_scaled(kvp_dtype dtype, double scale, void *dst,
                                           const double *x, size_t n)
{
    switch (dtype) {
    case KVP_F32: {
        float *out = dst;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_f32_from_f64(x[i]);
        }
        return;
    }
    case KVP_BF16: {
        uint16_t *out = dst;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_bf16_from_f64(x[i]);
        }
        return;
    }
    case KVP_F16: {
        uint16_t *out = dst;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_f16_from_f64(x[i]);
        }
        return;
    }
    case KVP_FP8_E4M3: {
        uint8_t *out = dst;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_e4m3_from_f64(x[i] / scale); /* exact when scale is 1 */
        }
        return;
    }
    default:
        memcpy(dst, x, n * sizeof *x);
        return;
    }
}

/* kvpi_dtype_store_scaled with scale 1. */
static inline void kvpi_dtype_store(kvp_dtype dtype, void *dst, const double *x, size_t n)
{
    kvpi_dtype_store_scaled(dtype, 1.0, dst, x, n);
}

/*
 * Widens n stored elements of `dtype` at src into out[0..n), exactly; for
 * e4m3 the element e itself (scale 1: kvpi_dtype_load_scaled multiplies).
 */
static inline void kvpi_dtype_load(kvp_dtype dtype, const void *src, double *out, size_t n)
{
    switch (dtype) {
    case KVP_F32: {
        const float *in = src;
        for (size_t i = 0; i < n; i++) {
            out[i] = (double)in[i];
        }
        return;
    }
    case KVP_BF16: {
        const uint16_t *in = src;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_bf16_to_f64(in[i]);
        }
        return;
    }
    case KVP_F16: {
        const uint16_t *in = src;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_f16_to_f64(in[i]);
        }
        return;
    }
    case KVP_FP8_E4M3: {
        const uint8_t *in = src;
        for (size_t i = 0; i < n; i++) {
            out[i] = kvpi_e4m3_to_f64(in[i]);
        }
        return;
    }
    default:
        memcpy(out, src, n * sizeof *out);
        return;
    }
}

/*
 * The values n stored elements stand for: kvpi_dtype_load, and for e4m3
 * each element times `scale` (one f64 multiplication, which rounds unless
 * the scale is a power of two or 1). The other types ignore the scale.
 */
static inline void kvpi_dtype_load_scaled(kvp_dtype dtype, double scale, const void *src,
                                          double *out, size_t n)
{
    kvpi_dtype_load(dtype, src, out, n);
    if (dtype == KVP_FP8_E4M3 && scale != 1.0) {
        for (size_t i = 0; i < n; i++) {
            out[i] *= scale;
        }
    }
}

#endif /* KVPAGER_PAGER_DTYPE_H */
