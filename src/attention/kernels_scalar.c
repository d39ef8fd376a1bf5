/*
 * kernels_scalar.c: the portable C level of the dispatched kernels, built on
 * every architecture. It is the reference: every other level must give the
 * same bits (kernels.h states the summation order they all follow).
 * Written with eight named lane sums so the order is visible; the compiler
 * may vectorize it (that keeps every rounding) but may not reassociate.
 * Callers: through kvpi_kernels_active() / kvpi_kernels_level() only.
 */
#include <math.h>

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

/*
 * Rows stored as f32 or bf16: element i of `rows`, widened (exact). Every
 * narrow kernel below is its f64 twin above with b[f] replaced by this, so it
 * performs the same f64 operations in the same order on the widened values.
 */
typedef enum row_kind { ROWS_F32, ROWS_BF16 } row_kind;

static inline double widen(const void *rows, size_t i, row_kind kind)
{
    return kind == ROWS_F32 ? (double)((const float *)rows)[i]
                            : kvpi_bf16_widen(((const uint16_t *)rows)[i]);
}

static inline __attribute__((always_inline)) double narrow_dot(const double *a, const void *rows,
                                                               size_t at, size_t n,
                                                               row_kind kind)
{
    double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        for (size_t l = 0; l < 8; l++) {
            s[l] += a[f + l] * widen(rows, at + f + l, kind);
        }
    }
    double sum = kvpi_sum_tree(s);
    for (; f < n; f++) {
        sum += a[f] * widen(rows, at + f, kind);
    }
    return sum;
}

static inline __attribute__((always_inline)) void
narrow_dot_rows(const double *q, const void *rows, size_t stride, size_t count, size_t n,
                double scale, double *out, row_kind kind)
{
    for (size_t r = 0; r < count; r++) {
        out[r] = narrow_dot(q, rows, r * stride, n, kind) * scale;
    }
}

static inline __attribute__((always_inline)) void
narrow_axpy_rows(double *acc, const double *weights, const void *rows, size_t stride,
                 size_t count, size_t n, row_kind kind)
{
    for (size_t r = 0; r < count; r++) {
        for (size_t f = 0; f < n; f++) {
            acc[f] += weights[r] * widen(rows, r * stride + f, kind);
        }
    }
}

static void scalar_dot_rows_f32(const double *q, const float *rows, size_t stride, size_t count,
                                size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_F32);
}

static void scalar_dot_rows_bf16(const double *q, const uint16_t *rows, size_t stride,
                                 size_t count, size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_BF16);
}

static void scalar_axpy_rows_f32(double *acc, const double *weights, const float *rows,
                                 size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_F32);
}

static void scalar_axpy_rows_bf16(double *acc, const double *weights, const uint16_t *rows,
                                  size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_BF16);
}

/*
 * kvpi_project_rows's tile: 4 rows x 8 columns of sums, i outermost, each
 * sum its own variable (the compiler may keep them in vector registers).
 */
#define SCALAR_MR 4
#define SCALAR_NR 8

static void scalar_project_tile(const double *x, size_t x_stride, size_t mr, const double *w,
                                size_t w_stride, size_t k, size_t n, double *y, size_t y_stride,
                                int first)
{
    double acc[SCALAR_MR][SCALAR_NR];
    for (size_t r = 0; r < mr; r++) {
        for (size_t j = 0; j < n; j++) {
            acc[r][j] = first ? 0.0 : y[r * y_stride + j];
        }
    }
    for (size_t i = 0; i < k; i++) {
        const double *wi = w + i * w_stride;
        for (size_t r = 0; r < mr; r++) {
            double xi = x[r * x_stride + i];
            for (size_t j = 0; j < n; j++) {
                acc[r][j] = acc[r][j] + xi * wi[j];
            }
        }
    }
    for (size_t r = 0; r < mr; r++) {
        for (size_t j = 0; j < n; j++) {
            y[r * y_stride + j] = acc[r][j];
        }
    }
}


/*
 * Grouped kernels: the plain definitions (kernels.h), one head after
 * another; the vector levels read each row once for all heads and must give
 * these bits.
 */
static void scalar_dot_group(kvpi_rows kind, const double *q, size_t g, const void *rows,
                             size_t stride, size_t count, size_t n, double scale, double *out,
                             size_t out_stride, const void *ahead)
{
    (void)ahead; /* a prefetch hint: the portable level has none */
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            double s[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
            size_t f = 0;
            for (; f + 8 <= n; f += 8) {
                for (size_t l = 0; l < 8; l++) {
                    s[l] += q[h * n + f + l] * kvpi_rows_widen(kind, rows, r * stride + f + l);
                }
            }
            double sum = kvpi_sum_tree(s);
            for (; f < n; f++) {
                sum += q[h * n + f] * kvpi_rows_widen(kind, rows, r * stride + f);
            }
            out[h * out_stride + r] = sum * scale;
        }
    }
}

static void scalar_axpy_group(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                              size_t w_stride, size_t g, const void *rows, size_t stride,
                              size_t count, size_t n, const void *ahead)
{
    (void)ahead;
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            for (size_t f = 0; f < n; f++) {
                acc[h * acc_stride + f] += w[h * w_stride + r] *
                                           kvpi_rows_widen(kind, rows, r * stride + f);
            }
        }
    }
}

/* The fast level's reference: kvpi_fast_dot and fmaf (libm's, correctly rounded). */
static void scalar_dot_group_fast(kvpi_rows kind, const float *q, size_t g, const void *rows,
                                  size_t stride, size_t count, size_t n, float *out,
                                  size_t out_stride, const void *ahead)
{
    (void)ahead; /* a prefetch hint: the portable level has none */
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            out[h * out_stride + r] = kvpi_fast_dot(q + h * n, kind, rows, r * stride, n);
        }
    }
}

static void scalar_axpy_group_fast(kvpi_rows kind, float *acc, size_t acc_stride,
                                   const float *w, size_t w_stride, size_t g, const void *rows,
                                   size_t stride, size_t count, size_t n, const void *ahead)
{
    (void)ahead;
    for (size_t h = 0; h < g; h++) {
        for (size_t r = 0; r < count; r++) {
            for (size_t f = 0; f < n; f++) {
                float *a = acc + h * acc_stride + f;
                *a = fmaf(w[h * w_stride + r], kvpi_rows_widen_f32(kind, rows, r * stride + f),
                          *a);
            }
        }
    }
}

/* The stable softmax: a serial maximum, exp_sum, then each element divided. */
static void scalar_softmax(double *s, size_t n)
{
    double max = s[0];
    for (size_t i = 1; i < n; i++) {
        if (s[i] > max) {
            max = s[i];
        }
    }
    double sum = scalar_exp_sum(s, n, max);
    for (size_t i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

const kvpi_kernels kvpi_kernels_scalar = {
    KVPI_ISA_SCALAR, "scalar",       scalar_dot,     scalar_dot_rows, scalar_axpy,
    scalar_axpy_rows, scalar_exps, scalar_exp_sum, scalar_dot_rows_f32, scalar_dot_rows_bf16,
    scalar_axpy_rows_f32, scalar_axpy_rows_bf16, scalar_project_tile, SCALAR_MR, SCALAR_NR,
    scalar_dot_group, scalar_axpy_group, scalar_dot_group_fast, scalar_axpy_group_fast,
    scalar_softmax, kvpi_softmax_fast_ref,
};
