/*
 * kernels.h: the arithmetic shared by the incremental path and the
 * full-prefix reference, so both perform the same operations in the same
 * order and agree to the last bit wherever their inputs agree.
 *
 * Owns: projections, dot products, axpy, exp, the stable softmax, and RoPE
 * rotation without checks. Pure functions; callers validate sizes.
 * Callers: src/attention, src/serve (projections), bench/ and tests/.
 *
 * Dot products, axpy and exp come from one function table (dispatch.c) filled
 * once with the best level the CPU has: AVX-512F, AVX2, or portable C
 * (kernels_scalar.c, the reference every other level is tested against).
 * KVP_ISA=scalar|avx2|avx512 forces a level.
 *
 * Exactness, the contract every level keeps:
 *   - No fused multiply-add anywhere: every product is rounded, then added,
 *     as in the portable C (which cannot contract: ISO C mode, and the kernel
 *     files are compiled with -ffp-contract=off). So the levels agree bit for
 *     bit, under Valgrind too, and axpy is exactly `acc[f] + w * v[f]`.
 *   - One summation order for a dot product of length n, whatever the level,
 *     the number of rows in flight or the page size:
 *       s_l = sum of a[f] * b[f] over f = l (mod 8), f < 8 * floor(n / 8),
 *             added in increasing f into s_l = +0.0, for l = 0..7;
 *       t_l = s_l + s_{l+4} (l < 4);   dot = (t_0 + t_2) + (t_1 + t_3);
 *       then dot += a[f] * b[f] for the tail f = 8 * floor(n / 8) .. n-1.
 *     For n < 8 this is the plain left-to-right sum.
 *   - axpy over several rows adds row by row in the rows' order, so it equals
 *     one axpy per row.
 *   - Rows stored as f32 or bf16 (the pages of a KVP_F32 or KVP_BF16 pool):
 *     the *_f32 and *_bf16 kernels widen each element to f64 (exact) and then
 *     do exactly what the f64 kernel does, in its order, so each equals the
 *     f64 kernel applied to the widened rows, bit for bit, at every level.
 *     Only the rows are narrow; q, weights and acc are f64.
 *   - Rows of any format (kvpi_rows: f64, f32, bf16, f16, e4m3): the grouped
 *     kernels dot_group/axpy_group equal dot_rows/axpy_rows on the widened
 *     rows, one head at a time, for any number of heads.
 *   - exp is kvpi_exp below, lane by lane: the same operations in the same
 *     order, each one IEEE-rounded (add, sub, mul, div), so every level gives
 *     its bits. The softmax's sum of exps uses the dot product's order (eight
 *     lane sums, the same tree, then the tail), whatever the level.
 *
 * Fast accumulation (the *_fast entries; docs/DESIGN.md, Accumulation
 * levels): the one place that fuses. f32 queries, weights and accumulators,
 * narrow rows widened to f32 (exact); a dot product is kvpi_fast_dot below
 * (sixteen fmaf lane sums, kvpi_fast_tree, an fmaf tail), an axpy is
 * acc = fmaf(w, v, acc) per element, rows in order; the softmax is f32 in
 * base 2 with our own exp2f (kvpi_softmax_fast_ref). The vector levels use
 * FMA instructions (explicit intrinsics; -ffp-contract=off still holds),
 * the portable level libm's correctly rounded fmaf: every level gives the
 * portable bits.
 */
#ifndef KVPAGER_ATTENTION_KERNELS_H
#define KVPAGER_ATTENTION_KERNELS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvpager/types.h"

/*
 * Formats of stored rows the grouped kernels read; the values are kvp_dtype's
 * (kvpager/pool.h), so a pool's dtype converts directly.
 *   F64, F32    IEEE binary64, binary32.
 *   BF16        the top 16 bits of a binary32.
 *   F16         IEEE binary16 (F16C's vcvtph2ps where the level has it).
 *   E4M3        OCP fp8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 fraction
 *               bits; no infinities; S.1111.111 is NaN; largest 448,
 *               smallest subnormal 2^-9. The element only: a cache's fp8
 *               scales are applied by the caller (gather.c).
 * Every format widens exactly to f32 (kvpi_f16_widen, kvpi_e4m3_widen below)
 * and so to f64.
 */
