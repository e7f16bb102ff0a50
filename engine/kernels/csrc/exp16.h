// exp on 16 float32 lanes (AVX-512) and on 8 (AVX2 with FMA): common.h's fast_exp vectorized, with its clamp,
// reduction and polynomial, so a kernel's vector and scalar exponentials agree; and a shorter one for
// probabilities rounded to bf16. A NaN lane stays NaN: the clamps take x as min/max's second operand, the one
// those instructions return when either is NaN. Shared by the attention kernels (paged_decode.cpp,
// prefill_attention.cpp, prefill_attention_f32.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve {

inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), x));
    const __m512i ki = _mm512_cvttps_epi32(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                           _mm512_set1_ps(128.5f)));
    const __m512 k = _mm512_sub_ps(_mm512_cvtepi32_ps(ki), _mm512_set1_ps(128.0f));
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    // 2^k: (k + 127) << 23 with k = ki - 128
    const __m512i two_k = _mm512_slli_epi32(_mm512_sub_epi32(ki, _mm512_set1_epi32(1)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(two_k));
}

// exp(x) for x <= 0 to ~6e-5 relative, in 9 instructions where exp16 takes 17: for softmax probabilities that are
// rounded to bf16 (2^-9) before their product with V. 2^(x log2 e) = 2^n 2^f, n the nearest integer, |f| <= 1/2,
// 2^f by a degree-4 polynomial, 2^n by vscalefps.
inline __m512 exp16_bf16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(_mm512_set1_ps(-87.0f), x), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.6181291e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

}  // namespace pagedserve

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace pagedserve {

// exp16 on 8 lanes: the same clamp, reduction and polynomial.
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));
    const __m256i ki = _mm256_cvttps_epi32(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                           _mm256_set1_ps(128.5f)));
    const __m256 k = _mm256_sub_ps(_mm256_cvtepi32_ps(ki), _mm256_set1_ps(128.0f));
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(k, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^k: (k + 127) << 23 with k = ki - 128
    const __m256i two_k = _mm256_slli_epi32(_mm256_sub_epi32(ki, _mm256_set1_epi32(1)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_k));
}

}  // namespace pagedserve

#endif
