/*
 * kernels.c: shared attention arithmetic that is not dispatched by ISA (see
 * kernels.h): projections (through the dispatched axpy), softmax (through
 * the dispatched exp), RoPE (direct, from thetas, or from a layer's table).
 */
#include "attention/kernels.h"

#include <math.h>
#include <string.h>

void kvpi_project_row(const double *x, const double *w, size_t width, double *y)
{
    memset(y, 0, width * sizeof *y);
    kvpi_kernels_active()->axpy_rows(y, x, w, width, width, width);
}

void kvpi_project_rect(const double *x, const double *w, size_t rows, size_t cols, double *y)
{
    memset(y, 0, cols * sizeof *y);
    kvpi_kernels_active()->axpy_rows(y, x, w, cols, rows, cols);
}

void kvpi_softmax(double *s, size_t n)
{
    double max = s[0];
    for (size_t i = 1; i < n; i++) {
        if (s[i] > max) {
            max = s[i];
        }
    }
    double sum = kvpi_kernels_active()->exp_sum(s, n, max);
    for (size_t i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

/* Pair i of `count` vectors `stride` apart rotated by c, s. */
static inline void rotate_pair(double *rows, size_t stride, size_t count, size_t i, double c,
                               double s)
{
    for (size_t r = 0; r < count; r++) {
        double *pair = rows + r * stride + 2 * i;
        double x0 = pair[0];
        double x1 = pair[1];
        pair[0] = x0 * c - x1 * s;
        pair[1] = x0 * s + x1 * c;
    }
}

void kvpi_rope_apply_rows(const kvp_rope_config *rope, double *rows, size_t stride, size_t count,
                          size_t position)
{
    for (size_t i = 0; i < rope->feature_width / 2; i++) {
        double theta = kvpi_rope_theta(rope->base, rope->feature_width, i);
        double angle = (double)position * theta;
        rotate_pair(rows, stride, count, i, cos(angle), sin(angle));
    }
}

void kvpi_rope_apply_thetas(const double *theta, size_t half, double *a, double *b,
                            size_t stride, size_t count, size_t position)
{
    for (size_t i = 0; i < half; i++) {
        double angle = (double)position * theta[i];
        double c = cos(angle);
        double s = sin(angle);
        rotate_pair(a, stride, count, i, c, s);
        if (b != NULL) {
            rotate_pair(b, stride, count, i, c, s);
        }
    }
}

void kvpi_rope_apply_table(const double *cos_sin, size_t half, double *rows, size_t stride,
                           size_t count)
{
    for (size_t r = 0; r < count; r++) {
        double *v = rows + r * stride;
        for (size_t i = 0; i < half; i++) {
            double c = cos_sin[2 * i];
            double s = cos_sin[2 * i + 1];
            double x0 = v[2 * i];
            double x1 = v[2 * i + 1];
            v[2 * i] = x0 * c - x1 * s;
            v[2 * i + 1] = x0 * s + x1 * c;
        }
    }
}

void kvpi_rope_fill_table(const double *theta, size_t half, size_t positions, double *table)
{
    for (size_t p = 0; p < positions; p++) {
        for (size_t i = 0; i < half; i++) {
            double angle = (double)p * theta[i];
            table[(p * half + i) * 2] = cos(angle);
            table[(p * half + i) * 2 + 1] = sin(angle);
        }
    }
}
