// fp8 (e4m3) K/V rows widened to bf16 or float32 as the attention kernels read them (--kv-cache-dtype fp8).
// Exact: every e4m3 value is a bf16 (and a float) value, and the NaN codes widen to NaN. The scalar conversions
// (to_float, store) are in common.h; here the AVX-512 ones:
//   AVX512BW     32 codes at a time by arithmetic: a normal code's exponent rebiased by an add (7 -> 127) and
//                its 3 mantissa bits moved up; the subnormals (exponent 0: m x 2^-9) and NaN from a table of 9
//   + VBMI       64 codes at a time by byte lookups: each code's bf16 low byte and high byte (sign clear) from
//                tables of the 128 magnitudes (vpermi2b reads an index's low 7 bits), the sign OR'd into the
//                high byte, the two bytes interleaved into words: 5 instructions per 64 values where the
//                arithmetic takes 9 per 32
#pragma once

#include <cstdint>

#include "common.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace pagedserve::fp8 {

#if defined(__AVX512BW__)
constexpr bool kFp8Simd = true;

// 32 codes -> 32 bf16 words. The magnitude is taken plus one (mod 128), so that one compare finds both the lanes
// the table gives: the subnormals (exponent 0, m x 2^-9: 1..8) and NaN (0).
inline __m512i bf16_from_fp8(const Fp8E4M3* src) {
    alignas(64) static constexpr uint16_t kSpecial[32] = {0x7fc0, 0x0000, 0x3b00, 0x3b80, 0x3bc0,
                                                          0x3c00, 0x3c20, 0x3c40, 0x3c60};
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    const __m512i next = _mm512_and_si512(_mm512_add_epi16(codes, _mm512_set1_epi16(1)), _mm512_set1_epi16(0x7f));
    __m512i words = _mm512_add_epi16(_mm512_slli_epi16(next, 4), _mm512_set1_epi16((120 << 7) - 16));
    const __mmask32 special = _mm512_cmple_epu16_mask(next, _mm512_set1_epi16(8));
    words = _mm512_mask_permutexvar_epi16(words, special, next, _mm512_load_si512(kSpecial));
    return _mm512_or_si512(words, _mm512_slli_epi16(_mm512_and_si512(codes, _mm512_set1_epi16(0x80)), 8));
}

// 16 codes -> 16 floats, the same way.
inline __m512 f32_from_fp8_arithmetic(const Fp8E4M3* src) {
    alignas(64) static constexpr uint32_t kSpecial[16] = {0x7fc00000, 0x00000000, 0x3b000000, 0x3b800000, 0x3bc00000,
                                                          0x3c000000, 0x3c200000, 0x3c400000, 0x3c600000};
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    const __m512i next = _mm512_and_si512(_mm512_add_epi32(codes, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7f));
    __m512i bits = _mm512_add_epi32(_mm512_slli_epi32(next, 20), _mm512_set1_epi32((120 << 23) - (1 << 20)));
    const __mmask16 special = _mm512_cmple_epu32_mask(next, _mm512_set1_epi32(8));
    bits = _mm512_mask_permutexvar_epi32(bits, special, next, _mm512_load_si512(kSpecial));
    return _mm512_castsi512_ps(
        _mm512_or_si512(bits, _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24)));
}
#else
constexpr bool kFp8Simd = false;  // the portable loops read fp8 caches (the conversions need AVX512BW)
#endif

#if defined(__AVX512VBMI__)
struct ByteTables {
    uint8_t low[128], high[128];
};

constexpr uint16_t bf16_of_magnitude(int code) {  // e4m3 code 0..127 as bf16 bits (127: NaN)
    if (code == 0x7f) return 0x7fc0;
    const int e = code >> 3, m = code & 7;
    if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (m << 4));
    if (m == 0) return 0;
    const int p = m >= 4 ? 2 : (m >= 2 ? 1 : 0);  // a subnormal m x 2^-9 = 2^(p - 9) x m / 2^p
    return static_cast<uint16_t>(((118 + p) << 7) | ((m - (1 << p)) << (7 - p)));
}

constexpr ByteTables byte_tables() {
    ByteTables t{};
    for (int code = 0; code < 128; ++code) {
        t.low[code] = static_cast<uint8_t>(bf16_of_magnitude(code) & 0xff);
        t.high[code] = static_cast<uint8_t>(bf16_of_magnitude(code) >> 8);
    }
    return t;
}
alignas(64) inline constexpr ByteTables kByteTables = byte_tables();

// Byte indices for vpermt2b: (low, high) of values 0..31, then of 32..63, interleaved into words.
struct WordIndex {
    uint8_t first[64], second[64];
};
constexpr WordIndex word_index() {
    WordIndex t{};
    for (int i = 0; i < 32; ++i) {
        t.first[2 * i] = static_cast<uint8_t>(i), t.first[2 * i + 1] = static_cast<uint8_t>(64 + i);
        t.second[2 * i] = static_cast<uint8_t>(32 + i), t.second[2 * i + 1] = static_cast<uint8_t>(96 + i);
    }
    return t;
}
alignas(64) inline constexpr WordIndex kWordIndex = word_index();

