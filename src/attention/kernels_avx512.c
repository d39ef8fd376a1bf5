/*
 * kernels_avx512.c: the AVX-512F level of the dispatched kernels (x86-64
 * only; compiled with -mavx512f -ffp-contract=off, so no FMA is emitted).
 *
 * Layout: a dot product keeps its eight lane sums in one zmm register, so a
 * row of d_h = 64 doubles is eight loads and adds; its 256-bit halves added
 * are the tree's first level (t_l = s_l + s_{l+4}). dot_rows takes four rows
 * at a time, each with its own register, read one after another in address
 * order (see kernels_avx2.c), and does their last two tree levels together
 * with AVX2 shuffles, exactly as kernels_avx2.c does. axpy over rows keeps
 * up to 64 outputs in eight registers while it walks a group of four rows.
 * Every add takes its operands in the portable C's order (kernels.h).
 * Callers: through kvpi_kernels_level() only, after cpuid said AVX-512F.
 */
#include <immintrin.h>

#include "attention/kernels.h"
#include "attention/kernels_widen.h" /* kvpi_e4m3_8, kvpi_e4m3_16 */

/* The first tree level of the lane sums s: [s_0 + s_4, .., s_3 + s_7]. */
static inline __m256d first_level(__m512d s)
{
    return _mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1));
}

/*
 * The eight lane sums of a and b over f < n8 (a multiple of 8); unless ah is
 * NULL, asks for the line of ah at each f as it loads b's (gather.c: the
 * next block's rows), which changes no bit.
 */
static inline __attribute__((always_inline)) __m512d lane_sums_ahead(const double *a,
                                                                     const double *b, size_t n8,
                                                                     const double *ah)
{
    __m512d s = _mm512_setzero_pd();
    if (ah == NULL) {
        for (size_t f = 0; f < n8; f += 8) {
            s = _mm512_add_pd(s, _mm512_mul_pd(_mm512_loadu_pd(a + f), _mm512_loadu_pd(b + f)));
        }
        return s;
    }
    for (size_t f = 0; f < n8; f += 8) {
        __builtin_prefetch(ah + f, 0, 2);
        s = _mm512_add_pd(s, _mm512_mul_pd(_mm512_loadu_pd(a + f), _mm512_loadu_pd(b + f)));
    }
    return s;
}

static inline __m512d lane_sums(const double *a, const double *b, size_t n8)
{
    return lane_sums_ahead(a, b, n8, NULL);
}

static double avx512_dot(const double *a, const double *b, size_t n)
{
    size_t n8 = n & ~(size_t)7;
    __m512d s = lane_sums(a, b, n8);
    __m256d t = first_level(s);
    __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (size_t f = n8; f < n; f++) {
        sum += a[f] * b[f];
    }
    return sum;
}

/* The dots of four rows from their first-level sums, in row order (see kernels_avx2.c). */
static inline __m256d four_dots(__m256d t0, __m256d t1, __m256d t2, __m256d t3)
{
    __m256d u01 = _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20),
                                _mm256_permute2f128_pd(t0, t1, 0x31));
    __m256d u23 = _mm256_add_pd(_mm256_permute2f128_pd(t2, t3, 0x20),
                                _mm256_permute2f128_pd(t2, t3, 0x31));
    __m256d dots = _mm256_hadd_pd(u01, u23); /* rows 0, 2, 1, 3 */
    return _mm256_permute4x64_pd(dots, 0xD8);
}

/* dot_rows; unless ah is NULL, asks for rows `ah` (laid out as `rows`) a line per line read. */
static inline __attribute__((always_inline)) void
dot_rows_ahead(const double *q, const double *rows, size_t stride, size_t count, size_t n,
               double scale, double *out, const double *ah)
{
    size_t n8 = n & ~(size_t)7;
    size_t r = 0;
    for (; r + 4 <= count; r += 4) {
        const double *k0 = rows + r * stride;
        const double *k1 = k0 + stride;
        const double *k2 = k1 + stride;
        const double *k3 = k2 + stride;
        const double *a0 = ah != NULL ? ah + r * stride : NULL;
        /* One row after another, so memory is read in address order. */
        __m512d s0 = lane_sums_ahead(q, k0, n8, a0);
        __m512d s1 = lane_sums_ahead(q, k1, n8, a0 != NULL ? a0 + stride : NULL);
        __m512d s2 = lane_sums_ahead(q, k2, n8, a0 != NULL ? a0 + 2 * stride : NULL);
        __m512d s3 = lane_sums_ahead(q, k3, n8, a0 != NULL ? a0 + 3 * stride : NULL);
        __m256d dots = four_dots(first_level(s0), first_level(s1), first_level(s2),
                                 first_level(s3));
        if (n8 < n) {
            double d[4];
            const double *k[4] = {k0, k1, k2, k3};
            _mm256_storeu_pd(d, dots);
            for (size_t i = 0; i < 4; i++) {
                for (size_t f = n8; f < n; f++) {
                    d[i] += q[f] * k[i][f];
                }
            }
            dots = _mm256_loadu_pd(d);
        }
        _mm256_storeu_pd(out + r, _mm256_mul_pd(dots, _mm256_set1_pd(scale)));
    }
    for (; r < count; r++) {
        out[r] = avx512_dot(q, rows + r * stride, n) * scale;
    }
}