typedef enum kvpi_rows {
    KVPI_ROWS_F64 = 0,
    KVPI_ROWS_F32 = 1,
    KVPI_ROWS_BF16 = 2,
    KVPI_ROWS_F16 = 3,
    KVPI_ROWS_E4M3 = 4
} kvpi_rows;

/* Bytes of one element of each format. */
static inline size_t kvpi_rows_bytes(kvpi_rows kind)
{
    static const unsigned char bytes[] = {8, 4, 2, 2, 1};
    return bytes[kind];
}

/* Instruction set levels, weakest first. */
typedef enum kvpi_isa {
    KVPI_ISA_SCALAR = 0,
    KVPI_ISA_AVX2 = 1,
    KVPI_ISA_AVX512 = 2,
    KVPI_ISA_COUNT = 3
} kvpi_isa;

/* One level's implementations; every entry keeps the contract above. */
typedef struct kvpi_kernels {
    kvpi_isa isa;
    const char *name; /* "scalar", "avx2", "avx512": KVP_ISA's values */
    /* The dot product of a[0..n) and b[0..n). */
    double (*dot)(const double *a, const double *b, size_t n);
    /* out[r] = dot(q, rows + r * stride, n) * scale for r < count. */
    void (*dot_rows)(const double *q, const double *rows, size_t stride, size_t count, size_t n,
                     double scale, double *out);
    /* acc[f] = acc[f] + weight * v[f] for f < n. */
    void (*axpy)(double *acc, double weight, const double *v, size_t n);
    /* axpy(acc, weights[r], rows + r * stride, n) for r = 0 .. count-1, in order. */
    void (*axpy_rows)(double *acc, const double *weights, const double *rows, size_t stride,
                      size_t count, size_t n);
    /* y[i] = kvpi_exp(x[i]) for i < n; x[i] <= 0 (or -inf), never NaN. */
    void (*exps)(const double *x, double *y, size_t n);
    /*
     * s[i] = kvpi_exp(s[i] - shift) for i < n, where every s[i] - shift <= 0;
     * returns the sum of the new s[i] in the dot product's order (kernels.h).
     */
    double (*exp_sum)(double *s, size_t n, double shift);
    /*
     * dot_rows and axpy_rows over rows stored as f32 or as bf16 bits (stride
     * in elements): equal to the f64 kernel on the widened rows, bit for bit.
     */
    void (*dot_rows_f32)(const double *q, const float *rows, size_t stride, size_t count,
                         size_t n, double scale, double *out);
    void (*dot_rows_bf16)(const double *q, const uint16_t *rows, size_t stride, size_t count,
                          size_t n, double scale, double *out);
    void (*axpy_rows_f32)(double *acc, const double *weights, const float *rows, size_t stride,
                          size_t count, size_t n);
    void (*axpy_rows_bf16)(double *acc, const double *weights, const uint16_t *rows,
                           size_t stride, size_t count, size_t n);
    /*
     * The register tile of kvpi_project_rows, for mr <= project_mr rows and
     * n <= project_nr columns: y[r][j] = (first ? +0.0 : y[r][j]) + x[r][i] *
     * w[i][j], added for i = 0 .. k-1 in order (x[r][i] at x[r * x_stride +
     * i], w[i][j] at w[i * w_stride + j], y[r][j] at y[r * y_stride + j]).
     * Columns j >= n of w and y are never read or written.
     */
    void (*project_tile)(const double *x, size_t x_stride, size_t mr, const double *w,
                         size_t w_stride, size_t k, size_t n, double *y, size_t y_stride,
                         int first);
    size_t project_mr; /* rows of the tile (at most KVPI_PROJECT_MAX_MR) */
    size_t project_nr; /* columns of the tile (at most KVPI_PROJECT_MAX_NR) */
    /*
     * Grouped kernels (GQA): the g query heads of one KV head against `count`
     * stored rows of `kind` (stride in elements), each row read and widened
     * once for all g heads. Any g >= 1; q is packed [g][n].
     *   dot_group:  out[h * out_stride + r] = dot(q + h * n, widened row r, n)
     *               * scale, exactly dot_rows on the widened rows (Exactness).
     *   axpy_group: for h < g, rows r in order: acc[h * acc_stride + f] +=
     *               w[h * w_stride + r] * widened row r [f], f < n: exactly g
     *               axpy_rows on the widened rows.
     * ahead: NULL, or the rows the caller reads next, as in dot_group_fast
     * below; here only the AVX-512 level's f64 rows ask for them (other rows
     * and levels ignore it). Never read, never a result's bit.
     */
    void (*dot_group)(kvpi_rows kind, const double *q, size_t g, const void *rows, size_t stride,
                      size_t count, size_t n, double scale, double *out, size_t out_stride,
                      const void *ahead);
    void (*axpy_group)(kvpi_rows kind, double *acc, size_t acc_stride, const double *w,
                       size_t w_stride, size_t g, const void *rows, size_t stride, size_t count,
                       size_t n, const void *ahead);
    /*
     * The fast level (Fast accumulation, below) of the same two, for narrow
     * rows (kind != KVPI_ROWS_F64): q, w and acc are f32.
     *   dot_group_fast:  out[h * out_stride + r] = kvpi_fast_dot(q + h * n,
     *                    row r, n), f32 (the caller folds the scale into q).
     *   axpy_group_fast: acc[h * acc_stride + f] = fmaf(w[h * w_stride + r],
     *                    row r [f], acc[..]) for rows r in order.
     * ahead: NULL, or rows laid out as `rows` (same stride, count and n) that
     * the caller reads next (the next block's). The vector levels ask for
     * them (a prefetch) as they consume the matching bytes of `rows`, one
     * request per 64 bytes spread over the work, so memory streams while
     * they compute; requests in a burst stall until the fill buffers free,
     * which serializes memory and compute. Never read, never a result's bit.
     */
    void (*dot_group_fast)(kvpi_rows kind, const float *q, size_t g, const void *rows,
                           size_t stride, size_t count, size_t n, float *out, size_t out_stride,
                           const void *ahead);
    void (*axpy_group_fast)(kvpi_rows kind, float *acc, size_t acc_stride, const float *w,
                            size_t w_stride, size_t g, const void *rows, size_t stride,
                            size_t count, size_t n, const void *ahead);
    /* kvpi_softmax (below), the bits of the portable level. */
    void (*softmax)(double *s, size_t n);
    /* kvpi_softmax_fast_ref (below) in place on s[0..n): the portable level's bits. */
    void (*softmax_fast)(float *s, size_t n);
} kvpi_kernels;