// The low and high bytes of 64 codes' bf16 words (the sign in the high byte).
inline void bf16_bytes(__m512i codes, __m512i& low, __m512i& high) {
    low = _mm512_permutex2var_epi8(_mm512_load_si512(kByteTables.low), codes,
                                   _mm512_load_si512(kByteTables.low + 64));
    high = _mm512_permutex2var_epi8(_mm512_load_si512(kByteTables.high), codes,
                                    _mm512_load_si512(kByteTables.high + 64));
    high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | sign
}

// 64 codes (in a vector) -> their bf16 words, values 0..31 in `first`, 32..63 in `second`.
inline void bf16_from_fp8_codes(__m512i codes, __m512i& first, __m512i& second) {
    __m512i low, high;
    bf16_bytes(codes, low, high);
    first = _mm512_permutex2var_epi8(low, _mm512_load_si512(kWordIndex.first), high);
    second = _mm512_permutex2var_epi8(low, _mm512_load_si512(kWordIndex.second), high);
}

// 32 codes (the low half of a vector) -> their bf16 words.
inline __m512i bf16_from_fp8_low(__m512i codes) {
    __m512i low, high;
    bf16_bytes(codes, low, high);
    return _mm512_permutex2var_epi8(low, _mm512_load_si512(kWordIndex.first), high);
}

// Byte indices that interleave 32 codes of key a (bytes 0..31) and key b (64..95) in the order vpunpcklwd /
// vpunpckhwd give two bf16 rows: word pair j of the first 16 holds dim 8 (j / 4) + j % 4, of the second 16 dim
// 8 (j / 4) + 4 + j % 4 (the kernels' P.V over key pairs).
struct PairIndex {
    uint8_t bytes[64];
};
constexpr PairIndex pair_index() {
    PairIndex t{};
    for (int j = 0; j < 32; ++j) {
        const int k = j % 16, dim = 8 * (k / 4) + (j < 16 ? 0 : 4) + k % 4;
        t.bytes[2 * j] = static_cast<uint8_t>(dim), t.bytes[2 * j + 1] = static_cast<uint8_t>(64 + dim);
    }
    return t;
}
alignas(64) inline constexpr PairIndex kPairIndex = pair_index();

// Byte indices that put 16 codes' (low, high) bytes in the top half of each dword (the bottom half zeroed by
// the mask kFloatBytes): their floats, whose low 16 bits are zero (every e4m3 value is a bf16 value).
struct FloatIndex {
    uint8_t bytes[4][64];  // codes 16v .. 16v + 15
};
constexpr FloatIndex float_index() {
    FloatIndex t{};
    for (int v = 0; v < 4; ++v)
        for (int i = 0; i < 16; ++i) {
            t.bytes[v][4 * i + 2] = static_cast<uint8_t>(16 * v + i);
            t.bytes[v][4 * i + 3] = static_cast<uint8_t>(64 + 16 * v + i);
        }
    return t;
}
alignas(64) inline constexpr FloatIndex kFloatIndex = float_index();
constexpr __mmask64 kFloatBytes = 0xCCCCCCCCCCCCCCCCull;

// 64 codes (in a vector) -> their floats, codes 16v .. 16v + 15 in out[v].
inline void f32_from_fp8_codes(__m512i codes, __m512* out) {
    __m512i low, high;
    bf16_bytes(codes, low, high);
    for (int v = 0; v < 4; ++v)
        out[v] = _mm512_castsi512_ps(
            _mm512_maskz_permutex2var_epi8(kFloatBytes, low, _mm512_load_si512(kFloatIndex.bytes[v]), high));
}
#endif

#if defined(__AVX512BW__)
// 16 codes -> 16 floats: 4 instructions by byte lookups with VBMI (64 at a time: 7), 9 by arithmetic without.
inline __m512 f32_from_fp8(const Fp8E4M3* src) {
#if defined(__AVX512VBMI__)
    __m512i low, high;
    bf16_bytes(_mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), low, high);
    return _mm512_castsi512_ps(
        _mm512_maskz_permutex2var_epi8(kFloatBytes, low, _mm512_load_si512(kFloatIndex.bytes[0]), high));
#else
    return f32_from_fp8_arithmetic(src);
#endif
}
#endif

#if defined(__AVX512BW__)
// 32 codes -> 32 bf16 words, in order.
inline __m512i bf16_words(const Fp8E4M3* src) {
#if defined(__AVX512VBMI__)
    return bf16_from_fp8_low(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
#else
    return bf16_from_fp8(src);
#endif
}

// Two keys' 32 codes each -> their bf16 words interleaved as vpunpcklwd (`low`) and vpunpckhwd (`high`) give.
inline void bf16_pairs(const Fp8E4M3* a, const Fp8E4M3* b, __m512i& low, __m512i& high) {
#if defined(__AVX512VBMI__)
    const __m512i x = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
    const __m512i y = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
    bf16_from_fp8_codes(_mm512_permutex2var_epi8(x, _mm512_load_si512(kPairIndex.bytes), y), low, high);
#else
    const __m512i x = bf16_from_fp8(a), y = bf16_from_fp8(b);
    low = _mm512_unpacklo_epi16(x, y);
    high = _mm512_unpackhi_epi16(x, y);
#endif
}
#endif

}  // namespace pagedserve::fp8