static void avx512_dot_rows(const double *q, const double *rows, size_t stride, size_t count,
                            size_t n, double scale, double *out)
{
    dot_rows_ahead(q, rows, stride, count, n, scale, out, NULL);
}

static void avx512_dot_rows_ahead(const double *q, const double *rows, size_t stride,
                                  size_t count, size_t n, double scale, double *out,
                                  const double *ah)
{
    dot_rows_ahead(q, rows, stride, count, n, scale, out, ah);
}

static void avx512_axpy(double *acc, double weight, const double *v, size_t n)
{
    __m512d w = _mm512_set1_pd(weight);
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        _mm512_storeu_pd(acc + f, _mm512_add_pd(_mm512_loadu_pd(acc + f),
                                                _mm512_mul_pd(w, _mm512_loadu_pd(v + f))));
    }
    for (; f < n; f++) {
        acc[f] += weight * v[f];
    }
}

/* Columns [f, f + 64) of axpy_rows, in eight registers. */
static inline void axpy_rows_64(double *acc, const double *weights, const double *rows,
                                size_t stride, size_t count, const double *ah)
{
    __m512d a[8];
    for (size_t j = 0; j < 8; j++) {
        a[j] = _mm512_loadu_pd(acc + 8 * j);
    }
    for (size_t r = 0; r < count; r++) {
        __m512d w = _mm512_set1_pd(weights[r]);
        const double *v = rows + r * stride;
        for (size_t j = 0; ah != NULL && j < 8; j++) {
            __builtin_prefetch(ah + r * stride + 8 * j, 0, 2); /* one line per line read */
        }
        for (size_t j = 0; j < 8; j++) {
            a[j] = _mm512_add_pd(a[j], _mm512_mul_pd(w, _mm512_loadu_pd(v + 8 * j)));
        }
    }
    for (size_t j = 0; j < 8; j++) {
        _mm512_storeu_pd(acc + 8 * j, a[j]);
    }
}

/* Rows in groups of four, every 64-column pass per group (see kernels_avx2.c). */
/* axpy_rows; its 64-column passes ask for rows `ah` (laid out as `rows`; NULL: none). */
static void avx512_axpy_rows_a(double *acc, const double *weights, const double *rows,
                               size_t stride, size_t count, size_t n, const double *ah)
{
    for (size_t g = 0; g < count; g += 4) {
        size_t c = count - g < 4 ? count - g : 4;
        const double *grows = rows + g * stride;
        const double *gw = weights + g;
        size_t f = 0;
        for (; f + 64 <= n; f += 64) {
            axpy_rows_64(acc + f, gw, grows + f, stride, c,
                         ah != NULL ? ah + g * stride + f : NULL);
        }
        for (; f + 8 <= n; f += 8) {
            __m512d a = _mm512_loadu_pd(acc + f);
            for (size_t r = 0; r < c; r++) {
                a = _mm512_add_pd(a, _mm512_mul_pd(_mm512_set1_pd(gw[r]),
                                                   _mm512_loadu_pd(grows + r * stride + f)));
            }
            _mm512_storeu_pd(acc + f, a);
        }
        for (; f < n; f++) {
            double a = acc[f];
            for (size_t r = 0; r < c; r++) {
                a += gw[r] * grows[r * stride + f];
            }
            acc[f] = a;
        }
    }
}

static void avx512_axpy_rows(double *acc, const double *weights, const double *rows,
                             size_t stride, size_t count, size_t n)
{
    avx512_axpy_rows_a(acc, weights, rows, stride, count, n, NULL);
}

