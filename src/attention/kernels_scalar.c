/*
 * kernels_scalar.c: the portable C level of the dispatched kernels, built on
 * every architecture. It is the reference: every other level must give the
 * same bits (kernels.h states the summation order they all follow).
 * Written with eight named lane sums so the order is visible; the compiler
 * may vectorize it (that keeps every rounding) but may not reassociate.
 * Callers: through kvpi_kernels_active() / kvpi_kernels_level() only.
 */
#include "attention/kernels.h"

static double scalar_dot(const double *a, const double *b, size_t n)
{
    double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        for (size_t l = 0; l < 8; l++) {
            s[l] += a[f + l] * b[f + l];
        }
    }
    return kvpi_dot_finish(s, a, b, f, n);
}

static void scalar_dot_rows(const double *q, const double *rows, size_t stride, size_t count,
                            size_t n, double scale, double *out)
{
    for (size_t r = 0; r < count; r++) {
        out[r] = scalar_dot(q, rows + r * stride, n) * scale;
    }
}

static void scalar_axpy(double *acc, double weight, const double *v, size_t n)
{
    for (size_t f = 0; f < n; f++) {
        acc[f] += weight * v[f];
    }
}

static void scalar_axpy_rows(double *acc, const double *weights, const double *rows,
                             size_t stride, size_t count, size_t n)
{
    for (size_t r = 0; r < count; r++) {
        scalar_axpy(acc, weights[r], rows + r * stride, n);
    }
}

static void scalar_exps(const double *x, double *y, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        y[i] = kvpi_exp(x[i]);
    }
}

static double scalar_exp_sum(double *s, size_t n, double shift)
{
    double lanes[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        for (size_t l = 0; l < 8; l++) {
            s[f + l] = kvpi_exp(s[f + l] - shift);
            lanes[l] += s[f + l];
        }
    }
    double sum = kvpi_sum_tree(lanes);
    for (; f < n; f++) {
        s[f] = kvpi_exp(s[f] - shift);
        sum += s[f];
    }
    return sum;
}

const kvpi_kernels kvpi_kernels_scalar = {
    KVPI_ISA_SCALAR, "scalar",       scalar_dot,     scalar_dot_rows, scalar_axpy,
    scalar_axpy_rows, scalar_exps, scalar_exp_sum,
};
