/*
 * kernels_group.h: the grouped kernels (kernels.h: dot_group, axpy_group and
 * their fast twins) written once over a level's vector primitives, and the
 * dispatched softmax. Included by kernels_avx2.c and kernels_avx512.c only,
 * after they define:
 *   VD              eight doubles, lane l holding dot-product lane l;
 *   vd_zero/loadu/set1/add/mul/storeu, vd_tree (kvpi_sum_tree's order),
 *   vd_rows(kind, rows, i)   elements i .. i+7 widened to f64 (exact);
 *   VF              sixteen floats; vf_zero/loadu/set1/fma/storeu,
 *   vf_tree (kvpi_fast_tree's order), vf_rows(kind, rows, i) (16 to f32);
 *   GROUP_GMAX      the most heads one tile keeps (8 or 4),
 *   XCOLS(G), FCOLS(G)  vectors of columns an axpy tile keeps per head;
 *   level_max(s, n), level_exp_sum(s, n, shift), level_div(s, n, sum);
 *   vf_add/sub/mul/div/max (IEEE, lane by lane), vf_hmax (the largest lane),
 *   vf_pow2_64(k)  2^(k + 64) per lane for integral k in [-160, 0].
 *
 * Exactness (kernels.h): a tile loads each widened chunk of a row once and
 * multiplies it into the G heads' own accumulators; every accumulator gets
 * the operations of the one-head kernel, in its order. So the exact kernels
 * give dot_rows's and axpy_rows's bits on the widened rows, and the fast
 * ones kvpi_fast_dot's and fmaf's, whatever g, the tile or the level.
 * Heads are taken in tiles of 8, 4, 2 and 1 (a head's result does not depend
 * on its tile), value rows in runs of 4 (exact) or 16 (fast), each output
 * adding them in order.
 */
#ifndef KVPAGER_ATTENTION_KERNELS_GROUP_H
#define KVPAGER_ATTENTION_KERNELS_GROUP_H

#include <math.h>

#include "attention/kernels.h"

#define GROUP_AI static inline __attribute__((always_inline))
/* Loops over a tile's heads and column vectors: unrolled, so accumulators stay in registers. */
#define GROUP_UNROLL _Pragma("GCC unroll 16")
/* Value rows a fast axpy tile adds while its accumulators stay in registers. */
#define GROUP_ROW_RUN 16

/* ---- the exact level ---------------------------------------------------------- */

/*
 * Asks for the line of `ahead` (rows laid out as the ones being read; NULL:
 * nothing) that holds element i, when the chunk of sixteen elements at i
 * starts a 64-byte run: one request per 64 bytes consumed, spread over the
 * loops (kernels.h, dot_group_fast). A hint to L2 (prefetcht1): no bit of
 * any result depends on it.
 */
GROUP_AI void group_ask(kvpi_rows kind, const void *ahead, size_t i)
{
    size_t bytes = kvpi_rows_bytes(kind);
    if (ahead != NULL && ((i * bytes) & 63) < 16 * bytes) {
        __builtin_prefetch((const unsigned char *)ahead + i * bytes, 0, 2);
    }
}

/* One row (element `at` of rows) against G heads of q ([G][n]). */
GROUP_AI void xdot_row(kvpi_rows kind, const double *q, size_t n, const void *rows, size_t at,
                       double scale, double *out, size_t out_stride, const int G)
{
    size_t n8 = n & ~(size_t)7;
    VD s[GROUP_GMAX];
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        s[h] = vd_zero();
    }
    for (size_t f = 0; f < n8; f += 8) {
        VD x = vd_rows(kind, rows, at + f);
        GROUP_UNROLL
        for (int h = 0; h < G; h++) {
            s[h] = vd_add(s[h], vd_mul(vd_loadu(q + (size_t)h * n + f), x));
        }
    }
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        double sum = vd_tree(s[h]);
        for (size_t f = n8; f < n; f++) {
            sum += q[(size_t)h * n + f] * kvpi_rows_widen(kind, rows, at + f);
        }
        out[(size_t)h * out_stride] = sum * scale;
    }
}

GROUP_AI void xdot_heads(kvpi_rows kind, const double *q, const void *rows, size_t stride,
                         size_t count, size_t n, double scale, double *out, size_t out_stride,
                         const int G)
{
    for (size_t r = 0; r < count; r++) {
        xdot_row(kind, q, n, rows, r * stride, scale, out + r, out_stride, G);
    }
}