/* kvpi_exp of eight lanes: its steps in its order (kernels.h). */
static inline __m512d exp8(__m512d x)
{
    __m512d min = _mm512_set1_pd(KVPI_EXP_MIN);
    __m512d shift = _mm512_set1_pd(KVPI_EXP_SHIFT);
    __m512d xc = _mm512_max_pd(x, min);
    __m512d shifted = _mm512_add_pd(_mm512_mul_pd(xc, _mm512_set1_pd(KVPI_EXP_INV_LN2)), shift);
    __m512d k = _mm512_sub_pd(shifted, shift);
    __m512i bits = _mm512_add_epi64(_mm512_castpd_si512(shifted),
                                    _mm512_set1_epi64(KVPI_EXP_BIAS));
    __m512d up = _mm512_castsi512_pd(_mm512_slli_epi64(bits, 52));
    __m512d hi = _mm512_sub_pd(xc, _mm512_mul_pd(k, _mm512_set1_pd(KVPI_EXP_LN2_HI)));
    __m512d lo = _mm512_mul_pd(k, _mm512_set1_pd(KVPI_EXP_LN2_LO));
    __m512d r = _mm512_sub_pd(hi, lo);
    __m512d t = _mm512_mul_pd(r, r);
    __m512d p = _mm512_add_pd(_mm512_set1_pd(KVPI_EXP_P4),
                              _mm512_mul_pd(t, _mm512_set1_pd(KVPI_EXP_P5)));
    p = _mm512_add_pd(_mm512_set1_pd(KVPI_EXP_P3), _mm512_mul_pd(t, p));
    p = _mm512_add_pd(_mm512_set1_pd(KVPI_EXP_P2), _mm512_mul_pd(t, p));
    p = _mm512_add_pd(_mm512_set1_pd(KVPI_EXP_P1), _mm512_mul_pd(t, p));
    __m512d c = _mm512_sub_pd(r, _mm512_mul_pd(t, p));
    __m512d q = _mm512_div_pd(_mm512_mul_pd(r, c), _mm512_sub_pd(_mm512_set1_pd(2.0), c));
    __m512d y = _mm512_sub_pd(_mm512_set1_pd(1.0), _mm512_sub_pd(_mm512_sub_pd(lo, q), hi));
    __m512d e = _mm512_mul_pd(_mm512_mul_pd(y, up), _mm512_set1_pd(KVPI_EXP_DOWN));
    return _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(x, min, _CMP_GE_OQ), e);
}

static void avx512_exps(const double *x, double *y, size_t n)
{
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        _mm512_storeu_pd(y + f, exp8(_mm512_loadu_pd(x + f)));
    }
    for (; f < n; f++) {
        y[f] = kvpi_exp(x[f]);
    }
}

/* The eight lane sums in one register, as avx512_dot keeps them. */
static double avx512_exp_sum(double *s, size_t n, double shift)
{
    __m512d sh = _mm512_set1_pd(shift);
    __m512d acc = _mm512_setzero_pd();
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        __m512d e = exp8(_mm512_sub_pd(_mm512_loadu_pd(s + f), sh));
        _mm512_storeu_pd(s + f, e);
        acc = _mm512_add_pd(acc, e);
    }
    __m256d t = first_level(acc);
    __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (; f < n; f++) {
        s[f] = kvpi_exp(s[f] - shift);
        sum += s[f];
    }
    return sum;
}

/*
 * Rows stored as f32 or bf16. Eight elements are widened to eight doubles in
 * one register (f32: vcvtps2pd from a ymm; bf16: zero-extend to 32 bits,
 * shift into an f32's top half, then vcvtps2pd), exact, and then every kernel
 * below is its f64 twin above with that load in place of _mm512_loadu_pd, so
 * the same operations in the same order give the same bits.
 */
typedef enum row_kind { ROWS_F32, ROWS_BF16 } row_kind;

static inline __attribute__((always_inline)) __m512d load8(const void *rows, size_t i,
                                                           row_kind kind)
{
    if (kind == ROWS_F32) {
        return _mm512_cvtps_pd(_mm256_loadu_ps((const float *)rows + i));
    }
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)rows + i));
    return _mm512_cvtps_pd(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
}

static inline double widen(const void *rows, size_t i, row_kind kind)
{
    return kind == ROWS_F32 ? (double)((const float *)rows)[i]
                            : kvpi_bf16_widen(((const uint16_t *)rows)[i]);
}

static inline __attribute__((always_inline)) __m512d
narrow_lane_sums(const double *a, const void *rows, size_t at, size_t n8, row_kind kind)
{
    __m512d s = _mm512_setzero_pd();
    for (size_t f = 0; f < n8; f += 8) {
        s = _mm512_add_pd(s, _mm512_mul_pd(_mm512_loadu_pd(a + f), load8(rows, at + f, kind)));
    }
    return s;
}

static inline __attribute__((always_inline)) double narrow_dot(const double *a, const void *rows,
                                                               size_t at, size_t n,
                                                               row_kind kind)
{
    size_t n8 = n & ~(size_t)7;
    __m256d t = first_level(narrow_lane_sums(a, rows, at, n8, kind));
    __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (size_t f = n8; f < n; f++) {
        sum += a[f] * widen(rows, at + f, kind);
    }
    return sum;
}

static inline __attribute__((always_inline)) void
narrow_dot_rows(const double *q, const void *rows, size_t stride, size_t count, size_t n,
                double scale, double *out, row_kind kind)
{
    size_t n8 = n & ~(size_t)7;
    size_t r = 0;
    for (; r + 4 <= count; r += 4) {
        size_t at = r * stride;
        __m512d s0 = narrow_lane_sums(q, rows, at, n8, kind);
        __m512d s1 = narrow_lane_sums(q, rows, at + stride, n8, kind);
        __m512d s2 = narrow_lane_sums(q, rows, at + 2 * stride, n8, kind);
        __m512d s3 = narrow_lane_sums(q, rows, at + 3 * stride, n8, kind);
        __m256d dots = four_dots(first_level(s0), first_level(s1), first_level(s2),
                                 first_level(s3));
        if (n8 < n) {
            double d[4];
            _mm256_storeu_pd(d, dots);
            for (size_t i = 0; i < 4; i++) {
                for (size_t f = n8; f < n; f++) {
                    d[i] += q[f] * widen(rows, at + i * stride + f, kind);
                }
            }
            dots = _mm256_loadu_pd(d);
        }
        _mm256_storeu_pd(out + r, _mm256_mul_pd(dots, _mm256_set1_pd(scale)));
    }
    for (; r < count; r++) {
        out[r] = narrow_dot(q, rows, r * stride, n, kind) * scale;
    }
}

