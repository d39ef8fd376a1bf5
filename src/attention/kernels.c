/*
 * kernels.c: shared attention arithmetic (see kernels.h).
 */
#include "attention/kernels.h"

#include <math.h>
#include <string.h>

void kvpi_project_row(const double *x, const double *w, size_t width, double *y)
{
    memset(y, 0, width * sizeof *y);
    for (size_t i = 0; i < width; i++) {
        kvpi_axpy(y, x[i], w + i * width, width);
    }
}

void kvpi_softmax(double *s, size_t n)
{
    double max = s[0];
    for (size_t i = 1; i < n; i++) {
        if (s[i] > max) {
            max = s[i];
        }
    }
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) {
        s[i] = exp(s[i] - max);
        sum += s[i];
    }
    for (size_t i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

void kvpi_rope_apply(const kvp_rope_config *rope, double *features, size_t position)
{
    double width = (double)rope->feature_width;
    for (size_t i = 0; i < rope->feature_width / 2; i++) {
        double theta = pow(rope->base, -(double)(2 * i) / width);
        double angle = (double)position * theta;
        double c = cos(angle);
        double s = sin(angle);
        double x0 = features[2 * i];
        double x1 = features[2 * i + 1];
        features[2 * i] = x0 * c - x1 * s;
        features[2 * i + 1] = x0 * s + x1 * c;
    }
}