GROUP_AI void xdot_kind(kvpi_rows kind, const double *q, size_t g, const void *rows,
                        size_t stride, size_t count, size_t n, double scale, double *out,
                        size_t out_stride)
{
    size_t h = 0;
    while (h < g) {
        const double *qh = q + h * n;
        double *oh = out + h * out_stride;
        size_t left = g - h;
        if (GROUP_GMAX >= 8 && left >= 8) {
            xdot_heads(kind, qh, rows, stride, count, n, scale, oh, out_stride, 8);
            h += 8;
        } else if (left >= 4) {
            xdot_heads(kind, qh, rows, stride, count, n, scale, oh, out_stride, 4);
            h += 4;
        } else if (left >= 2) {
            xdot_heads(kind, qh, rows, stride, count, n, scale, oh, out_stride, 2);
            h += 2;
        } else {
            xdot_heads(kind, qh, rows, stride, count, n, scale, oh, out_stride, 1);
            h += 1;
        }
    }
}

/*
 * Columns [0, 8C) of G heads' accumulators (acc, w at their columns and
 * rows) over `count` rows starting at element `at`, `stride` apart.
 */
GROUP_AI void xaxpy_cols(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                         size_t w_stride, const void *rows, size_t at, size_t stride,
                         size_t count, const void *ahead, const int G, const int C)
{
    VD a[GROUP_GMAX][16];
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            a[h][c] = vd_loadu(acc + (size_t)h * acc_stride + 8 * c);
        }
    }
    for (size_t r = 0; r < count; r++) {
        VD x[16];
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            group_ask(kind, ahead, at + r * stride + 8 * (size_t)c);
            x[c] = vd_rows(kind, rows, at + r * stride + 8 * (size_t)c);
        }
        GROUP_UNROLL
        for (int h = 0; h < G; h++) {
            VD wb = vd_set1(w[(size_t)h * w_stride + r]);
            GROUP_UNROLL
            for (int c = 0; c < C; c++) {
                a[h][c] = vd_add(a[h][c], vd_mul(wb, x[c]));
            }
        }
    }
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            vd_storeu(acc + (size_t)h * acc_stride + 8 * c, a[h][c]);
        }
    }
}

GROUP_AI void xaxpy_heads(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                          size_t w_stride, const void *rows, size_t stride, size_t count,
                          size_t n, const void *ahead, const int G, const int C)
{
    for (size_t r0 = 0; r0 < count; r0 += 4) {
        size_t c = count - r0 < 4 ? count - r0 : 4;
        const double *wr = w + r0;
        size_t at = r0 * stride;
        size_t f = 0;
        for (; f + 8 * (size_t)C <= n; f += 8 * (size_t)C) {
            xaxpy_cols(kind, acc + f, acc_stride, wr, w_stride, rows, at + f, stride, c, ahead,
                       G, C);
        }
        for (; f + 8 <= n; f += 8) {
            xaxpy_cols(kind, acc + f, acc_stride, wr, w_stride, rows, at + f, stride, c, ahead,
                       G, 1);
        }
        for (; f < n; f++) {
            GROUP_UNROLL
            for (int h = 0; h < G; h++) {
                double a = acc[(size_t)h * acc_stride + f];
                for (size_t r = 0; r < c; r++) {
                    a += wr[(size_t)h * w_stride + r] *
                         kvpi_rows_widen(kind, rows, at + r * stride + f);
                }
                acc[(size_t)h * acc_stride + f] = a;
            }
        }
    }
}

GROUP_AI void xaxpy_kind(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                         size_t w_stride, size_t g, const void *rows, size_t stride,
                         size_t count, size_t n, const void *ahead)
{
    size_t h = 0;
    while (h < g) {
        double *ah = acc + h * acc_stride;
        const double *wh = w + h * w_stride;
        const void *pa = h == 0 ? ahead : NULL; /* the first tile reads from memory */
        size_t left = g - h;
        if (GROUP_GMAX >= 8 && left >= 8) {
            xaxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 8,
                        XCOLS(8));
            h += 8;
        } else if (left >= 4) {
            xaxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 4,
                        XCOLS(4));
            h += 4;
        } else if (left >= 2) {
            xaxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 2,
                        XCOLS(2));
            h += 2;
        } else {
            xaxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 1,
                        XCOLS(1));
            h += 1;
        }
    }
}

/* ---- the fast level ----------------------------------------------------------- */