static inline __attribute__((always_inline)) void
narrow_axpy_rows_64(double *acc, const double *weights, const void *rows, size_t at,
                    size_t stride, size_t count, row_kind kind)
{
    __m512d a[8];
    for (size_t j = 0; j < 8; j++) {
        a[j] = _mm512_loadu_pd(acc + 8 * j);
    }
    for (size_t r = 0; r < count; r++) {
        __m512d w = _mm512_set1_pd(weights[r]);
        size_t v = at + r * stride;
        for (size_t j = 0; j < 8; j++) {
            a[j] = _mm512_add_pd(a[j], _mm512_mul_pd(w, load8(rows, v + 8 * j, kind)));
        }
    }
    for (size_t j = 0; j < 8; j++) {
        _mm512_storeu_pd(acc + 8 * j, a[j]);
    }
}

static inline __attribute__((always_inline)) void
narrow_axpy_rows(double *acc, const double *weights, const void *rows, size_t stride,
                 size_t count, size_t n, row_kind kind)
{
    for (size_t g = 0; g < count; g += 4) {
        size_t c = count - g < 4 ? count - g : 4;
        size_t at = g * stride;
        const double *gw = weights + g;
        size_t f = 0;
        for (; f + 64 <= n; f += 64) {
            narrow_axpy_rows_64(acc + f, gw, rows, at + f, stride, c, kind);
        }
        for (; f + 8 <= n; f += 8) {
            __m512d a = _mm512_loadu_pd(acc + f);
            for (size_t r = 0; r < c; r++) {
                a = _mm512_add_pd(a, _mm512_mul_pd(_mm512_set1_pd(gw[r]),
                                                   load8(rows, at + r * stride + f, kind)));
            }
            _mm512_storeu_pd(acc + f, a);
        }
        for (; f < n; f++) {
            double a = acc[f];
            for (size_t r = 0; r < c; r++) {
                a += gw[r] * widen(rows, at + r * stride + f, kind);
            }
            acc[f] = a;
        }
    }
}

static void avx512_dot_rows_f32(const double *q, const float *rows, size_t stride,
                                size_t count, size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_F32);
}

static void avx512_dot_rows_bf16(const double *q, const uint16_t *rows, size_t stride,
                                 size_t count, size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_BF16);
}

static void avx512_axpy_rows_f32(double *acc, const double *weights, const float *rows,
                                 size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_F32);
}

static void avx512_axpy_rows_bf16(double *acc, const double *weights, const uint16_t *rows,
                                  size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_BF16);
}

/*
 * kvpi_project_rows's tile: up to 4 rows x 32 columns of sums in sixteen
 * registers (four per row), i outermost; each sum takes acc + x * w, as the
 * portable C. A tile narrower than 32 columns loads and stores through lane
 * masks, so columns past n are never touched.
 */
#define AVX512_MR 4
#define AVX512_NR 32

static inline __attribute__((always_inline)) void
avx512_tile(const double *x, size_t x_stride, const double *w, size_t w_stride, size_t k,
            double *y, size_t y_stride, int first, const size_t mr, const __mmask8 mask[4])
{
    __m512d acc[AVX512_MR][4];
    _Pragma("GCC unroll 8")
    for (size_t r = 0; r < mr; r++) {
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 4; v++) {
            acc[r][v] = first ? _mm512_setzero_pd()
                              : _mm512_maskz_loadu_pd(mask[v], y + r * y_stride + 8 * v);
        }
    }
    for (size_t i = 0; i < k; i++) {
        const double *wi = w + i * w_stride;
        __m512d wv[4];
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 4; v++) {
            wv[v] = _mm512_maskz_loadu_pd(mask[v], wi + 8 * v);
        }
        _Pragma("GCC unroll 8")
        for (size_t r = 0; r < mr; r++) {
            __m512d xi = _mm512_set1_pd(x[r * x_stride + i]);
            _Pragma("GCC unroll 8")
            for (size_t v = 0; v < 4; v++) {
                acc[r][v] = _mm512_add_pd(acc[r][v], _mm512_mul_pd(xi, wv[v]));
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (size_t r = 0; r < mr; r++) {
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 4; v++) {
            _mm512_mask_storeu_pd(y + r * y_stride + 8 * v, mask[v], acc[r][v]);
        }
    }
}

