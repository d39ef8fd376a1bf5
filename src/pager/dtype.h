/*
 * dtype.h: conversions between f64 and the pages' storage types (kvp_dtype,
 * kvpager/pool.h).
 *
 * Owns: the one rounding rule of each type and its overflow boundary, so the
 * append (cache.c), the candidate row of a prepare (incremental.c) and the
 * stored-dtype reference (reference.c) round identically.
 *
 * Rules:
 *   - f64 -> f32: the C conversion, round to nearest, ties to even (the FPU's
 *     default mode; kvpager never changes it). Only called on values below
 *     the overflow boundary, so the conversion is always defined.
 *   - f64 -> bf16: rounded once, directly from the f64 bits (normal range:
 *     keep 7 fraction bits, ties to even, a carry may raise the exponent;
 *     below 2^-126: to the nearest multiple of 2^-133, bf16's subnormal
 *     quantum), never through f32, which would round twice.
 *   - widening f32 or bf16 to f64 is exact.
 *   - a finite f64 overflows a type when it rounds to infinity there:
 *     |x| >= 0x1.ffffffp+127 (f32), |x| >= 0x1.ffp+127 (bf16): the midpoints
 *     between the largest finite value and 2^128, where ties go to the even
 *     neighbour, 2^128, that is infinity.
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

#define KVPI_F32_OVERFLOW 0x1.ffffffp+127
#define KVPI_BF16_OVERFLOW 0x1.ffp+127

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

/* 1 when the finite x would round to infinity in `dtype`; never for f64. */
static inline int kvpi_dtype_overflows(kvp_dtype dtype, double x)
{
    double a = fabs(x);
    switch (dtype) {
    case KVP_F32:
        return isfinite(x) && a >= KVPI_F32_OVERFLOW;
    case KVP_BF16:
        return isfinite(x) && a >= KVPI_BF16_OVERFLOW;
    default:
        return 0;
    }
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

/* x rounded to `dtype` and widened back: what a read of the stored x gives. */
static inline double kvpi_dtype_round(kvp_dtype dtype, double x)
{
    switch (dtype) {
    case KVP_F32:
        return (double)kvpi_f32_from_f64(x);
    case KVP_BF16:
        return kvpi_bf16_to_f64(kvpi_bf16_from_f64(x));
    default:
        return x;
    }
}

/* Rounds n values in place to `dtype` (a no-op for f64); none may overflow. */
static inline void kvpi_dtype_round_rows(kvp_dtype dtype, double *values, size_t n)
{
    if (dtype == KVP_F64) {
        return;
    }
    for (size_t i = 0; i < n; i++) {
        values[i] = kvpi_dtype_round(dtype, values[i]);
    }
}

/* Index of the first value of values[0..n) that overflows `dtype`, or n. */
static inline size_t kvpi_dtype_first_overflow(kvp_dtype dtype, const double *values, size_t n)
{
    if (dtype == KVP_F64) {
        return n;
    }
    for (size_t i = 0; i < n; i++) {
        if (kvpi_dtype_overflows(dtype, values[i])) {
            return i;
        }
    }
    return n;
}

/* Stores x[0..n) as `dtype` at dst (n elements of that type); none may overflow. */
static inline void kvpi_dtype_store(kvp_dtype dtype, void *dst, const double *x, size_t n)
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
    default:
        memcpy(dst, x, n * sizeof *x);
        return;
    }
}

/* Widens n stored elements of `dtype` at src into out[0..n). Exact. */
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
    default:
        memcpy(out, src, n * sizeof *out);
        return;
    }
}

#endif /* KVPAGER_PAGER_DTYPE_H */