/* One row against G heads of q ([G][n], f32, the scale folded in): kvpi_fast_dot each. */
GROUP_AI void fdot_row(kvpi_rows kind, const float *q, size_t n, const void *rows, size_t at,
                       float *out, size_t out_stride, const void *ahead, const int G)
{
    size_t n16 = n & ~(size_t)15;
    VF s[GROUP_GMAX];
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        s[h] = vf_zero();
    }
    for (size_t f = 0; f < n16; f += 16) {
        group_ask(kind, ahead, at + f);
        VF x = vf_rows(kind, rows, at + f);
        GROUP_UNROLL
        for (int h = 0; h < G; h++) {
            s[h] = vf_fma(vf_loadu(q + (size_t)h * n + f), x, s[h]);
        }
    }
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        float sum = vf_tree(s[h]);
        for (size_t f = n16; f < n; f++) {
            sum = fmaf(q[(size_t)h * n + f], kvpi_rows_widen_f32(kind, rows, at + f), sum);
        }
        out[(size_t)h * out_stride] = sum;
    }
}

/* ahead: asked for as the rows are read (NULL: not). */
GROUP_AI void fdot_heads(kvpi_rows kind, const float *q, const void *rows, size_t stride,
                         size_t count, size_t n, float *out, size_t out_stride,
                         const void *ahead, const int G)
{
    for (size_t r = 0; r < count; r++) {
        fdot_row(kind, q, n, rows, r * stride, out + r, out_stride, ahead, G);
    }
}

/* The first tile of heads reads the rows from memory, so it alone asks for `ahead`. */
GROUP_AI void fdot_kind(kvpi_rows kind, const float *q, size_t g, const void *rows,
                        size_t stride, size_t count, size_t n, float *out, size_t out_stride,
                        const void *ahead)
{
    size_t h = 0;
    while (h < g) {
        const float *qh = q + h * n;
        float *oh = out + h * out_stride;
        const void *ah = h == 0 ? ahead : NULL;
        size_t left = g - h;
        if (GROUP_GMAX >= 8 && left >= 8) {
            fdot_heads(kind, qh, rows, stride, count, n, oh, out_stride, ah, 8);
            h += 8;
        } else if (left >= 4) {
            fdot_heads(kind, qh, rows, stride, count, n, oh, out_stride, ah, 4);
            h += 4;
        } else if (left >= 2) {
            fdot_heads(kind, qh, rows, stride, count, n, oh, out_stride, ah, 2);
            h += 2;
        } else {
            fdot_heads(kind, qh, rows, stride, count, n, oh, out_stride, ah, 1);
            h += 1;
        }
    }
}

/* xaxpy_cols in f32 with fused multiply-adds: 16C columns. */
GROUP_AI void faxpy_cols(kvpi_rows kind, float *acc, size_t acc_stride, const float *w,
                         size_t w_stride, const void *rows, size_t at, size_t stride,
                         size_t count, const void *ahead, const int G, const int C)
{
    VF a[GROUP_GMAX][16];
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            a[h][c] = vf_loadu(acc + (size_t)h * acc_stride + 16 * c);
        }
    }
    for (size_t r = 0; r < count; r++) {
        VF x[16];
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            group_ask(kind, ahead, at + r * stride + 16 * (size_t)c);
            x[c] = vf_rows(kind, rows, at + r * stride + 16 * (size_t)c);
        }
        GROUP_UNROLL
        for (int h = 0; h < G; h++) {
            VF wb = vf_set1(w[(size_t)h * w_stride + r]);
            GROUP_UNROLL
            for (int c = 0; c < C; c++) {
                a[h][c] = vf_fma(wb, x[c], a[h][c]);
            }
        }
    }
    GROUP_UNROLL
    for (int h = 0; h < G; h++) {
        GROUP_UNROLL
        for (int c = 0; c < C; c++) {
            vf_storeu(acc + (size_t)h * acc_stride + 16 * c, a[h][c]);
        }
    }
}

