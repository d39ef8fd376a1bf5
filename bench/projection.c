/*
 * projection.c: batched projections, Y = X W for R rows of width D into D
 * columns, three (or four) ways on the same data, single thread:
 *   row    kvpi_project_row once per row (what every projection did before
 *          kvpi_project_rows);
 *   rows   kvpi_project_rows, all R rows at once (what the library does now);
 *   dgemm  OpenBLAS cblas_dgemm, f64 (not bit-identical: FMA and its own
 *          blocking; its largest difference is reported);
 *   sgemm  OpenBLAS cblas_sgemm on f32 copies of X and W, for scale.
 * OpenBLAS is optional: it is found by bench/CMakeLists.txt (pkg-config
 * openblas, else find_library), and without it the program runs the first
 * two columns and says so. OpenBLAS is set to one thread.
 *
 * Checks, before timing: rows equals row bit for bit on every shape (exit 1
 * otherwise). Reported: median ns per call over alternating repetitions
 * (src/cli/measure.h), mul-adds per ns, row/rows and rows/dgemm time ratios
 * (> 1: the right-hand one is faster), and max |gemm - rows| / max |rows|
 * per shape. Speed is reported, never enforced.
 * Usage: bench-projection [--quick] [--repetitions N] [--min-ns N] [--max-madds N]
 * (bench/args.h: --flag=value too; --help lists them with their defaults)
 *   --quick      rows {1, 8, 64}, D {64} (the test command's agreement run)
 *   --max-madds  skip shapes with more than N mul-adds per call (default 2^34)
 * Exit status 0, 1 when rows and row differ or memory runs out, 2 on a bad
 * flag or value (one line naming both).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "attention/kernels.h"
#include "measure.h"

#if defined(KVP_BENCH_OPENBLAS)
#include <cblas.h>
#endif

typedef struct shape_data {
    size_t rows;
    size_t d;
    const double *x;
    const double *w;
    double *y;
    const float *xf;
    const float *wf;
    float *yf;
} shape_data;

static void run_row(void *ctx, size_t iterations)
{
    shape_data *s = ctx;
    for (size_t it = 0; it < iterations; it++) {
        for (size_t r = 0; r < s->rows; r++) {
            kvpi_project_row(s->x + r * s->d, s->w, s->d, s->y + r * s->d);
        }
    }
}

static void run_rows(void *ctx, size_t iterations)
{
    shape_data *s = ctx;
    for (size_t it = 0; it < iterations; it++) {
        kvpi_project_rows(s->x, s->d, s->rows, s->w, s->d, s->d, s->y, s->d);
    }
}

#if defined(KVP_BENCH_OPENBLAS)
static void run_dgemm(void *ctx, size_t iterations)
{
    shape_data *s = ctx;
    int n = (int)s->d;
    for (size_t it = 0; it < iterations; it++) {
        cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)s->rows, n, n, 1.0, s->x, n,
                    s->w, n, 0.0, s->y, n);
    }
}

static void run_sgemm(void *ctx, size_t iterations)
{
    shape_data *s = ctx;
    int n = (int)s->d;
    for (size_t it = 0; it < iterations; it++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)s->rows, n, n, 1.0f, s->xf,
                    n, s->wf, n, 0.0f, s->yf, n);
    }
}

/* max |got - exact| / max |exact| over n outputs (gemm against our rows). */
static double normwise_difference(const double *got, const double *exact, size_t n)
{
    double diff = 0.0;
    double scale = 0.0;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs(got[i] - exact[i]));
        scale = fmax(scale, fabs(exact[i]));
    }
    return scale > 0.0 ? diff / scale : diff;
}
#endif

