// GGUF blocks as csrc/quant_gemm.cpp stores them (see there): formats, scales, one stored quant, a pair of
// blocks as 64 bytes. Shared by quant_gemm.cpp (integer products) and quant_dense_bf16.cpp (bf16 products).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve {
namespace quant {

enum Format : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };

constexpr int64_t kBlock = 32;

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  // subnormal: normalize
        exponent = 113;
        while ((mantissa & 0x400u) == 0) { mantissa <<= 1; --exponent; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
#endif
}

// The additive term of a block: mm = m, -8 d or -128 d.
inline float block_min(int64_t format, const uint16_t* d, const uint16_t* m, int64_t b) {
    if (format == kQ4_1) return half_to_float(m[b]);
    return half_to_float(d[b]) * (format == kQ4_0 ? -8.0f : -128.0f);
}

// The stored unsigned quant of element j of block b in a row of qs.
inline int stored_quant(int64_t format, const uint8_t* qs, int64_t b, int64_t j) {
    if (format == kQ8_0) return qs[b * kBlock + j];
    const uint8_t byte = qs[(b / 2) * kBlock + j];
    return (b & 1) ? (byte >> 4) : (byte & 0x0f);
}

#if defined(__AVX512BW__)
// Blocks b and b + 1 of a weight row as 64 unsigned bytes (lanes 0-31: block b, 32-63: block b + 1).
template <int64_t FORMAT>
inline __m512i load_pair(const uint8_t* qs, int64_t b) {
    if constexpr (FORMAT == kQ8_0) {
        return _mm512_loadu_si512(qs + b * kBlock);
    } else {
        // the 32 bytes in both halves (a load), the upper half shifted right by 4: low nibbles | high nibbles
        const __m512i both =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (b / 2) * kBlock)));
        const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        return _mm512_and_si512(_mm512_srlv_epi16(both, shifts), _mm512_set1_epi8(0x0f));
    }
}
#endif

// Layouts of the quants (engine/quantization/gguf_formats.py):
//   kRows  row-major: a weight row's blocks one after the other, 4-bit blocks in pairs (see quant_gemm.cpp)
//   kX16   16 weight rows interleaved, for integer products that keep 16 output columns in one vector's
//          lanes: group g of 16 rows is nb block records in a row, record b = the quants (4-bit: 4 x 64
//          bytes P_q (q = 0..3), byte 4c + j = u[c][4q + j] | u[c][16 + 4q + j] << 4; 8-bit: 8 x 64 bytes
//          V_q (q = 0..7), byte 4c + j = u[c][4q + j]), then the 16 columns' fp16 scales d, then (Q4_1) their
//          fp16 minimums m; no padding block (nbp = nb). A product reads one stream per group, not three,
//          which a prefetch ahead carries near the plain read's rate (the hardware prefetcher's on AVX-512,
//          kX16PrefetchBytes in software on AVX2: docs/performance.md). The d and m arguments of the entry
//          points are not read for kX16.
enum Layout : int64_t { kRows = 0, kX16 = 1 };

constexpr int64_t kGroupColumns = 16;

inline int64_t x16_quant_bytes(int64_t format) { return format == kQ8_0 ? 512 : 256; }

// Bytes of one kX16 block record (quants, scales, minimums).
inline int64_t x16_block_bytes(int64_t format) {
    return x16_quant_bytes(format) + 2 * kGroupColumns * (format == kQ4_1 ? 2 : 1);
}

// The 16 scales of the kX16 record at p, and its 16 Q4_1 minimums.
inline const uint16_t* x16_scales(const uint8_t* p, int64_t format) {
    return reinterpret_cast<const uint16_t*>(p + x16_quant_bytes(format));
}
inline const uint16_t* x16_mins(const uint8_t* p, int64_t format) { return x16_scales(p, format) + kGroupColumns; }

// The stored unsigned quant of element k of column c (0..15) in a kX16 block at p.
inline int x16_quant(int64_t format, const uint8_t* p, int64_t c, int64_t k) {
    if (format == kQ8_0) return p[64 * (k / 4) + 4 * c + k % 4];
    const uint8_t byte = p[64 * ((k % 16) / 4) + 4 * c + k % 4];
    return k < 16 ? (byte & 0x0f) : (byte >> 4);
}

constexpr int64_t kColumnsPerTask = 16;  // output columns (weight rows) per work item
constexpr int64_t kParallelMinWork = 1 << 16;

// The bf16 product of quant_dense_bf16.cpp: out [rows, columns] = x [rows, K] @ W.T, W dequantized to bf16
// one tile of columns at a time (float32 x rounded to bf16 first). False (nothing done) where the build
// has no AVX512-BF16.
bool dense_bf16_product(const uint16_t* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                        uint16_t* out, int64_t rows, int64_t in_features, int64_t columns, int64_t nbp,
                        int64_t format, int64_t layout);
bool dense_bf16_product(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, float* out,
                        int64_t rows, int64_t in_features, int64_t columns, int64_t nbp, int64_t format,
                        int64_t layout);

}  // namespace quant
}  // namespace pagedserve