GROUP_AI void faxpy_heads(kvpi_rows kind, float *acc, size_t acc_stride, const float *w,
                          size_t w_stride, const void *rows, size_t stride, size_t count,
                          size_t n, const void *ahead, const int G, const int C)
{
    for (size_t r0 = 0; r0 < count; r0 += GROUP_ROW_RUN) {
        size_t c = count - r0 < GROUP_ROW_RUN ? count - r0 : GROUP_ROW_RUN;
        const float *wr = w + r0;
        size_t at = r0 * stride;
        size_t f = 0;
        for (; f + 16 * (size_t)C <= n; f += 16 * (size_t)C) {
            faxpy_cols(kind, acc + f, acc_stride, wr, w_stride, rows, at + f, stride, c, ahead,
                       G, C);
        }
        for (; f + 16 <= n; f += 16) {
            faxpy_cols(kind, acc + f, acc_stride, wr, w_stride, rows, at + f, stride, c, ahead,
                       G, 1);
        }
        for (; f < n; f++) {
            GROUP_UNROLL
            for (int h = 0; h < G; h++) {
                float a = acc[(size_t)h * acc_stride + f];
                for (size_t r = 0; r < c; r++) {
                    a = fmaf(wr[(size_t)h * w_stride + r],
                             kvpi_rows_widen_f32(kind, rows, at + r * stride + f), a);
                }
                acc[(size_t)h * acc_stride + f] = a;
            }
        }
    }
}

GROUP_AI void faxpy_kind(kvpi_rows kind, float *acc, size_t acc_stride, const float *w,
                         size_t w_stride, size_t g, const void *rows, size_t stride,
                         size_t count, size_t n, const void *ahead)
{
    size_t h = 0;
    while (h < g) {
        float *ah = acc + h * acc_stride;
        const float *wh = w + h * w_stride;
        const void *pa = h == 0 ? ahead : NULL; /* the first tile reads from memory */
        size_t left = g - h;
        if (GROUP_GMAX >= 8 && left >= 8) {
            faxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 8,
                        FCOLS(8));
            h += 8;
        } else if (left >= 4) {
            faxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 4,
                        FCOLS(4));
            h += 4;
        } else if (left >= 2) {
            faxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 2,
                        FCOLS(2));
            h += 2;
        } else {
            faxpy_heads(kind, ah, acc_stride, wh, w_stride, rows, stride, count, n, pa, 1,
                        FCOLS(1));
            h += 1;
        }
    }
}

/* ---- the entries: one instantiation per row format ------------------------------ */

static void group_dot(kvpi_rows kind, const double *q, size_t g, const void *rows, size_t stride,
                      size_t count, size_t n, double scale, double *out, size_t out_stride)
{
    switch (kind) {
    case KVPI_ROWS_F64:
        xdot_kind(KVPI_ROWS_F64, q, g, rows, stride, count, n, scale, out, out_stride);
        return;
    case KVPI_ROWS_F32:
        xdot_kind(KVPI_ROWS_F32, q, g, rows, stride, count, n, scale, out, out_stride);
        return;
    case KVPI_ROWS_BF16:
        xdot_kind(KVPI_ROWS_BF16, q, g, rows, stride, count, n, scale, out, out_stride);
        return;
    case KVPI_ROWS_F16:
        xdot_kind(KVPI_ROWS_F16, q, g, rows, stride, count, n, scale, out, out_stride);
        return;
    default:
        xdot_kind(KVPI_ROWS_E4M3, q, g, rows, stride, count, n, scale, out, out_stride);
        return;
    }
}

