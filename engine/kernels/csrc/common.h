// Scalar helpers shared by the CPU kernels, written so loops over them vectorize.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagedserve {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
    uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

// A KV cache element in float8 e4m3 (OCP "e4m3fn": bias 7, no infinities, 0x7f / 0xff NaN, largest 448), as
// torch.float8_e4m3fn stores it.
struct Fp8E4M3 {
    uint8_t bits;
};

// Branch-free (selects), so that loops over a row vectorize.
inline float to_float(Fp8E4M3 x) {
    const uint32_t magnitude = x.bits & 0x7fu;
    const uint32_t normal = (magnitude << 20) + (120u << 23);  // the exponent rebiased (7 -> 127), m moved up
    const float subnormal = static_cast<float>(magnitude) * 0.001953125f;  // exponent 0: m x 2^-9
    uint32_t bits;
    std::memcpy(&bits, &subnormal, sizeof bits);
    bits = magnitude >= 0x08u ? normal : bits;
    bits = magnitude == 0x7fu ? 0x7fc00000u : bits;  // NaN
    bits |= static_cast<uint32_t>(x.bits & 0x80u) << 24;
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline void store(float* dst, float x) { *dst = x; }

// float -> e4m3, round to nearest even, saturating at +-448 (infinities too), NaN kept: what torch's CPU
// conversion to float8_e4m3fn gives.
inline void store(Fp8E4M3* dst, float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
    const float magnitude = std::fabs(x);
    uint8_t code;
    if (magnitude != magnitude) {
        code = 0x7f;
    } else if (magnitude >= 448.0f) {
        code = 0x7e;
    } else if (magnitude < 0.015625f) {  // below 2^-6: steps of 2^-9, 2^-6 itself (code 8) included
        code = static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));
    } else {  // 3 mantissa bits kept, rounded to nearest even (at most 448: code 0x7e)
        uint32_t m = bits & 0x7fffffffu;
        m += 0x7ffffu + ((m >> 20) & 1u);
        code = static_cast<uint8_t>((((m >> 23) - 120u) << 3) | ((m >> 20) & 7u));
    }
    dst->bits = static_cast<uint8_t>(sign | code);
}

inline void store(uint16_t* dst, float x) {  // bfloat16, round to nearest even; NaN stays NaN (branch-free)
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
    const bool is_nan = (bits & 0x7fffffffu) > 0x7f800000u;
    *dst = static_cast<uint16_t>((is_nan ? (bits | 0x400000u) : rounded) >> 16);
}

// exp(x), x clamped to [-87, 88]: x = k ln2 + r with |r| <= ln2 / 2, exp(x) = 2^k p(r);
// relative error ~2e-7. NaN gives NaN, as torch's does (a softmax over a NaN or +inf score is NaN, which the
// engine's check of the logits then catches).
inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);  // NaN stays NaN, and makes r and the result NaN
    const float finite = x == x ? x : 0.0f;  // a float -> int conversion of NaN is undefined
    // floor(x log2(e) + 0.5) via truncation of a positive number
    const float k = static_cast<float>(static_cast<int32_t>(finite * 1.44269504088896341f + 128.5f)) - 128.0f;
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t exponent_bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &exponent_bits, sizeof two_k);
    return p * two_k;
}

}  // namespace pagedserve
