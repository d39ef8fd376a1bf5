/*
 * kernels_avx2.c: the AVX2 level of the dispatched kernels (x86-64 only;
 * compiled with -mavx2 -ffp-contract=off, so no FMA is ever emitted).
 *
 * Layout: a dot product keeps lanes 0-3 of the eight lane sums in one
 * register and lanes 4-7 in another, so lo + hi is the tree's first level
 * (t_l = s_l + s_{l+4}). dot_rows takes four rows at a time, each with its
 * own accumulators, so their add chains overlap in the core while memory is
 * still read row after row in address order (four rows read in lockstep, one
 * stream each, halved the DRAM bandwidth); their last two tree levels are
 * done together by one transpose-and-add. axpy over rows keeps 32 outputs in
 * eight registers while it walks a group of four rows in order, then the
 * next 32 columns of the same rows (still in L1), then the next group.
 * Every add takes its operands in the portable C's order (kernels.h).
 * Callers: through kvpi_kernels_level() only, after cpuid said AVX2.
 */
#include <immintrin.h>

#include "attention/kernels.h"
#include "attention/kernels_widen.h" /* kvpi_e4m3_8 */

/* [t_0 + t_2, t_1 + t_3] of a row's first-level sums t. */
static inline __m128d half_sums(__m256d t)
{
    return _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
}

/* Lane sums of a and b (f < 8 * floor(n / 8)) into lo (lanes 0-3) and hi (4-7). */
static inline __m256d first_level(const double *a, const double *b, size_t n8)
{
    __m256d lo = _mm256_setzero_pd();
    __m256d hi = _mm256_setzero_pd();
    for (size_t f = 0; f < n8; f += 8) {
        lo = _mm256_add_pd(lo, _mm256_mul_pd(_mm256_loadu_pd(a + f), _mm256_loadu_pd(b + f)));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(_mm256_loadu_pd(a + f + 4),
                                             _mm256_loadu_pd(b + f + 4)));
    }
    return _mm256_add_pd(lo, hi);
}

static double avx2_dot(const double *a, const double *b, size_t n)
{
    size_t n8 = n & ~(size_t)7;
    __m128d u = half_sums(first_level(a, b, n8));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (size_t f = n8; f < n; f++) {
        sum += a[f] * b[f];
    }
    return sum;
}

/* The dots of four rows from their first-level sums, in row order. */
static inline __m256d four_dots(__m256d t0, __m256d t1, __m256d t2, __m256d t3)
{
    /* [u0, u1] of rows 0 and 1, then of rows 2 and 3; u0 = t_0 + t_2, u1 = t_1 + t_3. */
    __m256d u01 = _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20),
                                _mm256_permute2f128_pd(t0, t1, 0x31));
    __m256d u23 = _mm256_add_pd(_mm256_permute2f128_pd(t2, t3, 0x20),
                                _mm256_permute2f128_pd(t2, t3, 0x31));
    __m256d dots = _mm256_hadd_pd(u01, u23); /* rows 0, 2, 1, 3: u0 + u1 */
    return _mm256_permute4x64_pd(dots, 0xD8);
}

static void avx2_dot_rows(const double *q, const double *rows, size_t stride, size_t count,
                          size_t n, double scale, double *out)
{
    size_t n8 = n & ~(size_t)7;
    size_t r = 0;
    for (; r + 4 <= count; r += 4) {
        const double *k0 = rows + r * stride;
        const double *k1 = k0 + stride;
        const double *k2 = k1 + stride;
        const double *k3 = k2 + stride;
        /* One row after another, so memory is read in address order. */
        __m256d t0 = first_level(q, k0, n8);
        __m256d t1 = first_level(q, k1, n8);
        __m256d t2 = first_level(q, k2, n8);
        __m256d t3 = first_level(q, k3, n8);
        __m256d dots = four_dots(t0, t1, t2, t3);
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
        out[r] = avx2_dot(q, rows + r * stride, n) * scale;
    }
}