static void group_axpy(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                       size_t w_stride, size_t g, const void *rows, size_t stride, size_t count,
                       size_t n, const void *ahead)
{
    switch (kind) {
    case KVPI_ROWS_F64:
        xaxpy_kind(KVPI_ROWS_F64, acc, acc_stride, w, w_stride, g, rows, stride, count, n, ahead);
        return;
    case KVPI_ROWS_F32:
        xaxpy_kind(KVPI_ROWS_F32, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
        return;
    case KVPI_ROWS_BF16:
        xaxpy_kind(KVPI_ROWS_BF16, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
        return;
    case KVPI_ROWS_F16:
        xaxpy_kind(KVPI_ROWS_F16, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
        return;
    default:
        xaxpy_kind(KVPI_ROWS_E4M3, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
        return;
    }
}

/* kind must be narrow (not F64): f64 pages are always exact. */
static void group_dot_fast(kvpi_rows kind, const float *q, size_t g, const void *rows,
                           size_t stride, size_t count, size_t n, float *out,
                           size_t out_stride, const void *ahead)
{
    switch (kind) {
    case KVPI_ROWS_BF16:
        fdot_kind(KVPI_ROWS_BF16, q, g, rows, stride, count, n, out, out_stride, ahead);
        return;
    case KVPI_ROWS_F16:
        fdot_kind(KVPI_ROWS_F16, q, g, rows, stride, count, n, out, out_stride, ahead);
        return;
    case KVPI_ROWS_E4M3:
        fdot_kind(KVPI_ROWS_E4M3, q, g, rows, stride, count, n, out, out_stride, ahead);
        return;
    default:
        fdot_kind(KVPI_ROWS_F32, q, g, rows, stride, count, n, out, out_stride, ahead);
        return;
    }
}

static void group_axpy_fast(kvpi_rows kind, float *acc, size_t acc_stride, const float *w,
                            size_t w_stride, size_t g, const void *rows, size_t stride,
                            size_t count, size_t n, const void *ahead)
{
    switch (kind) {
    case KVPI_ROWS_BF16:
        faxpy_kind(KVPI_ROWS_BF16, acc, acc_stride, w, w_stride, g, rows, stride, count, n,
                   ahead);
        return;
    case KVPI_ROWS_F16:
        faxpy_kind(KVPI_ROWS_F16, acc, acc_stride, w, w_stride, g, rows, stride, count, n,
                   ahead);
        return;
    case KVPI_ROWS_E4M3:
        faxpy_kind(KVPI_ROWS_E4M3, acc, acc_stride, w, w_stride, g, rows, stride, count, n,
                   ahead);
        return;
    default:
        faxpy_kind(KVPI_ROWS_F32, acc, acc_stride, w, w_stride, g, rows, stride, count, n,
                   ahead);
        return;
    }
}

/* kvpi_softmax: the maximum (exact in any order), the level's exp_sum, per-element divides. */
static void group_softmax(double *s, size_t n)
{
    double max = level_max(s, n);
    double sum = level_exp_sum(s, n, max);
    level_div(s, n, sum);
}

/* kvpi_exp2f on sixteen lanes: the same operations, so each lane has its bits. */
GROUP_AI VF vf_exp2(VF t)
{
    VF x = vf_max(t, vf_set1(KVPI_EXP2F_MIN));
    VF k = vf_sub(vf_add(x, vf_set1(KVPI_EXP2F_SHIFT)), vf_set1(KVPI_EXP2F_SHIFT));
    VF r = vf_sub(x, k);
    VF p = vf_set1(KVPI_EXP2F_C6);
    p = vf_fma(p, r, vf_set1(KVPI_EXP2F_C5));
    p = vf_fma(p, r, vf_set1(KVPI_EXP2F_C4));
    p = vf_fma(p, r, vf_set1(KVPI_EXP2F_C3));
    p = vf_fma(p, r, vf_set1(KVPI_EXP2F_C2));
    p = vf_fma(p, r, vf_set1(KVPI_EXP2F_C1));
    p = vf_fma(p, r, vf_set1(1.0f));
    return vf_mul(vf_mul(p, vf_pow2_64(k)), vf_set1(KVPI_EXP2F_DOWN));
}

/*
 * kvpi_softmax_fast_ref: the maximum (exact: any order), the exps with the
 * sum's sixteen lanes in one register (lane l takes i = l mod 16), its tree,
 * the tail one by one, then a divide per element.
 */
static void group_softmax_fast(float *s, size_t n)
{
    if (n == 0) {
        return;
    }
    size_t n16 = n & ~(size_t)15;
    float m = s[0];
    if (n16 > 0) {
        VF vm = vf_loadu(s);
        for (size_t i = 16; i < n16; i += 16) {
            vm = vf_max(vm, vf_loadu(s + i));
        }
        m = vf_hmax(vm);
    }
    for (size_t i = n16; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    VF vmax = vf_set1(m);
    VF lanes = vf_zero();
    for (size_t i = 0; i < n16; i += 16) {
        VF e = vf_exp2(vf_sub(vf_loadu(s + i), vmax));
        vf_storeu(s + i, e);
        lanes = vf_add(lanes, e);
    }
    float sum = vf_tree(lanes);
    for (size_t i = n16; i < n; i++) {
        s[i] = kvpi_exp2f(s[i] - m);
        sum += s[i];
    }
    VF vs = vf_set1(sum);
    for (size_t i = 0; i < n16; i += 16) {
        vf_storeu(s + i, vf_div(vf_loadu(s + i), vs));
    }
    for (size_t i = n16; i < n; i++) {
        s[i] /= sum;
    }
}

#endif /* KVPAGER_ATTENTION_KERNELS_GROUP_H */
