/* What the CPU attention kernel (cpu_attention.cpp) and the fused token-wise ops
   (cpu_fused.cpp) share, one library built from both: the bf16 type, e^x on 16 lanes,
   and the bf16 <-> fp32 conversions. AVX-512F. */
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

typedef uint16_t bf16; /* the upper half of an fp32 */

static inline __m512 exp512(__m512 x) {
    /* e^x = 2^n * 2^f with t = x log2(e), n = round(t), f = t - n in [-0.5, 0.5];
       2^f by its Taylor series to degree 7 (relative error < 1e-8 before rounding). */
    x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline float bf16_to_f32(bf16 x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline __m512 bf16x16_to_f32(__m256i x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/* 16 fp32 -> 16 bf16, rounded to nearest even (a NaN stays a NaN); AVX-512F alone */
static inline __m256i f32_to_bf16x16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x), high = _mm512_srli_epi32(u, 16);
    const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, high, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 fp32 -> 16 bf16, to nearest even: one instruction with AVX-512 BF16 */
static inline __m256i to_bf16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    return f32_to_bf16x16(x);
#endif
}
