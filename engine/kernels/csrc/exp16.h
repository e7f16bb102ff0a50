// exp on 16 float32 lanes (AVX-512): common.h's fast_exp vectorized, with its clamp, reduction and polynomial,
// so a kernel's vector and scalar exponentials agree. Shared by the attention kernels (paged_decode.cpp,
// prefill_attention.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedserve {

inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
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

}  // namespace pagedserve

#endif
