/*
 * kernels.h: the arithmetic shared by the incremental path and the
 * full-prefix reference, so both perform the same operations in the same
 * order and agree to the last bit wherever their inputs agree.
 *
 * Owns: projections, dot products, the stable softmax, and RoPE rotation
 * without checks. Pure functions; callers validate sizes.
 * Callers: src/attention only.
 */
#ifndef KVPAGER_ATTENTION_KERNELS_H
#define KVPAGER_ATTENTION_KERNELS_H

#include <stddef.h>

#include "kvpager/types.h"

/* y[0..width) = x[0..width) W, W row-major width x width; summed over i in order. */
void kvpi_project_row(const double *x, const double *w, size_t width, double *y);

/* Sum of a[f] * b[f] for f in order. */
static inline double kvpi_dot(const double *a, const double *b, size_t n)
{
    double sum = 0.0;
    for (size_t f = 0; f < n; f++) {
        sum += a[f] * b[f];
    }
    return sum;
}

/* acc[f] += weight * v[f]. */
static inline void kvpi_axpy(double *acc, double weight, const double *v, size_t n)
{
    for (size_t f = 0; f < n; f++) {
        acc[f] += weight * v[f];
    }
}

/* In place: s[i] = exp(s[i] - max) / sum. Requires finite input, n >= 1. */
void kvpi_softmax(double *s, size_t n);

/* Rotates rope->feature_width features for `position`; the caller checked the range. */
void kvpi_rope_apply(const kvp_rope_config *rope, double *features, size_t position);

#endif /* KVPAGER_ATTENTION_KERNELS_H */