static void avx2_axpy(double *acc, double weight, const double *v, size_t n)
{
    __m256d w = _mm256_set1_pd(weight);
    size_t f = 0;
    for (; f + 4 <= n; f += 4) {
        _mm256_storeu_pd(acc + f, _mm256_add_pd(_mm256_loadu_pd(acc + f),
                                                _mm256_mul_pd(w, _mm256_loadu_pd(v + f))));
    }
    for (; f < n; f++) {
        acc[f] += weight * v[f];
    }
}

/* Columns [f, f + 32) of axpy_rows, in eight registers. */
static inline void axpy_rows_32(double *acc, const double *weights, const double *rows,
                                size_t stride, size_t count)
{
    __m256d a[8];
    for (size_t j = 0; j < 8; j++) {
        a[j] = _mm256_loadu_pd(acc + 4 * j);
    }
    for (size_t r = 0; r < count; r++) {
        __m256d w = _mm256_set1_pd(weights[r]);
        const double *v = rows + r * stride;
        for (size_t j = 0; j < 8; j++) {
            a[j] = _mm256_add_pd(a[j], _mm256_mul_pd(w, _mm256_loadu_pd(v + 4 * j)));
        }
    }
    for (size_t j = 0; j < 8; j++) {
        _mm256_storeu_pd(acc + 4 * j, a[j]);
    }
}

/*
 * Rows go in groups of GROUP; for each group every 32-column pass runs before
 * the next group, so a group's lines are read while they are in L1 and the
 * memory stream stays in address order.
 */