static void avx512_project_tile(const double *x, size_t x_stride, size_t mr, const double *w,
                                size_t w_stride, size_t k, size_t n, double *y,
                                size_t y_stride, int first)
{
    __mmask8 mask[4];
    for (size_t v = 0; v < 4; v++) {
        size_t lanes = n > 8 * v ? n - 8 * v : 0;
        mask[v] = (__mmask8)(lanes >= 8 ? 0xFF : (1u << lanes) - 1);
    }
    switch (mr) {
    case 4:
        avx512_tile(x, x_stride, w, w_stride, k, y, y_stride, first, 4, mask);
        break;
    case 3:
        avx512_tile(x, x_stride, w, w_stride, k, y, y_stride, first, 3, mask);
        break;
    case 2:
        avx512_tile(x, x_stride, w, w_stride, k, y, y_stride, first, 2, mask);
        break;
    default:
        avx512_tile(x, x_stride, w, w_stride, k, y, y_stride, first, 1, mask);
        break;
    }
}


/* ---- grouped kernels, the fast level and the softmax (kernels_group.h) ---------- */

typedef __m512d VD;
typedef __m512 VF;
#define GROUP_GMAX 8
#define XCOLS(G) ((G) >= 8 ? 2 : (G) >= 4 ? 4 : 8) /* G x C <= 16 of 32 registers */
#define FCOLS(G) XCOLS(G)

static inline __attribute__((always_inline)) VD vd_zero(void) { return _mm512_setzero_pd(); }
static inline __attribute__((always_inline)) VD vd_loadu(const double *p) { return _mm512_loadu_pd(p); }
static inline __attribute__((always_inline)) VD vd_set1(double x) { return _mm512_set1_pd(x); }
static inline __attribute__((always_inline)) VD vd_add(VD a, VD b) { return _mm512_add_pd(a, b); }
static inline __attribute__((always_inline)) VD vd_mul(VD a, VD b) { return _mm512_mul_pd(a, b); }
static inline __attribute__((always_inline)) void vd_storeu(double *p, VD x) { _mm512_storeu_pd(p, x); }

static inline __attribute__((always_inline)) double vd_tree(VD s)
{
    __m256d t = first_level(s);
    __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    return _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
}

/* Elements i .. i+7 of rows of `kind`, widened to f64 (exact). */
static inline __attribute__((always_inline)) VD vd_rows(kvpi_rows kind, const void *rows, size_t i)
{
    switch (kind) {
    case KVPI_ROWS_F64:
        return _mm512_loadu_pd((const double *)rows + i);
    case KVPI_ROWS_F32:
        return load8(rows, i, ROWS_F32);
    case KVPI_ROWS_BF16:
        return load8(rows, i, ROWS_BF16);
    case KVPI_ROWS_F16:
        return _mm512_cvtps_pd(
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)((const uint16_t *)rows + i))));
    default:
        return _mm512_cvtps_pd(kvpi_e4m3_8((const uint8_t *)rows + i));
    }
}

static inline __attribute__((always_inline)) VF vf_zero(void) { return _mm512_setzero_ps(); }
static inline __attribute__((always_inline)) VF vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline __attribute__((always_inline)) VF vf_set1(float x) { return _mm512_set1_ps(x); }
static inline __attribute__((always_inline)) VF vf_fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline __attribute__((always_inline)) void vf_storeu(float *p, VF x) { _mm512_storeu_ps(p, x); }
static inline __attribute__((always_inline)) VF vf_add(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline __attribute__((always_inline)) VF vf_sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
static inline __attribute__((always_inline)) VF vf_mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline __attribute__((always_inline)) VF vf_div(VF a, VF b) { return _mm512_div_ps(a, b); }
static inline __attribute__((always_inline)) VF vf_max(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline __attribute__((always_inline)) float vf_hmax(VF a) { return _mm512_reduce_max_ps(a); }
/* 2^(k + 64) for integral k in [-160, 0]: the biased exponent shifted into place. */
static inline __attribute__((always_inline)) VF vf_pow2_64(VF k)
{
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(64 + 127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}

/* kvpi_fast_tree: lanes l + 8, then l + 4, l + 2, l + 1. */
static inline __attribute__((always_inline)) float vf_tree(VF s)
{
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s), hi);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

/* Elements i .. i+15 of narrow rows of `kind`, widened to f32 (exact). */
static inline __attribute__((always_inline)) VF vf_rows(kvpi_rows kind, const void *rows, size_t i)
{
    const void *p;
    switch (kind) {
    case KVPI_ROWS_BF16:
        p = (const uint16_t *)rows + i;
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    case KVPI_ROWS_F16:
        p = (const uint16_t *)rows + i;
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    case KVPI_ROWS_E4M3:
        p = (const uint8_t *)rows + i;
        return kvpi_e4m3_16(p);
    default:
        return _mm512_loadu_ps((const float *)rows + i);
    }
}

/* The maximum of s[0..n): exact, so any order gives it (a zero's sign aside, which exp ignores). */
static double level_max(const double *s, size_t n)
{
    __m512d m = _mm512_set1_pd(s[0]);
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        m = _mm512_max_pd(m, _mm512_loadu_pd(s + f));
    }
    double max = _mm512_reduce_max_pd(m);
    for (; f < n; f++) {
        max = s[f] > max ? s[f] : max;
    }
    return max;
}

#define level_exp_sum avx512_exp_sum

static void level_div(double *s, size_t n, double sum)
{
    __m512d d = _mm512_set1_pd(sum);
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        _mm512_storeu_pd(s + f, _mm512_div_pd(_mm512_loadu_pd(s + f), d));
    }
    for (; f < n; f++) {
        s[f] /= sum;
    }
}