/* Bounds of every level's projection tile (kvpi_project_rows packs W slivers this wide). */
#define KVPI_PROJECT_MAX_MR 8
#define KVPI_PROJECT_MAX_NR 32

/* The active level: chosen once (thread-safe), from the CPU and KVP_ISA. Never NULL. */
const kvpi_kernels *kvpi_kernels_active(void);

/*
 * The table of `isa` if it is built into this binary and the CPU runs it,
 * else NULL. For tests and benchmarks, which compare levels.
 */
const kvpi_kernels *kvpi_kernels_level(kvpi_isa isa);

/* The best level this binary and CPU support. */
kvpi_isa kvpi_kernels_best(void);

/*
 * Makes `isa` the active level: returns 0, or -1 (nothing changed) when
 * kvpi_kernels_level(isa) is NULL. For tests and benchmarks only: call it
 * while no other thread uses the kernels.
 */
int kvpi_kernels_use(kvpi_isa isa);

/* "scalar", "avx2", "avx512"; parse returns 0 and writes *isa, or -1. */
const char *kvpi_isa_name(kvpi_isa isa);
int kvpi_isa_parse(const char *name, kvpi_isa *isa);

/* The per-level tables (kernels_<level>.c); use kvpi_kernels_level instead. */
extern const kvpi_kernels kvpi_kernels_scalar;
#if defined(KVPI_X86_KERNELS)
extern const kvpi_kernels kvpi_kernels_avx2;
extern const kvpi_kernels kvpi_kernels_avx512;
#endif

/*
 * The tree and tail of the summation order above, for every level: s holds
 * the eight lane sums; adds a[f] * b[f] for f = from .. n-1 after the tree.
 */
static inline double kvpi_dot_finish(const double s[8], const double *a, const double *b,
                                     size_t from, size_t n)
{
    double t0 = s[0] + s[4];
    double t1 = s[1] + s[5];
    double t2 = s[2] + s[6];
    double t3 = s[3] + s[7];
    double sum = (t0 + t2) + (t1 + t3);
    for (size_t f = from; f < n; f++) {
        sum += a[f] * b[f];
    }
    return sum;
}