#define GROUP 4 /* rows per group: measured best of 4, 8, 16 for d_h = 64 in DRAM */
static void avx2_axpy_rows(double *acc, const double *weights, const double *rows, size_t stride,
                           size_t count, size_t n)
{
    for (size_t g = 0; g < count; g += GROUP) {
        size_t c = count - g < GROUP ? count - g : GROUP;
        const double *grows = rows + g * stride;
        const double *gw = weights + g;
        size_t f = 0;
        for (; f + 32 <= n; f += 32) {
            axpy_rows_32(acc + f, gw, grows + f, stride, c);
        }
        for (; f + 4 <= n; f += 4) {
            __m256d a = _mm256_loadu_pd(acc + f);
            for (size_t r = 0; r < c; r++) {
                a = _mm256_add_pd(a, _mm256_mul_pd(_mm256_set1_pd(gw[r]),
                                                   _mm256_loadu_pd(grows + r * stride + f)));
            }
            _mm256_storeu_pd(acc + f, a);
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

/* kvpi_exp of four lanes: its steps in its order (kernels.h). */
static inline __m256d exp4(__m256d x)
{
    __m256d min = _mm256_set1_pd(KVPI_EXP_MIN);
    __m256d shift = _mm256_set1_pd(KVPI_EXP_SHIFT);
    __m256d xc = _mm256_max_pd(x, min);
    __m256d shifted = _mm256_add_pd(_mm256_mul_pd(xc, _mm256_set1_pd(KVPI_EXP_INV_LN2)), shift);
    __m256d k = _mm256_sub_pd(shifted, shift);
    __m256i bits = _mm256_add_epi64(_mm256_castpd_si256(shifted),
                                    _mm256_set1_epi64x(KVPI_EXP_BIAS));
    __m256d up = _mm256_castsi256_pd(_mm256_slli_epi64(bits, 52));
    __m256d hi = _mm256_sub_pd(xc, _mm256_mul_pd(k, _mm256_set1_pd(KVPI_EXP_LN2_HI)));
    __m256d lo = _mm256_mul_pd(k, _mm256_set1_pd(KVPI_EXP_LN2_LO));
    __m256d r = _mm256_sub_pd(hi, lo);
    __m256d t = _mm256_mul_pd(r, r);
    __m256d p = _mm256_add_pd(_mm256_set1_pd(KVPI_EXP_P4),
                              _mm256_mul_pd(t, _mm256_set1_pd(KVPI_EXP_P5)));
    p = _mm256_add_pd(_mm256_set1_pd(KVPI_EXP_P3), _mm256_mul_pd(t, p));
    p = _mm256_add_pd(_mm256_set1_pd(KVPI_EXP_P2), _mm256_mul_pd(t, p));
    p = _mm256_add_pd(_mm256_set1_pd(KVPI_EXP_P1), _mm256_mul_pd(t, p));
    __m256d c = _mm256_sub_pd(r, _mm256_mul_pd(t, p));
    __m256d q = _mm256_div_pd(_mm256_mul_pd(r, c), _mm256_sub_pd(_mm256_set1_pd(2.0), c));
    __m256d y = _mm256_sub_pd(_mm256_set1_pd(1.0), _mm256_sub_pd(_mm256_sub_pd(lo, q), hi));
    __m256d e = _mm256_mul_pd(_mm256_mul_pd(y, up), _mm256_set1_pd(KVPI_EXP_DOWN));
    return _mm256_and_pd(e, _mm256_cmp_pd(x, min, _CMP_GE_OQ));
}

static void avx2_exps(const double *x, double *y, size_t n)
{
    size_t f = 0;
    for (; f + 4 <= n; f += 4) {
        _mm256_storeu_pd(y + f, exp4(_mm256_loadu_pd(x + f)));
    }
    for (; f < n; f++) {
        y[f] = kvpi_exp(x[f]);
    }
}

/* Lanes 0-3 of the eight lane sums in lo, 4-7 in hi, as avx2_dot keeps them. */
static double avx2_exp_sum(double *s, size_t n, double shift)
{
    __m256d sh = _mm256_set1_pd(shift);
    __m256d lo = _mm256_setzero_pd();
    __m256d hi = _mm256_setzero_pd();
    size_t f = 0;
    for (; f + 8 <= n; f += 8) {
        __m256d e0 = exp4(_mm256_sub_pd(_mm256_loadu_pd(s + f), sh));
        __m256d e1 = exp4(_mm256_sub_pd(_mm256_loadu_pd(s + f + 4), sh));
        _mm256_storeu_pd(s + f, e0);
        _mm256_storeu_pd(s + f + 4, e1);
        lo = _mm256_add_pd(lo, e0);
        hi = _mm256_add_pd(hi, e1);
    }
    __m128d u = half_sums(_mm256_add_pd(lo, hi));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (; f < n; f++) {
        s[f] = kvpi_exp(s[f] - shift);
        sum += s[f];
    }
    return sum;
}

/*
 * Rows stored as f32 or bf16. Four elements are widened to four doubles in
 * one register (f32: vcvtps2pd; bf16: zero-extend to 32 bits, shift into an
 * f32's top half, then vcvtps2pd), exact, and then every kernel below is its
 * f64 twin above with that load in place of _mm256_loadu_pd: the same
 * products, adds, registers and order, so the same bits. Half (f32) or a
 * quarter (bf16) of the bytes per row come from memory.
 */
typedef enum row_kind { ROWS_F32, ROWS_BF16 } row_kind;

static inline __attribute__((always_inline)) __m256d load4(const void *rows, size_t i,
                                                           row_kind kind)
{
    if (kind == ROWS_F32) {
        return _mm256_cvtps_pd(_mm_loadu_ps((const float *)rows + i));
    }
    __m128i h = _mm_loadl_epi64((const __m128i *)(const void *)((const uint16_t *)rows + i));
    return _mm256_cvtps_pd(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)));
}

static inline double widen(const void *rows, size_t i, row_kind kind)
{
    return kind == ROWS_F32 ? (double)((const float *)rows)[i]
                            : kvpi_bf16_widen(((const uint16_t *)rows)[i]);
}

/* first_level with the row's elements at rows[at ..]. */
static inline __attribute__((always_inline)) __m256d
narrow_first_level(const double *a, const void *rows, size_t at, size_t n8, row_kind kind)
{
    __m256d lo = _mm256_setzero_pd();
    __m256d hi = _mm256_setzero_pd();
    for (size_t f = 0; f < n8; f += 8) {
        lo = _mm256_add_pd(lo, _mm256_mul_pd(_mm256_loadu_pd(a + f), load4(rows, at + f, kind)));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(_mm256_loadu_pd(a + f + 4),
                                             load4(rows, at + f + 4, kind)));
    }
    return _mm256_add_pd(lo, hi);
}