#include "attention/kernels_group.h"

/*
 * The fast dot products of R rows x G heads (R G = 16) in one pass, their
 * sixteen trees done together: each step adds the same lane pairs as
 * kvpi_fast_tree (l + 8, l + 4, l + 2, l + 1) for two accumulators in one
 * register, so every dot gets its own bits, and lane 4b + j of the result
 * holds accumulator 4j + b (accumulator i = r G + h).
 */
static inline __attribute__((always_inline)) __m512 pair8(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

static inline __attribute__((always_inline)) __m512 pair4(__m512 a, __m512 b)
{
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

static inline __attribute__((always_inline)) __m512 trees16(const __m512 a[16])
{
    __m512 c[8];
    for (int k = 0; k < 8; k++) {
        c[k] = pair8(a[2 * k], a[2 * k + 1]);
    }
    __m512 d[4];
    for (int k = 0; k < 4; k++) {
        d[k] = pair4(c[2 * k], c[2 * k + 1]);
    }
    __m512 e[2];
    for (int k = 0; k < 2; k++) {
        e[k] = _mm512_add_ps(_mm512_shuffle_ps(d[2 * k], d[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(d[2 * k], d[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* R rows from element `at` (stride apart) x G heads; n a multiple of 16. */
static inline __attribute__((always_inline)) void
fdot_tile16(kvpi_rows kind, const float *q, size_t n, const void *rows, size_t at, size_t stride,
            float *out, size_t out_stride, const void *ahead, const int R, const int G)
{
    __m512 a[16];
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i++) {
        a[i] = _mm512_setzero_ps();
    }
    for (size_t f = 0; f < n; f += 16) {
        _Pragma("GCC unroll 16")
        for (int r = 0; r < R; r++) {
            group_ask(kind, ahead, at + (size_t)r * stride + f);
            __m512 x = vf_rows(kind, rows, at + (size_t)r * stride + f);
            _Pragma("GCC unroll 16")
            for (int h = 0; h < G; h++) {
                a[r * G + h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)h * n + f), x,
                                               a[r * G + h]);
            }
        }
    }
    __m512 t = trees16(a);
    float d[16];
    _mm512_storeu_ps(d, t);
    for (int i = 0; i < 16; i++) {
        out[(size_t)(i % G) * out_stride + (size_t)(i / G)] = d[4 * (i % 4) + i / 4];
    }
}

/* G heads (1, 2, 4 or 8) over rows in tiles of 16 / G, the rest one row at a time. */
static inline __attribute__((always_inline)) void
fdot_tiled(kvpi_rows kind, const float *q, const void *rows, size_t stride, size_t count,
           size_t n, float *out, size_t out_stride, const void *ahead, const int G)
{
    const int R = 16 / G;
    size_t r = 0;
    for (; r + (size_t)R <= count; r += (size_t)R) {
        fdot_tile16(kind, q, n, rows, r * stride, stride, out + r, out_stride, ahead, R, G);
    }
    size_t skip = r * stride * kvpi_rows_bytes(kind);
    fdot_heads(kind, q, (const unsigned char *)rows + skip, stride, count - r, n, out + r,
               out_stride,
               ahead != NULL ? (const unsigned char *)ahead + skip : NULL, G);
}

static inline __attribute__((always_inline)) void
fdot_tiled_kind(kvpi_rows kind, const float *q, size_t g, const void *rows, size_t stride,
                size_t count, size_t n, float *out, size_t out_stride, const void *ahead)
{
    size_t h = 0;
    while (h < g) {
        const float *qh = q + h * n;
        float *oh = out + h * out_stride;
        const void *ah = h == 0 ? ahead : NULL; /* the first tile reads from memory */
        size_t left = g - h;
        if (left >= 8) {
            fdot_tiled(kind, qh, rows, stride, count, n, oh, out_stride, ah, 8);
            h += 8;
        } else if (left >= 4) {
            fdot_tiled(kind, qh, rows, stride, count, n, oh, out_stride, ah, 4);
            h += 4;
        } else if (left >= 2) {
            fdot_tiled(kind, qh, rows, stride, count, n, oh, out_stride, ah, 2);
            h += 2;
        } else {
            fdot_tiled(kind, qh, rows, stride, count, n, oh, out_stride, ah, 1);
            h += 1;
        }
    }
}

/* The fast scores: whole tiles of sixteen dots when n is a multiple of 16. */
static void avx512_dot_group_fast(kvpi_rows kind, const float *q, size_t g, const void *rows,
                                  size_t stride, size_t count, size_t n, float *out,
                                  size_t out_stride, const void *ahead)
{
    if (n % 16 != 0) {
        group_dot_fast(kind, q, g, rows, stride, count, n, out, out_stride, ahead);
        return;
    }
    switch (kind) {
    case KVPI_ROWS_BF16:
        fdot_tiled_kind(KVPI_ROWS_BF16, q, g, rows, stride, count, n, out, out_stride,
                        ahead);
        return;
    case KVPI_ROWS_F16:
        fdot_tiled_kind(KVPI_ROWS_F16, q, g, rows, stride, count, n, out, out_stride,
                        ahead);
        return;
    case KVPI_ROWS_E4M3:
        fdot_tiled_kind(KVPI_ROWS_E4M3, q, g, rows, stride, count, n, out, out_stride,
                        ahead);
        return;
    default:
        fdot_tiled_kind(KVPI_ROWS_F32, q, g, rows, stride, count, n, out, out_stride,
                        ahead);
        return;
    }
}

/*
 * The exact dot products of R rows x G heads (R G = 8) in one pass, their
 * eight trees done together: lanes l + 4, then t_0 + t_2 and t_1 + t_3, then
 * their sum, as kvpi_sum_tree; lane 2b + j of the result holds accumulator
 * 4j + b (accumulator i = r G + h). n is a multiple of 8 (no tail).
 */
static inline __attribute__((always_inline)) __m512d trees8(const __m512d a[8])
{
    __m512d c[4];
    for (int k = 0; k < 4; k++) {
        c[k] = _mm512_add_pd(_mm512_shuffle_f64x2(a[2 * k], a[2 * k + 1], 0x44),
                             _mm512_shuffle_f64x2(a[2 * k], a[2 * k + 1], 0xEE));
    }
    __m512d d[2];
    for (int k = 0; k < 2; k++) {
        d[k] = _mm512_add_pd(_mm512_shuffle_f64x2(c[2 * k], c[2 * k + 1], 0x88),
                             _mm512_shuffle_f64x2(c[2 * k], c[2 * k + 1], 0xDD));
    }
    return _mm512_add_pd(_mm512_unpacklo_pd(d[0], d[1]), _mm512_unpackhi_pd(d[0], d[1]));
}

static inline __attribute__((always_inline)) void
xdot_tile8(kvpi_rows kind, const double *q, size_t n, const void *rows, size_t at, size_t stride,
           double scale, double *out, size_t out_stride, const void *ahead, const int R,
           const int G)
{
    __m512d a[8];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 8; i++) {
        a[i] = _mm512_setzero_pd();
    }
    for (size_t f = 0; f < n; f += 8) {
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            group_ask(kind, ahead, at + (size_t)r * stride + f);
            __m512d x = vd_rows(kind, rows, at + (size_t)r * stride + f);
            _Pragma("GCC unroll 8")
            for (int h = 0; h < G; h++) {
                a[r * G + h] = _mm512_add_pd(a[r * G + h],
                                             _mm512_mul_pd(_mm512_loadu_pd(q + (size_t)h * n + f),
                                                           x));
            }
        }
    }
    double d[8];
    _mm512_storeu_pd(d, _mm512_mul_pd(trees8(a), _mm512_set1_pd(scale)));
    for (int i = 0; i < 8; i++) {
        out[(size_t)(i % G) * out_stride + (size_t)(i / G)] = d[2 * (i % 4) + i / 4];
    }
}

/* G heads (2, 4 or 8) over rows in tiles of 8 / G, the rest one row at a time. */
static inline __attribute__((always_inline)) void
xdot_tiled(kvpi_rows kind, const double *q, const void *rows, size_t stride, size_t count,
           size_t n, double scale, double *out, size_t out_stride, const void *ahead,
           const int G)
{
    const int R = 8 / G;
    size_t r = 0;
    for (; r + (size_t)R <= count; r += (size_t)R) {
        xdot_tile8(kind, q, n, rows, r * stride, stride, scale, out + r, out_stride, ahead, R,
                   G);
    }
    xdot_heads(kind, q, (const unsigned char *)rows + r * stride * kvpi_rows_bytes(kind), stride,
               count - r, n, scale, out + r, out_stride, G);
}

static inline __attribute__((always_inline)) void
xdot_tiled_kind(kvpi_rows kind, const double *q, size_t g, const void *rows, size_t stride,
                size_t count, size_t n, double scale, double *out, size_t out_stride,
                const void *ahead)
{
    size_t h = 0;
    while (h < g) {
        const double *qh = q + h * n;
        double *oh = out + h * out_stride;
        const void *ah = h == 0 ? ahead : NULL; /* the first tile reads from memory */
        size_t left = g - h;
        if (left >= 8) {
            xdot_tiled(kind, qh, rows, stride, count, n, scale, oh, out_stride, ah, 8);
            h += 8;
        } else if (left >= 4) {
            xdot_tiled(kind, qh, rows, stride, count, n, scale, oh, out_stride, ah, 4);
            h += 4;
        } else if (left >= 2) {
            xdot_tiled(kind, qh, rows, stride, count, n, scale, oh, out_stride, ah, 2);
            h += 2;
        } else {
            xdot_heads(kind, qh, rows, stride, count, n, scale, oh, out_stride, 1);
            h += 1;
        }
    }
}

/*
 * Several heads, n a multiple of 8: tiles of eight dots. Only f64 rows take
 * `ahead` (narrow rows are asked for by the gather; a literal NULL keeps the
 * hint's test out of their loops).
 */
static void xdot_group_tiled(kvpi_rows kind, const double *q, size_t g, const void *rows,
                             size_t stride, size_t count, size_t n, double scale, double *out,
                             size_t out_stride, const void *ahead)
{
    switch (kind) {
    case KVPI_ROWS_F64:
        xdot_tiled_kind(KVPI_ROWS_F64, q, g, rows, stride, count, n, scale, out, out_stride, ahead);
        return;
    case KVPI_ROWS_F32:
        xdot_tiled_kind(KVPI_ROWS_F32, q, g, rows, stride, count, n, scale, out, out_stride, NULL);
        return;
    case KVPI_ROWS_BF16:
        xdot_tiled_kind(KVPI_ROWS_BF16, q, g, rows, stride, count, n, scale, out, out_stride, NULL);
        return;
    case KVPI_ROWS_F16:
        xdot_tiled_kind(KVPI_ROWS_F16, q, g, rows, stride, count, n, scale, out, out_stride, NULL);
        return;
    default:
        xdot_tiled_kind(KVPI_ROWS_E4M3, q, g, rows, stride, count, n, scale, out, out_stride, NULL);
        return;
    }
}

/*
 * f64 rows of a group: the grouped tiles, each row read once and the next
 * block asked for as they go (`ahead`): f64 32/8 exact 67% -> 73-74% of read
 * against a head at a time (which was faster than the tiles while the
 * gather asked for nothing ahead). One head of f64, f32 or bf16 rows: the
 * four-rows-in-flight kernels above.
 */
static void avx512_dot_group(kvpi_rows kind, const double *q, size_t g, const void *rows,
                             size_t stride, size_t count, size_t n, double scale, double *out,
                             size_t out_stride, const void *ahead)
{
    if (kind == KVPI_ROWS_F64 && g > 1 && n % 8 == 0) {
        xdot_group_tiled(kind, q, g, rows, stride, count, n, scale, out, out_stride, ahead);
    } else if (kind == KVPI_ROWS_F64) {
        for (size_t h = 0; h < g; h++) {
            if (h == 0 && ahead != NULL) { /* the first head reads the rows from memory */
                avx512_dot_rows_ahead(q, rows, stride, count, n, scale, out, ahead);
            } else {
                avx512_dot_rows(q + h * n, rows, stride, count, n, scale, out + h * out_stride);
            }
        }
    } else if (g == 1 && kind == KVPI_ROWS_F32) {
        narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_F32);
    } else if (g == 1 && kind == KVPI_ROWS_BF16) {
        narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_BF16);
    } else if (g > 1 && n % 8 == 0) {
        xdot_group_tiled(kind, q, g, rows, stride, count, n, scale, out, out_stride, NULL);
    } else {
        group_dot(kind, q, g, rows, stride, count, n, scale, out, out_stride);
    }
}

static void avx512_axpy_group(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                              size_t w_stride, size_t g, const void *rows, size_t stride,
                              size_t count, size_t n, const void *ahead)
{
    if (kind == KVPI_ROWS_F64 && g > 1) {
        /* A group's tiles read each row once (f64 32/8 exact: 64% -> 67-68% of read). */
        group_axpy(kind, acc, acc_stride, w, w_stride, g, rows, stride, count, n, ahead);
    } else if (kind == KVPI_ROWS_F64) {
        for (size_t h = 0; h < g; h++) {
            avx512_axpy_rows_a(acc + h * acc_stride, w + h * w_stride, rows, stride, count, n,
                               h == 0 ? ahead : NULL);
        }
    } else if (g == 1 && kind == KVPI_ROWS_F32) {
        narrow_axpy_rows(acc, w, rows, stride, count, n, ROWS_F32);
    } else if (g == 1 && kind == KVPI_ROWS_BF16) {
        narrow_axpy_rows(acc, w, rows, stride, count, n, ROWS_BF16);
    } else {
        group_axpy(kind, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
    }
}

const kvpi_kernels kvpi_kernels_avx512 = {
    KVPI_ISA_AVX512, "avx512",    avx512_dot, avx512_dot_rows, avx512_axpy, avx512_axpy_rows,
    avx512_exps,     avx512_exp_sum, avx512_dot_rows_f32, avx512_dot_rows_bf16,
    avx512_axpy_rows_f32, avx512_axpy_rows_bf16, avx512_project_tile, AVX512_MR,
    AVX512_NR, avx512_dot_group, avx512_axpy_group, avx512_dot_group_fast, group_axpy_fast,
    group_softmax, group_softmax_fast,
};