/* bf16 bits widened to f64 (exact): bf16 is the top half of an f32. */
static inline double kvpi_bf16_widen(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

/*
 * binary16 bits widened to f32 (exact), portably: the bits of F16C's
 * vcvtph2ps, a signalling NaN quieted as it does.
 */
static inline float kvpi_f16_widen(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    uint32_t bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x400000u : 0);
    } else if (e == 0) {
        float f = (float)m * 0x1p-24f; /* subnormal: m * 2^-24, exact in f32 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* The f32 bits of an e4m3 NaN with the sign of `x` (0x7F and 0xFF). */
#define KVPI_E4M3_NAN_BITS 0x7FC00000u

/*
 * e4m3 bits widened to f32 (exact), by bits: sign | exponent-and-fraction
 * << 20 is a binary32 of value 2^(e - 127) (1 + m/8) (2^-149 * (m << 20) for
 * e = 0), and one exact product with 2^120 rebiases it to e4m3's 2^(e - 7)
 * (1 + m/8) and m 2^-9. The vector levels give the same bits another way,
 * so that no operand is an f32 subnormal (a microcode assist that made fp8
 * pages 8x slower than bf16): the bits as an f16 of the value times 2^-8,
 * vcvtph2ps, and a product with 2^8 (kernels_widen.h). No table at any
 * level; tests/test_fast_kernels.c checks every code at every level.
 */
static inline float kvpi_e4m3_widen(uint8_t x)
{
    uint32_t sign = (uint32_t)(x & 0x80u) << 24;
    uint32_t bits = sign | ((uint32_t)(x & 0x7Fu) << 20);
    if ((x & 0x7Fu) == 0x7Fu) {
        bits = sign | KVPI_E4M3_NAN_BITS;
        float nan;
        memcpy(&nan, &bits, sizeof nan);
        return nan;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f * 0x1p120f;
}

/* Element i of rows of `kind`, widened to f32 (exact; not for F64). */
static inline float kvpi_rows_widen_f32(kvpi_rows kind, const void *rows, size_t i)
{
    switch (kind) {
    case KVPI_ROWS_F32:
        return ((const float *)rows)[i];
    case KVPI_ROWS_BF16:
        return (float)kvpi_bf16_widen(((const uint16_t *)rows)[i]);
    case KVPI_ROWS_F16:
        return kvpi_f16_widen(((const uint16_t *)rows)[i]);
    default:
        return kvpi_e4m3_widen(((const uint8_t *)rows)[i]);
    }
}

/* Element i of rows of `kind`, widened to f64 (exact). */
static inline double kvpi_rows_widen(kvpi_rows kind, const void *rows, size_t i)
{
    return kind == KVPI_ROWS_F64 ? ((const double *)rows)[i]
                                 : (double)kvpi_rows_widen_f32(kind, rows, i);
}

/*
 * The fast level's tree over sixteen f32 lane sums s_l: t_l = s_l + s_{l+8},
 * u_l = t_l + t_{l+4}, v_l = u_l + u_{l+2}, then v_0 + v_1.
 */
static inline float kvpi_fast_tree(const float s[16])
{
    float t[8];
    for (int l = 0; l < 8; l++) {
        t[l] = s[l] + s[l + 8];
    }
    float u0 = t[0] + t[4];
    float u1 = t[1] + t[5];
    float u2 = t[2] + t[6];
    float u3 = t[3] + t[7];
    return (u0 + u2) + (u1 + u3);
}

/*
 * The fast level's dot product (the contract every level keeps, Fast
 * accumulation above): q[f] (f32) times element `at + f` of narrow rows of
 * `kind` widened to f32, for f < n:
 *   s_l = fmaf(q[f], k[f], s_l) for f = l (mod 16), f < 16 floor(n / 16),
 *         in increasing f, from s_l = +0.0f, l = 0..15;
 *   the tree kvpi_fast_tree(s); then sum = fmaf(q[f], k[f], sum) for the
 *   tail f = 16 floor(n / 16) .. n-1.
 * fmaf is libm's, correctly rounded; the vector levels use FMA instructions.
 */
static inline float kvpi_fast_dot(const float *q, kvpi_rows kind, const void *rows, size_t at,
                                  size_t n)
{
    float s[16];
    for (int l = 0; l < 16; l++) {
        s[l] = 0.0f;
    }
    size_t f = 0;
    for (; f + 16 <= n; f += 16) {
        for (size_t l = 0; l < 16; l++) {
            s[l] = fmaf(q[f + l], kvpi_rows_widen_f32(kind, rows, at + f + l), s[l]);
        }
    }
    float sum = kvpi_fast_tree(s);
    for (; f < n; f++) {
        sum = fmaf(q[f], kvpi_rows_widen_f32(kind, rows, at + f), sum);
    }
    return sum;
}

/*
 * The fast level's 2^t for the softmax's domain, t <= 0 (or -inf), in f32,
 * the same bits at every level: t' = max(t, -160); k = t' rounded to the
 * nearest integer (ties to even, by adding and subtracting 1.5 * 2^23);
 * r = t' - k (exact, |r| <= 1/2); p = a degree-6 polynomial in r by
 * Horner's rule with fmaf (coefficients below, fitted for relative error,
 * c0 = 1 so 2^0 = 1 exactly); then (p * 2^(k + 64)) * 2^-64: the first
 * product exact (normal), the second exact unless the result is subnormal
 * (one rounding; below about 2^-150 it is +0).
 * Relative error of p against 2^r: at most 1.14 * 2^-24 (0.80 ulp), checked
 * exhaustively over every f32 r in [-1/2, 1/2]; tests/test_kernels.c
 * checks a grid. Only IEEE add, subtract, multiply and fused multiply-add.
 */
#define KVPI_EXP2F_MIN (-160.0f)
#define KVPI_EXP2F_SHIFT 0x1.8p+23f
#define KVPI_EXP2F_C1 0x1.62e43p-1f
#define KVPI_EXP2F_C2 0x1.ebfbdcp-3f
#define KVPI_EXP2F_C3 0x1.c6af7cp-5f
#define KVPI_EXP2F_C4 0x1.3b2de0p-7f
#define KVPI_EXP2F_C5 0x1.5f083p-10f
#define KVPI_EXP2F_C6 0x1.416b6p-13f
#define KVPI_EXP2F_DOWN 0x1p-64f
/* log2(e), the factor the fast level folds into its queries (scores in base 2). */
#define KVPI_LOG2E 0x1.71547652b82fep+0

static inline float kvpi_exp2f(float t)
{
    float x = t < KVPI_EXP2F_MIN ? KVPI_EXP2F_MIN : t;
    float k = (x + KVPI_EXP2F_SHIFT) - KVPI_EXP2F_SHIFT;
    float r = x - k;
    float p = KVPI_EXP2F_C6;
    p = fmaf(p, r, KVPI_EXP2F_C5);
    p = fmaf(p, r, KVPI_EXP2F_C4);
    p = fmaf(p, r, KVPI_EXP2F_C3);
    p = fmaf(p, r, KVPI_EXP2F_C2);
    p = fmaf(p, r, KVPI_EXP2F_C1);
    p = fmaf(p, r, 1.0f);
    uint32_t bits = (uint32_t)((int32_t)k + 64 + 127) << 23; /* 2^(k + 64) */
    float up;
    memcpy(&up, &bits, sizeof up);
    return (p * up) * KVPI_EXP2F_DOWN;
}

/*
 * The fast level's softmax of n finite f32 scores in base 2, in place (n = 0: nothing)
 * (docs/DESIGN.md, Accumulation levels): m = the maximum (exact in any
 * order); e_i = kvpi_exp2f(s_i - m) (the difference rounded to f32); the sum
 * of the e_i in kvpi_fast_dot's order with adds (sixteen lane sums over
 * i = l mod 16 below 16 floor(n / 16), kvpi_fast_tree, then the tail added
 * one by one); s_i = e_i / sum, one f32 divide each. Every level's
 * softmax_fast gives these bits; this is the portable one's.
 */
static inline void kvpi_softmax_fast_ref(float *s, size_t n)
{
    if (n == 0) {
        return;
    }
    float m = s[0];
    for (size_t i = 1; i < n; i++) {
        m = s[i] > m ? s[i] : m;
    }
    float lanes[16];
    for (int l = 0; l < 16; l++) {
        lanes[l] = 0.0f;
    }
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (size_t l = 0; l < 16; l++) {
            s[i + l] = kvpi_exp2f(s[i + l] - m);
            lanes[l] += s[i + l];
        }
    }
    float sum = kvpi_fast_tree(lanes);
    for (; i < n; i++) {
        s[i] = kvpi_exp2f(s[i] - m);
        sum += s[i];
    }
    for (i = 0; i < n; i++) {
        s[i] /= sum;
    }
}

/* The tree of the summation order above over eight lane sums. */
static inline double kvpi_sum_tree(const double s[8])
{
    double t0 = s[0] + s[4];
    double t1 = s[1] + s[5];
    double t2 = s[2] + s[6];
    double t3 = s[3] + s[7];
    return (t0 + t2) + (t1 + t3);
}

/*
 * exp for the softmax's domain, x <= 0 (and -inf), shared by every level.
 * fdlibm's e_exp.c (Sun, 1993) without its branches: k = round(x / ln 2) by
 * the 1.5 * 2^52 shift, x = k ln2_hi + (k ln2_lo + r) with k ln2_hi exact
 * (ln2_hi has 32 significant bits, |k| <= 1075), exp(r) by fdlibm's rational
 * form of a degree-5 Remez polynomial, then two exact-or-final scalings,
 * 2^(k + 540) (exact: the product stays normal) and 2^-540 (the one rounding
 * of a subnormal result). No fused multiply-add, no table.
 *   - Error against the exact exp: below 1 ulp (fdlibm's bound); against
 *     glibc's exp, at most KVPI_EXP_MAX_ULP ulp over [-745.2, 0], tested
 *     (tests/test_kernels.c) on a dense grid.
 *   - kvpi_exp(0) == kvpi_exp(-0) == 1 exactly, so a softmax's maximum
 *     contributes exactly 1; subnormal results are rounded once; x below
 *     KVPI_EXP_MIN (about -745.133, where exp(x) < 2^-1075) and -inf give +0.
 * Vector levels follow the same steps, with max(x, KVPI_EXP_MIN) in place of
 * x and the lanes below KVPI_EXP_MIN set to +0 at the end.
 */
#define KVPI_EXP_MIN (-0x1.74910d52d3051p+9)
#define KVPI_EXP_MAX_ULP 1
#define KVPI_EXP_INV_LN2 0x1.71547652b82fep+0
#define KVPI_EXP_SHIFT 0x1.8p+52 /* x * inv_ln2 + SHIFT rounds to k in the low bits */
#define KVPI_EXP_LN2_HI 0x1.62e42feep-1
#define KVPI_EXP_LN2_LO 0x1.a39ef35793c76p-33
#define KVPI_EXP_P1 0x1.555555555553ep-3
#define KVPI_EXP_P2 (-0x1.6c16c16bebd93p-9)
#define KVPI_EXP_P3 0x1.1566aaf25de2cp-14
#define KVPI_EXP_P4 (-0x1.bbd41c5d26bf1p-20)
#define KVPI_EXP_P5 0x1.6376972bea4d0p-25
/* Added to the bits of x * inv_ln2 + SHIFT (low bits k): low 12 bits k + 540 + 1023. */
#define KVPI_EXP_BIAS 1563
#define KVPI_EXP_DOWN 0x1p-540

static inline double kvpi_exp(double x)
{
    if (!(x >= KVPI_EXP_MIN)) {
        return 0.0;
    }
    double shifted = x * KVPI_EXP_INV_LN2 + KVPI_EXP_SHIFT;
    double k = shifted - KVPI_EXP_SHIFT;
    uint64_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits = (bits + KVPI_EXP_BIAS) << 52; /* 2^(k + 540) */
    double up;
    memcpy(&up, &bits, sizeof up);
    double hi = x - k * KVPI_EXP_LN2_HI;
    double lo = k * KVPI_EXP_LN2_LO;
    double r = hi - lo;
    double t = r * r;
    double c = r - t * (KVPI_EXP_P1 +
                        t * (KVPI_EXP_P2 + t * (KVPI_EXP_P3 + t * (KVPI_EXP_P4 +
                                                                   t * KVPI_EXP_P5))));
    double y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
    return (y * up) * KVPI_EXP_DOWN;
}

/* The dot product of a[0..n) and b[0..n), in the order above. */
static inline double kvpi_dot(const double *a, const double *b, size_t n)
{
    return kvpi_kernels_active()->dot(a, b, n);
}

/* acc[f] += weight * v[f]. */
static inline void kvpi_axpy(double *acc, double weight, const double *v, size_t n)
{
    kvpi_kernels_active()->axpy(acc, weight, v, n);
}

/* y[0..width) = x[0..width) W, W row-major width x width; summed over i in order. */
void kvpi_project_row(const double *x, const double *w, size_t width, double *y);

/*
 * y[0..cols) = x[0..rows) W, W row-major rows x cols; each y[j] summed over i
 * in order, so a column gives the same bits whatever the other columns are
 * (a grouped layer's K equals an MHA layer's with the columns repeated).
 */
void kvpi_project_rect(const double *x, const double *w, size_t rows, size_t cols, double *y);

/*
 * Y = X W for `rows` input rows at once: y[r * y_stride + j] for r < rows,
 * j < cols is x[r * x_stride + 0 .. width) W with W row-major width x cols,
 * summed over i in increasing order from +0.0, with every product rounded
 * before its add: the bits of kvpi_project_rect on each row, at every level
 * (tested). Blocked so W is read once per block of rows: a tile of
 * project_mr x project_nr outputs stays in registers over a run of i; for
 * more than a few rows, slivers of W (64 rows x project_nr) are
 * packed contiguously on the stack first and shared by every tile of a block
 * of rows. x and y must not overlap.
 */
void kvpi_project_rows(const double *x, size_t x_stride, size_t rows, const double *w,
                       size_t width, size_t cols, double *y, size_t y_stride);

/*
 * In place: s[i] = kvpi_exp(s[i] - max) / sum, the sum in the dot product's
 * order (the active level's exp_sum). Requires finite input, n >= 1.
 */
void kvpi_softmax(double *s, size_t n);

/* kvpi_softmax_fast_ref through the active level (the same bits). */
static inline void kvpi_softmax_fast(float *s, size_t n)
{
    kvpi_kernels_active()->softmax_fast(s, n);
}

/*
 * RoPE's frequency of pair i: theta_i = base^(-2i / width), the one formula
 * every RoPE path uses (rotation, the layers' tables, validation).
 */
static inline double kvpi_rope_theta(double base, size_t width, size_t i)
{
    return pow(base, -(double)(2 * i) / (double)width);
}

/*
 * Rotates the first rope->feature_width features of `count` vectors that
 * start `stride` doubles apart, all at `position`; the caller checked the
 * range. Each pair's angle, cos and sin are computed once per call and used
 * for every vector: theta_i = kvpi_rope_theta, angle = (double)position *
 * theta_i, then cos(angle), sin(angle). Every other RoPE function gives the
 * bits of this one.
 */
void kvpi_rope_apply_rows(const kvp_rope_config *rope, double *rows, size_t stride, size_t count,
                          size_t position);

/*
 * The same rotation of `count` vectors of `a` and, unless NULL, of `b`, with
 * the pairs' thetas given (theta[i] = kvpi_rope_theta) for `half` pairs:
 * each pair's cos and sin computed once per call.
 */
void kvpi_rope_apply_thetas(const double *theta, size_t half, double *a, double *b,
                            size_t stride, size_t count, size_t position);

/* The same rotation with cos_sin[2i], cos_sin[2i + 1] the pair's cos and sin at the position. */
void kvpi_rope_apply_table(const double *cos_sin, size_t half, double *rows, size_t stride,
                           size_t count);

/* table[(p * half + i) * 2 + {0, 1}] = cos, sin of (double)p * theta[i], p < positions. */
void kvpi_rope_fill_table(const double *theta, size_t half, size_t positions, double *table);

/* kvpi_rope_apply_rows for one vector. */
static inline void kvpi_rope_apply(const kvp_rope_config *rope, double *features,
                                   size_t position)
{
    kvpi_rope_apply_rows(rope, features, 0, 1, position);
}

#endif /* KVPAGER_ATTENTION_KERNELS_H */
