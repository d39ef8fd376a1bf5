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

/*
 * kvpi_project_rows's blocking. Every choice below changes only which tile
 * computes an output and when, never the order of its adds, so none of them
 * can change a bit.
 *   STREAM_K  rows of W per pass when W is read in place: a pass walks all
 *             columns, W row-major (one stream per row of W, as a prefetcher
 *             likes), the outputs' partial sums in y.
 *   KC, MC    when packing: slivers of KC rows of W, shared by the tiles of
 *             MC input rows; a sliver (KC x 32 doubles, 16 KiB) stays in L1,
 *             the partial sums of MC x 32 outputs in L1/L2.
 *   PACK_ROWS packing starts at this many input rows: below it a sliver
 *             would serve too few tiles to repay its copy.
 */
#define STREAM_K 16
#define PROJECT_KC 64
#define PROJECT_MC 64
#define PACK_ROWS 16

static size_t min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* W read in place: passes of STREAM_K rows of W over every column and row tile. */
static void project_stream(const kvpi_kernels *k, const double *x, size_t x_stride,
                           size_t rows, const double *w, size_t width, size_t cols, double *y,
                           size_t y_stride)
{
    for (size_t p = 0; p < width; p += STREAM_K) {
        size_t kk = min_size(STREAM_K, width - p);
        for (size_t j = 0; j < cols; j += k->project_nr) {
            size_t n = min_size(k->project_nr, cols - j);
            for (size_t r = 0; r < rows; r += k->project_mr) {
                k->project_tile(x + r * x_stride + p, x_stride, min_size(k->project_mr, rows - r),
                                w + p * cols + j, cols, kk, n, y + r * y_stride + j, y_stride,
                                p == 0);
            }
        }
    }
}

/* W packed: per block of MC rows, per column sliver, per KC rows of W. */
static void project_packed(const kvpi_kernels *k, const double *x, size_t x_stride,
                           size_t rows, const double *w, size_t width, size_t cols, double *y,
                           size_t y_stride)
{
    double pack[PROJECT_KC * KVPI_PROJECT_MAX_NR];
    size_t nr = k->project_nr;
    for (size_t ic = 0; ic < rows; ic += PROJECT_MC) {
        size_t mc = min_size(PROJECT_MC, rows - ic);
        for (size_t j = 0; j < cols; j += nr) {
            size_t n = min_size(nr, cols - j);
            for (size_t p = 0; p < width; p += PROJECT_KC) {
                size_t kk = min_size(PROJECT_KC, width - p);
                for (size_t i = 0; i < kk; i++) {
                    memcpy(pack + i * nr, w + (p + i) * cols + j, n * sizeof *pack);
                }
                for (size_t r = 0; r < mc; r += k->project_mr) {
                    size_t row = ic + r;
                    k->project_tile(x + row * x_stride + p, x_stride,
                                    min_size(k->project_mr, mc - r), pack, nr, kk, n,
                                    y + row * y_stride + j, y_stride, p == 0);
                }
            }
        }
    }
}

void kvpi_project_rows(const double *x, size_t x_stride, size_t rows, const double *w,
                       size_t width, size_t cols, double *y, size_t y_stride)
{
    if (width == 0) {
        for (size_t r = 0; r < rows; r++) {
            memset(y + r * y_stride, 0, cols * sizeof *y);
        }
        return;
    }
    const kvpi_kernels *k = kvpi_kernels_active();
    if (rows == 1) {
        kvpi_project_rect(x, w, width, cols, y); /* the same sums; axpy_rows is tuned for it */
    } else if (rows < PACK_ROWS) {
        project_stream(k, x, x_stride, rows, w, width, cols, y, y_stride);
    } else {
        project_packed(k, x, x_stride, rows, w, width, cols, y, y_stride);
    }
}

void kvpi_softmax(double *s, size_t n)
{
    kvpi_kernels_active()->softmax(s, n);
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
