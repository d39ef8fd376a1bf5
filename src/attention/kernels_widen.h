/*
 * kernels_widen.h: e4m3 elements widened to f32 by way of f16, for the
 * vector levels (included by kernels_avx2.c and kernels_avx512.c only, after
 * <immintrin.h>; needs AVX2 and F16C).
 *
 * The e4m3fn bits s eeee mmm, moved to s 0 eeee mmm 0000000, are the f16
 * whose value is the e4m3 value times 2^-8, for normal and subnormal codes
 * alike (f16 bias 15 against e4m3's 7; e4m3 subnormal m 2^-9 is f16
 * subnormal m 2^-17). vcvtph2ps widens that exactly (an f16 subnormal becomes
 * an f32 normal: no microcode assist), and the product with 2^8 is exact (the
 * largest, 448, is far from overflow), so every value is kvpi_e4m3_widen's bit
 * for bit, signed zeros included. The NaN codes S.1111.111 become the f16
 * quiet NaN S 11111 1000000000 first, which vcvtph2ps makes the f32 sign |
 * KVPI_E4M3_NAN_BITS, and a product with a quiet NaN operand returns it
 * unchanged: the same bits as kvpi_e4m3_widen there too (pages never hold
 * NaN; tests/test_fast_kernels.c checks all 256 codes at every level).
 */
#ifndef KVPAGER_ATTENTION_KERNELS_WIDEN_H
#define KVPAGER_ATTENTION_KERNELS_WIDEN_H

/* Sign-extended e4m3 bytes in 16-bit lanes to the f16 bits above (NaN fixed). */
#define KVPI_E4M3_F16(W, SFX, SET1, AND, OR, XOR, CMPEQ)                                      \
    do {                                                                                       \
        W = AND(_mm##SFX##_slli_epi16(W, 7), SET1((short)0xBF80));                             \
        /* S 0 1111 111 0000000 (the NaN codes) to S 1111 1100 0000000: xor 0x4180. */      \
        W = XOR(W, AND(CMPEQ(OR(W, SET1((short)0x8000)), SET1((short)0xBF80)),                 \
                       SET1((short)0x4180)));                                                  \
    } while (0)

/* Eight e4m3 elements at p widened to f32 (exact). */
static inline __attribute__((always_inline)) __m256 kvpi_e4m3_8(const void *p)
{
    __m128i w = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    KVPI_E4M3_F16(w, , _mm_set1_epi16, _mm_and_si128, _mm_or_si128, _mm_xor_si128,
                  _mm_cmpeq_epi16);
    return _mm256_mul_ps(_mm256_cvtph_ps(w), _mm256_set1_ps(0x1p8f));
}

#ifdef __AVX512F__
/* Sixteen e4m3 elements at p widened to f32 (exact). */
static inline __attribute__((always_inline)) __m512 kvpi_e4m3_16(const void *p)
{
    __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    KVPI_E4M3_F16(w, 256, _mm256_set1_epi16, _mm256_and_si256, _mm256_or_si256,
                  _mm256_xor_si256, _mm256_cmpeq_epi16);
    return _mm512_mul_ps(_mm512_cvtph_ps(w), _mm512_set1_ps(0x1p8f));
}
#endif

#undef KVPI_E4M3_F16
#endif