static inline __attribute__((always_inline)) double narrow_dot(const double *a, const void *rows,
                                                               size_t at, size_t n,
                                                               row_kind kind)
{
    size_t n8 = n & ~(size_t)7;
    __m128d u = half_sums(narrow_first_level(a, rows, at, n8, kind));
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
        __m256d t0 = narrow_first_level(q, rows, at, n8, kind);
        __m256d t1 = narrow_first_level(q, rows, at + stride, n8, kind);
        __m256d t2 = narrow_first_level(q, rows, at + 2 * stride, n8, kind);
        __m256d t3 = narrow_first_level(q, rows, at + 3 * stride, n8, kind);
        __m256d dots = four_dots(t0, t1, t2, t3);
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

/* axpy_rows_32 with the rows' elements at rows[at + r * stride ..]. */
static inline __attribute__((always_inline)) void
narrow_axpy_rows_32(double *acc, const double *weights, const void *rows, size_t at,
                    size_t stride, size_t count, row_kind kind)
{
    __m256d a[8];
    for (size_t j = 0; j < 8; j++) {
        a[j] = _mm256_loadu_pd(acc + 4 * j);
    }
    for (size_t r = 0; r < count; r++) {
        __m256d w = _mm256_set1_pd(weights[r]);
        size_t v = at + r * stride;
        for (size_t j = 0; j < 8; j++) {
            a[j] = _mm256_add_pd(a[j], _mm256_mul_pd(w, load4(rows, v + 4 * j, kind)));
        }
    }
    for (size_t j = 0; j < 8; j++) {
        _mm256_storeu_pd(acc + 4 * j, a[j]);
    }
}

static inline __attribute__((always_inline)) void
narrow_axpy_rows(double *acc, const double *weights, const void *rows, size_t stride,
                 size_t count, size_t n, row_kind kind)
{
    for (size_t g = 0; g < count; g += GROUP) {
        size_t c = count - g < GROUP ? count - g : GROUP;
        size_t at = g * stride;
        const double *gw = weights + g;
        size_t f = 0;
        for (; f + 32 <= n; f += 32) {
            narrow_axpy_rows_32(acc + f, gw, rows, at + f, stride, c, kind);
        }
        for (; f + 4 <= n; f += 4) {
            __m256d a = _mm256_loadu_pd(acc + f);
            for (size_t r = 0; r < c; r++) {
                a = _mm256_add_pd(a, _mm256_mul_pd(_mm256_set1_pd(gw[r]),
                                                   load4(rows, at + r * stride + f, kind)));
            }
            _mm256_storeu_pd(acc + f, a);
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

static void avx2_dot_rows_f32(const double *q, const float *rows, size_t stride, size_t count,
                              size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_F32);
}

static void avx2_dot_rows_bf16(const double *q, const uint16_t *rows, size_t stride,
                               size_t count, size_t n, double scale, double *out)
{
    narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_BF16);
}

static void avx2_axpy_rows_f32(double *acc, const double *weights, const float *rows,
                               size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_F32);
}

static void avx2_axpy_rows_bf16(double *acc, const double *weights, const uint16_t *rows,
                                size_t stride, size_t count, size_t n)
{
    narrow_axpy_rows(acc, weights, rows, stride, count, n, ROWS_BF16);
}

/*
 * kvpi_project_rows's tile: up to 4 rows x 8 columns of sums in eight
 * registers (two per row), i outermost; each sum takes acc + x * w, as the
 * portable C. A tile narrower than 8 columns loads and stores through lane
 * masks, so columns past n are never touched.
 */
#define AVX2_MR 4
#define AVX2_NR 8

static inline __attribute__((always_inline)) void
avx2_tile(const double *x, size_t x_stride, const double *w, size_t w_stride, size_t k,
          double *y, size_t y_stride, int first, const size_t mr, const __m256i mask[2],
          const int masked)
{
    __m256d acc[AVX2_MR][2];
    _Pragma("GCC unroll 8")
    for (size_t r = 0; r < mr; r++) {
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 2; v++) {
            const double *at = y + r * y_stride + 4 * v;
            acc[r][v] = first    ? _mm256_setzero_pd()
                        : masked ? _mm256_maskload_pd(at, mask[v])
                                 : _mm256_loadu_pd(at);
        }
    }
    for (size_t i = 0; i < k; i++) {
        const double *wi = w + i * w_stride;
        __m256d wv[2];
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 2; v++) {
            wv[v] = masked ? _mm256_maskload_pd(wi + 4 * v, mask[v]) : _mm256_loadu_pd(wi + 4 * v);
        }
        _Pragma("GCC unroll 8")
        for (size_t r = 0; r < mr; r++) {
            __m256d xi = _mm256_broadcast_sd(x + r * x_stride + i);
            _Pragma("GCC unroll 8")
            for (size_t v = 0; v < 2; v++) {
                acc[r][v] = _mm256_add_pd(acc[r][v], _mm256_mul_pd(xi, wv[v]));
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (size_t r = 0; r < mr; r++) {
        _Pragma("GCC unroll 8")
        for (size_t v = 0; v < 2; v++) {
            double *at = y + r * y_stride + 4 * v;
            if (masked) {
                _mm256_maskstore_pd(at, mask[v], acc[r][v]);
            } else {
                _mm256_storeu_pd(at, acc[r][v]);
            }
        }
    }
}

static void avx2_project_tile(const double *x, size_t x_stride, size_t mr, const double *w,
                              size_t w_stride, size_t k, size_t n, double *y, size_t y_stride,
                              int first)
{
    __m256i mask[2];
    for (size_t v = 0; v < 2; v++) {
        long long lane[4];
        for (size_t l = 0; l < 4; l++) {
            lane[l] = 4 * v + l < n ? -1 : 0;
        }
        mask[v] = _mm256_setr_epi64x(lane[0], lane[1], lane[2], lane[3]);
    }
    int masked = n < AVX2_NR;
#define AVX2_TILE(rows)                                                                          \
    (masked ? avx2_tile(x, x_stride, w, w_stride, k, y, y_stride, first, rows, mask, 1)         \
            : avx2_tile(x, x_stride, w, w_stride, k, y, y_stride, first, rows, mask, 0))
    switch (mr) {
    case 4:
        AVX2_TILE(4);
        break;
    case 3:
        AVX2_TILE(3);
        break;
    case 2:
        AVX2_TILE(2);
        break;
    default:
        AVX2_TILE(1);
        break;
    }
#undef AVX2_TILE
}


/* ---- grouped kernels, the fast level and the softmax (kernels_group.h) ---------- */

/* Eight narrow elements at i widened to f32 (exact), in one register. */
static inline __attribute__((always_inline)) __m256 narrow8(kvpi_rows kind, const void *rows,
                                                            size_t i)
{
    const void *p;
    switch (kind) {
    case KVPI_ROWS_BF16:
        p = (const uint16_t *)rows + i;
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    case KVPI_ROWS_F16:
        p = (const uint16_t *)rows + i;
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    case KVPI_ROWS_E4M3:
        p = (const uint8_t *)rows + i;
        return kvpi_e4m3_8(p);
    default:
        return _mm256_loadu_ps((const float *)rows + i);
    }
}

/* Eight doubles as lanes 0-3 and 4-7; sixteen floats as lanes 0-7 and 8-15. */
typedef struct VD {
    __m256d lo, hi;
} VD;
typedef struct VF {
    __m256 lo, hi;
} VF;
#define GROUP_GMAX 4
#define XCOLS(G) ((G) >= 4 ? 1 : (G) >= 2 ? 2 : 4) /* 2 x G x C <= 8 of 16 registers */
#define FCOLS(G) XCOLS(G)

#define AVX2_AI static inline __attribute__((always_inline))
AVX2_AI VD vd_zero(void) { return (VD){_mm256_setzero_pd(), _mm256_setzero_pd()}; }
AVX2_AI VD vd_loadu(const double *p) { return (VD){_mm256_loadu_pd(p), _mm256_loadu_pd(p + 4)}; }
AVX2_AI VD vd_set1(double x) { return (VD){_mm256_set1_pd(x), _mm256_set1_pd(x)}; }
AVX2_AI VD vd_add(VD a, VD b) { return (VD){_mm256_add_pd(a.lo, b.lo), _mm256_add_pd(a.hi, b.hi)}; }
AVX2_AI VD vd_mul(VD a, VD b) { return (VD){_mm256_mul_pd(a.lo, b.lo), _mm256_mul_pd(a.hi, b.hi)}; }
AVX2_AI void vd_storeu(double *p, VD x)
{
    _mm256_storeu_pd(p, x.lo);
    _mm256_storeu_pd(p + 4, x.hi);
}

AVX2_AI double vd_tree(VD s)
{
    __m128d u = half_sums(_mm256_add_pd(s.lo, s.hi));
    return _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
}

AVX2_AI VD vd_rows(kvpi_rows kind, const void *rows, size_t i)
{
    if (kind == KVPI_ROWS_F64) {
        return vd_loadu((const double *)rows + i);
    }
    __m256 x = narrow8(kind, rows, i);
    return (VD){_mm256_cvtps_pd(_mm256_castps256_ps128(x)), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))};
}