int main(int argc, char **argv)
{
    size_t repetitions = 5;
    size_t min_ns = 20000000;
    size_t max_madds = (size_t)1 << 34;
    int quick = 0;
    bench_arg table[] = {
        BENCH_SWITCH("--quick", &quick, "rows {1, 8, 64}, D {64} only (the test command's run)"),
        BENCH_SIZE("--repetitions", &repetitions, 1, 1000000, "N", "alternating repetitions"),
        BENCH_SIZE("--min-ns", &min_ns, 0, 1000000000000, "NS",
                   "each sample's minimum duration"),
        BENCH_SIZE("--max-madds", &max_madds, 0, (size_t)1 << 62, "N",
                   "skip shapes with more mul-adds per call"),
    };
    bench_args args = BENCH_ARGS("bench-projection",
                                 "Times Y = X W for R rows of width D: one row at a time, "
                                 "kvpi_project_rows,\nand OpenBLAS dgemm/sgemm when built with "
                                 "it, on one thread.",
                                 table);
    int parsed = bench_args_parse(&args, argc, argv);
    if (parsed != BENCH_ARGS_RUN) {
        return parsed;
    }
    static const size_t all_rows[] = {1, 8, 64, 512};
    static const size_t all_d[] = {64, 512, 4096};
    size_t n_rows = quick ? 3 : 4;
    size_t n_d = quick ? 1 : 3;
    int blas = 0;
#if defined(KVP_BENCH_OPENBLAS)
    blas = 1;
    openblas_set_num_threads(1);
    printf("# OpenBLAS %s, 1 thread\n", openblas_get_config());
#else
    printf("# OpenBLAS not found at build time: dgemm/sgemm columns left out\n");
#endif
    printf("# kernels: %s; each output summed over i in order, no FMA\n",
           kvpi_kernels_active()->name);
    printf("%5s %5s %12s %12s %12s %12s %8s %8s %8s %8s %9s %9s\n", "rows", "D", "row_ns",
           "rows_ns", "dgemm_ns", "sgemm_ns", "madd/ns", "row/rows", "rows/dg", "rows/sg",
           "dgemm_rel", "sgemm_rel");
    int failed = 0;
    uint64_t seed = 42;
    for (size_t a = 0; a < n_d; a++) {
        size_t d = all_d[a];
        size_t max_rows = all_rows[n_rows - 1];
        double *w = malloc(d * d * sizeof *w);
        double *x = malloc(max_rows * d * sizeof *x);
        double *y = malloc(max_rows * d * sizeof *y);
        double *expect = malloc(max_rows * d * sizeof *expect);
        float *wf = malloc(d * d * sizeof *wf);
        float *xf = malloc(max_rows * d * sizeof *xf);
        float *yf = malloc(max_rows * d * sizeof *yf);
        double *widened = malloc(max_rows * d * sizeof *widened);
        if (w == NULL || x == NULL || y == NULL || expect == NULL || wf == NULL || xf == NULL ||
            yf == NULL || widened == NULL) {
            fprintf(stderr, "bench-projection: out of memory at D=%zu\n", d);
            return 1;
        }
        for (size_t i = 0; i < d * d; i++) {
            w[i] = kvp_measure_unit(&seed) / sqrt((double)d);
            wf[i] = (float)w[i];
        }
        for (size_t i = 0; i < max_rows * d; i++) {
            x[i] = kvp_measure_unit(&seed);
            xf[i] = (float)x[i];
        }
        for (size_t b = 0; b < n_rows; b++) {
            size_t rows = all_rows[b];
            if (rows * d * d > max_madds) {
                printf("%5zu %5zu  skipped: %zu mul-adds per call > --max-madds\n", rows, d,
                       rows * d * d);
                continue;
            }
            shape_data s = {rows, d, x, w, y, xf, wf, yf};
            run_row(&s, 1);
            memcpy(expect, y, rows * d * sizeof *y);
            memset(y, 0xff, rows * d * sizeof *y);
            run_rows(&s, 1);
            if (memcmp(y, expect, rows * d * sizeof *y) != 0) {
                printf("%5zu %5zu  FAIL: kvpi_project_rows differs from kvpi_project_row\n", rows,
                       d);
                failed = 1;
                continue;
            }
            double dgemm_rel = NAN;
            double sgemm_rel = NAN;
            kvp_measure_case cases[4] = {{run_row, &s}, {run_rows, &s}};
            size_t count = 2;
#if defined(KVP_BENCH_OPENBLAS)
            run_dgemm(&s, 1);
            dgemm_rel = normwise_difference(y, expect, rows * d);
            run_sgemm(&s, 1);
            for (size_t i = 0; i < rows * d; i++) {
                widened[i] = (double)yf[i];
            }
            sgemm_rel = normwise_difference(widened, expect, rows * d);
            cases[2] = (kvp_measure_case){run_dgemm, &s};
            cases[3] = (kvp_measure_case){run_sgemm, &s};
            count = 4;
#endif
            double ns[4] = {NAN, NAN, NAN, NAN};
            if (kvp_measure_alternating(cases, count, repetitions, (double)min_ns, ns) != 0) {
                fprintf(stderr, "bench-projection: out of memory while timing\n");
                return 1;
            }
            double madds = (double)rows * (double)d * (double)d;
            printf("%5zu %5zu %12.0f %12.0f %12.0f %12.0f %8.2f %8.2f %8.2f %8.2f %9.1e %9.1e\n",
                   rows, d, ns[0], ns[1], ns[2], ns[3], madds / ns[1], ns[0] / ns[1],
                   ns[1] / ns[2], ns[1] / ns[3], dgemm_rel, sgemm_rel);
            fflush(stdout);
        }
        free(w);
        free(x);
        free(y);
        free(expect);
        free(wf);
        free(xf);
        free(yf);
        free(widened);
    }
    if (!blas) {
        printf("# build with libopenblas-dev installed to compare against dgemm/sgemm\n");
    }
    printf("%s\n", failed ? "FAIL: results differ" : "# rows == row bit for bit on every shape");
    return failed;
}
