/*
 * kernels.c: shared attention arithmetic that is not dispatched by ISA (see
 * kernels.h): projections (through the dispatched axpy), softmax, RoPE.
 */
#include "attention/kernels.h"

#include <math.h>
#include <string.h>

void kvpi_project_row(const double *x, const double *w, size_t width, double *y)
{
    memset(y, 0, width * sizeof *y);
    kvpi_kernels_active()->axpy_rows(y, x, w, width, width, width);
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

void kvpi_rope_apply_rows(const kvp_rope_config *rope, double *rows, size_t stride, size_t count,
                          size_t position)
{
    double width = (double)rope->feature_width;
    for (size_t i = 0; i < rope->feature_width / 2; i++) {
        double theta = pow(rope->base, -(double)(2 * i) / width);
        double angle = (double)position * theta;
        double c = cos(angle);
        double s = sin(angle);
        for (size_t r = 0; r < count; r++) {
            double *pair = rows + r * stride + 2 * i;
            double x0 = pair[0];
            double x1 = pair[1];
            pair[0] = x0 * c - x1 * s;
            pair[1] = x0 * s + x1 * c;
        }
    }
}