AVX2_AI VF vf_zero(void) { return (VF){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
AVX2_AI VF vf_loadu(const float *p) { return (VF){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
AVX2_AI VF vf_set1(float x) { return (VF){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
AVX2_AI VF vf_fma(VF a, VF b, VF c)
{
    return (VF){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
AVX2_AI void vf_storeu(float *p, VF x)
{
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
}

#define AVX2_VF2(name, op)                                                                  \
    AVX2_AI VF name(VF a, VF b) { return (VF){op(a.lo, b.lo), op(a.hi, b.hi)}; }
AVX2_VF2(vf_add, _mm256_add_ps)
AVX2_VF2(vf_sub, _mm256_sub_ps)
AVX2_VF2(vf_mul, _mm256_mul_ps)
AVX2_VF2(vf_div, _mm256_div_ps)
AVX2_VF2(vf_max, _mm256_max_ps)
AVX2_AI float vf_hmax(VF a)
{
    __m256 m = _mm256_max_ps(a.lo, a.hi);
    __m128 u = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    u = _mm_max_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_max_ss(u, _mm_shuffle_ps(u, u, 1)));
}
/* 2^(k + 64) for integral k in [-160, 0]: the biased exponent shifted into place. */
AVX2_AI __m256 pow2_64_8(__m256 k)
{
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(64 + 127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
AVX2_AI VF vf_pow2_64(VF k) { return (VF){pow2_64_8(k.lo), pow2_64_8(k.hi)}; }

/* kvpi_fast_tree: lanes l + 8 (lo + hi), then l + 4, l + 2, l + 1. */
AVX2_AI float vf_tree(VF s)
{
    __m256 t = _mm256_add_ps(s.lo, s.hi);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

AVX2_AI VF vf_rows(kvpi_rows kind, const void *rows, size_t i)
{
    return (VF){narrow8(kind, rows, i), narrow8(kind, rows, i + 8)};
}

/* The maximum of s[0..n): exact, so any order gives it (a zero's sign aside, which exp ignores). */
static double level_max(const double *s, size_t n)
{
    __m256d m = _mm256_set1_pd(s[0]);
    size_t f = 0;
    for (; f + 4 <= n; f += 4) {
        m = _mm256_max_pd(m, _mm256_loadu_pd(s + f));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, m);
    double max = lanes[0];
    for (size_t l = 1; l < 4; l++) {
        max = lanes[l] > max ? lanes[l] : max;
    }
    for (; f < n; f++) {
        max = s[f] > max ? s[f] : max;
    }
    return max;
}

#define level_exp_sum avx2_exp_sum

static void level_div(double *s, size_t n, double sum)
{
    __m256d d = _mm256_set1_pd(sum);
    size_t f = 0;
    for (; f + 4 <= n; f += 4) {
        _mm256_storeu_pd(s + f, _mm256_div_pd(_mm256_loadu_pd(s + f), d));
    }
    for (; f < n; f++) {
        s[f] /= sum;
    }
}

#include "attention/kernels_group.h"

/*
 * f64 rows, and one head of f32 or bf16 rows: the four-rows-in-flight
 * kernels above, a head at a time. f64 rows need no widening, and a KV
 * head's block (16 KiB at d_h 128, block 16) stays in L1 for its group;
 * measured faster than the grouped tiles (bench-decode, f64 32/8 heads).
 */
static void avx2_dot_group(kvpi_rows kind, const double *q, size_t g, const void *rows,
                           size_t stride, size_t count, size_t n, double scale, double *out,
                           size_t out_stride, const void *ahead)
{
    (void)ahead; /* a hint this level does not take */
    if (kind == KVPI_ROWS_F64) {
        for (size_t h = 0; h < g; h++) {
            avx2_dot_rows(q + h * n, rows, stride, count, n, scale, out + h * out_stride);
        }
    } else if (g == 1 && kind == KVPI_ROWS_F32) {
        narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_F32);
    } else if (g == 1 && kind == KVPI_ROWS_BF16) {
        narrow_dot_rows(q, rows, stride, count, n, scale, out, ROWS_BF16);
    } else {
        group_dot(kind, q, g, rows, stride, count, n, scale, out, out_stride);
    }
}

static void avx2_axpy_group(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                            size_t w_stride, size_t g, const void *rows, size_t stride,
                            size_t count, size_t n, const void *ahead)
{
    (void)ahead; /* a hint this level does not take */
    if (kind == KVPI_ROWS_F64) {
        for (size_t h = 0; h < g; h++) {
            avx2_axpy_rows(acc + h * acc_stride, w + h * w_stride, rows, stride, count, n);
        }
    } else if (g == 1 && kind == KVPI_ROWS_F32) {
        narrow_axpy_rows(acc, w, rows, stride, count, n, ROWS_F32);
    } else if (g == 1 && kind == KVPI_ROWS_BF16) {
        narrow_axpy_rows(acc, w, rows, stride, count, n, ROWS_BF16);
    } else {
        group_axpy(kind, acc, acc_stride, w, w_stride, g, rows, stride, count, n, NULL);
    }
}

const kvpi_kernels kvpi_kernels_avx2 = {
    KVPI_ISA_AVX2,  "avx2",    avx2_dot, avx2_dot_rows, avx2_axpy, avx2_axpy_rows,
    avx2_exps, avx2_exp_sum, avx2_dot_rows_f32, avx2_dot_rows_bf16, avx2_axpy_rows_f32,
    avx2_axpy_rows_bf16, avx2_project_tile, AVX2_MR, AVX2_NR, avx2_dot_group,
    avx2_axpy_group, group_dot_fast, group_axpy_fast, group_softmax, group_softmax_fast,
};
