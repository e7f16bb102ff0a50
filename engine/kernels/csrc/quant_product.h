// Products of int8-quantized activations with GGUF blocks (Q4_0, Q4_1, Q8_0), llama.cpp's scheme for
// decode-sized batches, as team work-sharing loops: quant_gemm.cpp runs them in a team of their own,
// decode_layer.cpp inside its fused per-layer kernels.
//
// Weights are repacked once, at load (engine/quantization/gguf_formats.py), for W [N, K] with
// nb = K / 32 blocks per row, padded to nbp (even) with zero blocks:
//   qs  4-bit  uint8 [N, nbp / 2, 32]  block pair p: byte j's low nibble is block 2p's element j, its high
//                                      nibble block 2p+1's element j (one 32-byte load gives both blocks
//                                      in natural order: a ymm each on AVX2, one zmm on AVX-512)
//       8-bit  uint8 [N, nbp, 32]      the int8 quant + 128 (unsigned, as vpdpbusd's first operand wants)
//   d   fp16 [N, nbp]                  block scale
//   m   fp16 [N, nbp]                  Q4_1's block minimum (absent for Q4_0 and Q8_0)
// so a weight is w = d * u + mm, u the stored unsigned quant, mm = m (Q4_1), -8 d (Q4_0), -128 d (Q8_0).
// That is the row layout (kRows); the kX16 layout (quant_blocks.h) keeps each block's scales beside its quants.
//
// Activations are quantized per row and 32-block to int8 (llama.cpp's Q8 activations):
//   xq int8 [R, nbp * 32], dx float [R, nbp] (= amax / 127), sx float [R, nbp] (= dx * sum(xq))
// and a block's dot product is d dx sum(u xq) + mm sx: an integer dot product (vpdpbusd on AVX512-VNNI,
// vpmaddubsw on AVX2) and two multiply-adds per block. Threads split blocks of output columns.
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"
#include "quant_blocks.h"
#include "team_split.h"

namespace pagedserve {
namespace quant {

constexpr int kMaxRows = 4;  // activation rows per micro-kernel call

// ---------------------------------------------------------------- activations

// One block of 32 activations: amax = max |x| (a NaN left out, as std::max leaves it), its scale amax / 127,
// q = x * (127 / amax) rounded to nearest even (the default rounding mode, as std::nearbyint), kept as its low 8
// bits, and the scale times the sum of the q. The vector paths compute exactly what the scalar loop does.
// A block holding a NaN gets a NaN scale (and sum): every product with it is NaN, as float64's is, so that a
// model's overflow reaches the engine's check of the logits (left out, it made an all-NaN row's products 0).
// (GCC vectorized the scalar loop by halves it joined through the stack: a 64-byte load of two 32-byte stores,
// which the store buffer cannot forward, stalled every block: docs/performance.md.)
#if defined(__AVX512F__)
inline void block_halves(const float* src, __m512* lo, __m512* hi) {
    *lo = _mm512_loadu_ps(src);
    *hi = _mm512_loadu_ps(src + 16);
}
inline void block_halves(const uint16_t* src, __m512* lo, __m512* hi) {  // bf16: the upper halves of floats
    const __m512i raw = _mm512_loadu_si512(src);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(raw)), 16));
    *hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(raw, 1)), 16));
}

template <typename T>
inline void quantize_block(const T* src, int8_t* xq, float* dx, float* sx) {
    __m512 lo, hi;
    block_halves(src, &lo, &hi);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    auto absolute = [&](__m512 v) {  // (AVX512F's integer and: _mm512_and_ps needs AVX512DQ)
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude));
    };
    // max(|x|, running): the running value where |x| is NaN
    const __m512 running = _mm512_max_ps(absolute(lo), _mm512_setzero_ps());
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(absolute(hi), running));
    const bool nan = (_mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q)) != 0;
    const float scale = nan ? NAN : amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 inv = _mm512_set1_ps(inverse);
    const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // MXCSR's rounding: nearest even
    const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq), _mm512_cvtepi32_epi8(q_lo));  // the low bytes, truncated
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + 16), _mm512_cvtepi32_epi8(q_hi));
    *dx = scale;
    *sx = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi)));
}
#elif defined(__AVX2__)
inline __m256 block_quarter(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 block_quarter(const uint16_t* src) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

template <typename T>
inline void quantize_block(const T* src, int8_t* xq, float* dx, float* sx) {
    __m256 x[4];
    for (int i = 0; i < 4; ++i) x[i] = block_quarter(src + 8 * i);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 running = _mm256_setzero_ps();  // max(|x|, running): the running value where |x| is NaN
    for (int i = 0; i < 4; ++i) running = _mm256_max_ps(_mm256_and_ps(x[i], magnitude), running);
    const __m128 four = _mm_max_ps(_mm256_castps256_ps128(running), _mm256_extractf128_ps(running, 1));
    const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
    const float amax = _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
    int nan = 0;
    for (int i = 0; i < 4; ++i) nan |= _mm256_movemask_ps(_mm256_cmp_ps(x[i], x[i], _CMP_UNORD_Q));
    const float scale = nan != 0 ? NAN : amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m256 inv = _mm256_set1_ps(inverse);
    const __m256i low_byte = _mm256_set1_epi32(0xff);
    __m256i q[4], bytes[4];
    for (int i = 0; i < 4; ++i) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], inv));  // MXCSR's rounding: nearest even
        bytes[i] = _mm256_and_si256(q[i], low_byte);           // the low bytes, truncated: no pack saturates
    }
    // packs interleave the 128-bit lanes: dwords 0-7 of the result hold quarters 0..3's first then last four bytes
    const __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(bytes[0], bytes[1]),
                                               _mm256_packus_epi32(bytes[2], bytes[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq), ordered);
    const __m256i sums = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0x4e));
    total = _mm_add_epi32(total, _mm_shuffle_epi32(total, 0xb1));
    *dx = scale;
    *sx = scale * static_cast<float>(_mm_cvtsi128_si32(total));
}
#else
template <typename T>
inline void quantize_block(const T* src, int8_t* xq, float* dx, float* sx) {
    float amax = 0.0f;
    int nan = 0;
#pragma omp simd reduction(max : amax) reduction(| : nan)
    for (int j = 0; j < kBlock; ++j) {
        const float v = to_float(src[j]);
        amax = std::max(amax, std::fabs(v));
        nan |= v != v;
    }
    const float scale = nan != 0 ? NAN : amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < kBlock; ++j) {
        const float v = to_float(src[j]) * inverse;
        // NaN (or inf x 0) has no int: 0 stands for it here (the scale is NaN or inf then, and so the products)
        const int q = v == v ? static_cast<int>(std::nearbyint(v)) : 0;
        xq[j] = static_cast<int8_t>(q);
        sum += q;
    }
    *dx = scale;
    *sx = scale * static_cast<float>(sum);
}
#endif

template <typename T>
void quantize_row(const T* x, int8_t* xq, float* dx, float* sx, int64_t nb, int64_t nbp) {
    static_assert(kBlock == 32, "the vector paths take blocks of 32");
    for (int64_t b = 0; b < nb; ++b) quantize_block(x + b * kBlock, xq + b * kBlock, dx + b, sx + b);
    for (int64_t b = nb; b < nbp; ++b) {
        std::memset(xq + b * kBlock, 0, kBlock);
        dx[b] = 0.0f;
        sx[b] = 0.0f;
    }
}

// ---------------------------------------------------------------- micro-kernels: NR rows x one column

struct Activations {
    const int8_t* xq;
    const float* dx;
    const float* sx;
    int64_t nbp;  // blocks per row (the row strides: nbp * 32 quants, nbp scales)
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// acc[r] += (sum of u * xq over each block, 8 lanes per block) * d dx of that block, for the pair at b.
template <int64_t FORMAT, int NR>
inline void pair_step(const uint8_t* qs, int64_t b, int64_t g, const __m512* scale, Activations a, __m512* acc) {
    // lanes 0-7 take block b's scale, lanes 8-15 block b + 1's: kPairLanes[(b - g) / 2] (a load, no ALU work)
    alignas(64) static constexpr int32_t kPairLanes[8][16] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},     {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},     {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
        {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
        {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15}};
    const __m512i w = load_pair<FORMAT>(qs, b);
    const __m512i index = _mm512_load_si512(kPairLanes[(b - g) / 2]);
    for (int r = 0; r < NR; ++r) {
        const __m512i xv = _mm512_loadu_si512(a.xq + r * a.nbp * kBlock + b * kBlock);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(index, scale[r]), acc[r]);
    }
}

template <int64_t FORMAT, int NR>
void column_dot(const uint8_t* qs, const uint16_t* d, const uint16_t* m, Activations a, float* result) {
    const int64_t nbp = a.nbp;
    __m512 even[NR], odd[NR], accm[NR];  // two chains per row (pairs alternate): hides the fma latency
    for (int r = 0; r < NR; ++r) even[r] = odd[r] = accm[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nbp; g += 16) {
        const int64_t blocks = std::min<int64_t>(16, nbp - g);
        const __mmask16 mask = static_cast<__mmask16>((1u << blocks) - 1u);
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + g));
        const __m512 mw = FORMAT == kQ4_1 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + g))
                                          : _mm512_mul_ps(dw, _mm512_set1_ps(FORMAT == kQ4_0 ? -8.0f : -128.0f));
        __m512 scale[NR];
        for (int r = 0; r < NR; ++r) {
            scale[r] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(mask, a.dx + r * nbp + g));
            accm[r] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(mask, a.sx + r * nbp + g), accm[r]);
        }
        int64_t b = g;
        for (; b + 4 <= g + blocks; b += 4) {
            pair_step<FORMAT, NR>(qs, b, g, scale, a, even);
            pair_step<FORMAT, NR>(qs, b + 2, g, scale, a, odd);
        }
        if (b < g + blocks) pair_step<FORMAT, NR>(qs, b, g, scale, a, even);
    }
    for (int r = 0; r < NR; ++r)
        result[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(even[r], odd[r]), accm[r]));
}

#elif defined(__AVX2__) && defined(__FMA__)

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// sum over 32 bytes of u * x as 8 int32 lanes (4-bit u: vpmaddubsw cannot saturate, 2 * 15 * 128 < 2^15)
inline __m256i dot_unsigned(__m256i u, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
}

// sum over 32 bytes of w * x for signed w (|w| <= 128 keeps vpmaddubsw's pair sums below 2^15)
inline __m256i dot_signed(__m256i w, __m256i x) {
    return dot_unsigned(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

template <int64_t FORMAT, int NR>
void column_dot(const uint8_t* qs, const uint16_t* d, const uint16_t* m, Activations a, float* result) {
    const int64_t nbp = a.nbp;
    __m256 acc[NR];
    float accm[NR];
    for (int r = 0; r < NR; ++r) { acc[r] = _mm256_setzero_ps(); accm[r] = 0.0f; }
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f), bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nbp; b += 2) {
        __m256i w[2];
        if constexpr (FORMAT == kQ8_0) {  // back to signed int8: dot_signed, no -128 d term
            w[0] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + b * kBlock)), bias);
            w[1] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (b + 1) * kBlock)),
                                    bias);
        } else {
            const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (b / 2) * kBlock));
            w[0] = _mm256_and_si256(both, low_nibbles);
            w[1] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low_nibbles);
        }
        for (int k = 0; k < 2; ++k) {
            const float dw = half_to_float(d[b + k]);
            const float mm = FORMAT == kQ8_0 ? 0.0f : block_min(FORMAT, d, m, b + k);
            for (int r = 0; r < NR; ++r) {
                const __m256i xv = _mm256_loadu_si256(
                    reinterpret_cast<const __m256i*>(a.xq + r * nbp * kBlock + (b + k) * kBlock));
                const __m256i dot = FORMAT == kQ8_0 ? dot_signed(w[k], xv) : dot_unsigned(w[k], xv);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * a.dx[r * nbp + b + k]), acc[r]);
                accm[r] += mm * a.sx[r * nbp + b + k];
            }
        }
    }
    for (int r = 0; r < NR; ++r) result[r] = hsum(acc[r]) + accm[r];
}

#else

template <int64_t FORMAT, int NR>
void column_dot(const uint8_t* qs, const uint16_t* d, const uint16_t* m, Activations a, float* result) {
    const int64_t nbp = a.nbp;
    for (int r = 0; r < NR; ++r) {
        float sum = 0.0f;
        for (int64_t b = 0; b < nbp; ++b) {
            const int8_t* xq = a.xq + r * nbp * kBlock + b * kBlock;
            int32_t dot = 0;
            for (int64_t j = 0; j < kBlock; ++j) dot += stored_quant(FORMAT, qs, b, j) * xq[j];
            sum += half_to_float(d[b]) * a.dx[r * nbp + b] * static_cast<float>(dot) +
                   block_min(FORMAT, d, m, b) * a.sx[r * nbp + b];
        }
        result[r] = sum;
    }
}

#endif

// ---------------------------------------------------------------- the product

struct Weights {
    const uint8_t* qs;
    const uint16_t* d;
    const uint16_t* m;
    int64_t columns;      // N
    int64_t row_bytes;    // bytes of qs per weight row
};

template <int64_t FORMAT, int NR>
void columns_dot(Weights w, int64_t n0, int64_t n1, Activations a, float* result /*[NR][n1 - n0]*/) {
    float one[NR];
    for (int64_t n = n0; n < n1; ++n) {
        column_dot<FORMAT, NR>(w.qs + n * w.row_bytes, w.d + n * a.nbp, w.m ? w.m + n * a.nbp : nullptr, a, one);
        for (int r = 0; r < NR; ++r) result[r * (n1 - n0) + n - n0] = one[r];
    }
}

// out [rows, N] = activations x W.T, work-shared over the calling team by `split` (team_split.h: a preempted
// thread's columns go to the running one).
template <int64_t FORMAT, typename T>
void matmul_for(Weights w, Activations a, int64_t rows, T* out, TeamSplit& split) {
    const int64_t tasks = (w.columns + kColumnsPerTask - 1) / kColumnsPerTask;
    split.run(tasks, 1, [&](int64_t first, int64_t last) {
        for (int64_t task = first; task < last; ++task) {
            const int64_t n0 = task * kColumnsPerTask, n1 = std::min(w.columns, n0 + kColumnsPerTask);
            float tile[kMaxRows * kColumnsPerTask];
            for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
                const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
                const Activations chunk{a.xq + r0 * a.nbp * kBlock, a.dx + r0 * a.nbp, a.sx + r0 * a.nbp, a.nbp};
                switch (nr) {
                    case 1: columns_dot<FORMAT, 1>(w, n0, n1, chunk, tile); break;
                    case 2: columns_dot<FORMAT, 2>(w, n0, n1, chunk, tile); break;
                    case 3: columns_dot<FORMAT, 3>(w, n0, n1, chunk, tile); break;
                    default: columns_dot<FORMAT, 4>(w, n0, n1, chunk, tile); break;
                }
                for (int r = 0; r < nr; ++r)
                    for (int64_t n = n0; n < n1; ++n)
                        store(out + (r0 + r) * w.columns + n, tile[r * (n1 - n0) + n - n0]);
            }
        }
    });
}

// ---------------------------------------------------------------- kX16: 16 columns in one vector's lanes
// Per block: the group's quants unpacked once (4-bit: low and high nibbles of P_q), then per activation row
// 8 integer dot products of a quant vector with 4 activation bytes broadcast to every lane, each lane
// a column: no horizontal sums, no per-pair scale shuffles (measured, one thread, a 3072 x 576 Q4_1
// matrix in cache: 20 us against 116 us for the row-major kernel).

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

template <int64_t FORMAT, int NR>
void x16_group(const uint8_t* qs, int64_t nb, Activations a, float* result /*[NR][16]*/) {
    __m512 acc[NR], accm[NR];
    for (int r = 0; r < NR; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = qs + b * x16_block_bytes(FORMAT);
        __m512i u[8];
        if constexpr (FORMAT == kQ8_0) {
            for (int q = 0; q < 8; ++q) u[q] = _mm512_loadu_si512(p + 64 * q);
        } else {
            for (int q = 0; q < 4; ++q) {
                const __m512i both = _mm512_loadu_si512(p + 64 * q);
                u[q] = _mm512_and_si512(both, low);
                u[q + 4] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
            }
        }
        auto halves = [](const uint16_t* h) {
            return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
        };
        const __m512 dw = halves(x16_scales(p, FORMAT));
        const __m512 mw = FORMAT == kQ4_1 ? halves(x16_mins(p, FORMAT))
                                          : _mm512_mul_ps(dw, _mm512_set1_ps(FORMAT == kQ4_0 ? -8.0f : -128.0f));
        for (int r = 0; r < NR; ++r) {
            const int32_t* xb = reinterpret_cast<const int32_t*>(a.xq + r * a.nbp * kBlock + b * kBlock);
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int q = 0; q < 8; q += 2) {
                s0 = _mm512_dpbusd_epi32(s0, u[q], _mm512_set1_epi32(xb[q]));
                s1 = _mm512_dpbusd_epi32(s1, u[q + 1], _mm512_set1_epi32(xb[q + 1]));
            }
            const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.dx[r * a.nbp + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), scale, acc[r]);
            accm[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sx[r * a.nbp + b]), accm[r]);
        }
    }
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(result + r * 16, _mm512_add_ps(acc[r], accm[r]));
}

#elif defined(__AVX2__) && defined(__FMA__)

// The kX16 loops below prefetch their stream this far ahead (T0, every line of a record as the record is read): with
// the hardware prefetcher alone a batch-1 product from DRAM took 1.15-1.27x a plain read of the same bytes, as it
// stays only a short way ahead while each record's arithmetic runs; 1 KB ahead took 0.87-0.92x as long as without
// (docs/performance.md, "The products' stream prefetched").
constexpr int64_t kX16PrefetchBytes = 1024;

// Every cache line of the record at p, kX16PrefetchBytes ahead (the records follow each other in a thread's run).
template <int64_t FORMAT>
inline void prefetch_ahead(const uint8_t* p) {
    for (int64_t line = 0; line < x16_block_bytes(FORMAT); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p) + kX16PrefetchBytes + line, _MM_HINT_T0);
}

// A 4-bit block's integer dot products, summed in 16 bits: each vpmaddubsw pair sum is at most 2 * 15 * 127
// = 3,810, so eight of them (a block's 32 elements) stay below 2^15, and one vpmaddwd per block, not one per
// 4 elements, widens them. The sums are the same integers as widening each pair sum at once.

// Columns 8h .. 8h + 7 of the group: the second 32 bytes of each 64-byte vector.
template <int64_t FORMAT, int NR>
void x16_half(const uint8_t* qs, int64_t nb, Activations a, int h, float* result /*[NR][16]*/) {
    __m256 acc[NR], accm[NR];
    for (int r = 0; r < NR; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0f), bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* record = qs + b * x16_block_bytes(FORMAT), *p = record + 32 * h;
        if (h == 0) prefetch_ahead<FORMAT>(record);  // (the second half reads the group again, from L1 or L2)
        __m256i u[8];
        if constexpr (FORMAT == kQ8_0) {  // back to signed int8: dot_signed, no -128 d term
            for (int q = 0; q < 8; ++q)
                u[q] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q)), bias);
        } else {
            for (int q = 0; q < 4; ++q) {
                const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q));
                u[q] = _mm256_and_si256(both, low);
                u[q + 4] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low);
            }
        }
        const __m256 dw =
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x16_scales(record, FORMAT) + 8 * h)));
        const __m256 mw = FORMAT == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                                reinterpret_cast<const __m128i*>(x16_mins(record, FORMAT) + 8 * h)))
                                          : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
        for (int r = 0; r < NR; ++r) {
            const int32_t* xb = reinterpret_cast<const int32_t*>(a.xq + r * a.nbp * kBlock + b * kBlock);
            __m256i s;
            if constexpr (FORMAT == kQ8_0) {
                s = _mm256_setzero_si256();
                for (int q = 0; q < 8; ++q) s = _mm256_add_epi32(s, dot_signed(u[q], _mm256_set1_epi32(xb[q])));
            } else {
                __m256i pairs = _mm256_maddubs_epi16(u[0], _mm256_set1_epi32(xb[0]));
                for (int q = 1; q < 8; ++q)
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[q], _mm256_set1_epi32(xb[q])));
                s = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
            }
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.dx[r * a.nbp + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            if constexpr (FORMAT != kQ8_0) accm[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sx[r * a.nbp + b]), accm[r]);
        }
    }
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(result + r * 16 + 8 * h, _mm256_add_ps(acc[r], accm[r]));
}

// One row against a 4-bit group, both halves in one pass over the records: each record read once, each
// activation broadcast once for the two halves (the halves one after the other read every record twice).
template <int64_t FORMAT>
void x16_row4(const uint8_t* qs, int64_t nb, Activations a, float* result /*[16]*/) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, accm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = qs + b * x16_block_bytes(FORMAT);
        prefetch_ahead<FORMAT>(p);
        const int32_t* xb = reinterpret_cast<const int32_t*>(a.xq + b * kBlock);
        __m256i pairs[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int q = 0; q < 4; ++q) {
            const __m256i x_low = _mm256_set1_epi32(xb[q]), x_high = _mm256_set1_epi32(xb[q + 4]);
            for (int h = 0; h < 2; ++h) {
                const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q + 32 * h));
                const __m256i lows = _mm256_maddubs_epi16(_mm256_and_si256(both, low), x_low);
                const __m256i highs = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(both, 4), low), x_high);
                pairs[h] = _mm256_add_epi16(pairs[h], _mm256_add_epi16(lows, highs));
            }
        }
        const __m256 dx = _mm256_set1_ps(a.dx[b]), sx = _mm256_set1_ps(a.sx[b]);
        for (int h = 0; h < 2; ++h) {
            const __m256 dw = _mm256_cvtph_ps(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(x16_scales(p, FORMAT) + 8 * h)));
            const __m256 mw = FORMAT == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(
                                                    reinterpret_cast<const __m128i*>(x16_mins(p, FORMAT) + 8 * h)))
                                              : _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f));
            const __m256i s = _mm256_madd_epi16(pairs[h], _mm256_set1_epi16(1));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc[h]);
            accm[h] = _mm256_fmadd_ps(mw, sx, accm[h]);
        }
    }
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(result + 8 * h, _mm256_add_ps(acc[h], accm[h]));
}

// One row against a Q8_0 group, both halves in one pass (as x16_row4).
inline void x16_row8(const uint8_t* qs, int64_t nb, Activations a, float* result /*[16]*/) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* p = qs + b * x16_block_bytes(kQ8_0);
        prefetch_ahead<kQ8_0>(p);
        const int32_t* xb = reinterpret_cast<const int32_t*>(a.xq + b * kBlock);
        __m256i sums[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int q = 0; q < 8; ++q) {
            const __m256i x = _mm256_set1_epi32(xb[q]);
            for (int h = 0; h < 2; ++h) {
                const __m256i w =
                    _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * q + 32 * h)), bias);
                sums[h] = _mm256_add_epi32(sums[h], dot_signed(w, x));
            }
        }
        const __m256 dx = _mm256_set1_ps(a.dx[b]);
        for (int h = 0; h < 2; ++h) {
            const __m256 dw = _mm256_cvtph_ps(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(x16_scales(p, kQ8_0) + 8 * h)));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[h]), _mm256_mul_ps(dw, dx), acc[h]);
        }
    }
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(result + 8 * h, _mm256_add_ps(acc[h], _mm256_setzero_ps()));
}

template <int64_t FORMAT, int NR>
void x16_group(const uint8_t* qs, int64_t nb, Activations a, float* result /*[NR][16]*/) {
    if constexpr (NR == 1 && FORMAT == kQ8_0) {
        x16_row8(qs, nb, a, result);
    } else if constexpr (NR == 1) {
        x16_row4<FORMAT>(qs, nb, a, result);
    } else {
        x16_half<FORMAT, NR>(qs, nb, a, 0, result);
        x16_half<FORMAT, NR>(qs, nb, a, 1, result);
    }
}

#else

template <int64_t FORMAT, int NR>
void x16_group(const uint8_t* qs, int64_t nb, Activations a, float* result /*[NR][16]*/) {
    for (int r = 0; r < NR; ++r)
        for (int64_t c = 0; c < kGroupColumns; ++c) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* p = qs + b * x16_block_bytes(FORMAT);
                const int8_t* xq = a.xq + r * a.nbp * kBlock + b * kBlock;
                int32_t dot = 0;
                for (int64_t k = 0; k < kBlock; ++k) dot += x16_quant(FORMAT, p, c, k) * xq[k];
                const float step = half_to_float(x16_scales(p, FORMAT)[c]);
                const float mm = FORMAT == kQ4_1 ? half_to_float(x16_mins(p, FORMAT)[c])
                                                 : step * (FORMAT == kQ4_0 ? -8.0f : -128.0f);
                sum += step * a.dx[r * a.nbp + b] * static_cast<float>(dot) + mm * a.sx[r * a.nbp + b];
            }
            result[r * 16 + c] = sum;
        }
}

#endif

// Groups a thread takes at a time (team_split.h): a few KB of weights.
constexpr int64_t kX16GroupsPerStep = 2;

// out [rows, N] for kX16 weights, work-shared over the calling team by `split`: a work item is a group of 16 columns.
template <int64_t FORMAT, typename T>
void x16_matmul_for(const uint8_t* qs, int64_t nb, Activations a, int64_t rows, int64_t columns, T* out,
                    TeamSplit& split) {
    const int64_t groups = columns / kGroupColumns, group_bytes = nb * x16_block_bytes(FORMAT);
    auto run = [&](int64_t first, int64_t last) {
        for (int64_t g = first; g < last; ++g) {
            const uint8_t* qg = qs + g * group_bytes;
            float tile[kMaxRows * kGroupColumns];
            for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
                const int nr = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
                const Activations chunk{a.xq + r0 * a.nbp * kBlock, a.dx + r0 * a.nbp, a.sx + r0 * a.nbp, a.nbp};
                switch (nr) {
                    case 1: x16_group<FORMAT, 1>(qg, nb, chunk, tile); break;
                    case 2: x16_group<FORMAT, 2>(qg, nb, chunk, tile); break;
                    case 3: x16_group<FORMAT, 3>(qg, nb, chunk, tile); break;
                    default: x16_group<FORMAT, 4>(qg, nb, chunk, tile); break;
                }
                for (int r = 0; r < nr; ++r)
                    for (int64_t c = 0; c < kGroupColumns; ++c)
                        store(out + (r0 + r) * columns + g * kGroupColumns + c, tile[r * kGroupColumns + c]);
            }
        }
    };
    split.run(groups, kX16GroupsPerStep, run);
}

// Room for the int8 activations of a team's products, and how their columns are shared (team_split.h). Up to
// kPrivateRows rows, each thread quantizes them into a copy of its own and starts on its columns at once: a shared
// copy needs a barrier between the quantization and the product (docs/performance.md). More rows are quantized
// once, split over the team.
constexpr int64_t kPrivateRows = 8;

struct Scratch {
    std::vector<int8_t> xq;  // the shared copy
    std::vector<float> dx, sx;
    std::vector<int8_t> own_xq;  // a copy per thread, kPrivateRows rows of `own_nbp` blocks each
    std::vector<float> own_dx, own_sx;
    int64_t own_nbp = 0;
    TeamSplit split;  // reset by the owner before each team that uses it

    // Room for `rows` rows of up to `nbp` blocks; from outside the team, before it starts.
    void reserve(int64_t rows, int64_t nbp) {
        if (rows > kPrivateRows) {
            if (static_cast<int64_t>(dx.size()) >= rows * nbp) return;
            xq.resize(rows * nbp * kBlock);
            dx.resize(rows * nbp);
            sx.resize(rows * nbp);
            return;
        }
        own_nbp = std::max(own_nbp, nbp);
        const int64_t blocks = TeamSplit::team_size() * kPrivateRows * own_nbp;
        if (static_cast<int64_t>(own_dx.size()) >= blocks) return;
        own_xq.resize(blocks * kBlock);
        own_dx.resize(blocks);
        own_sx.resize(blocks);
    }

    // Where `rows` rows of activations go: the calling thread's own copy, or the shared one.
    struct Copy {
        int8_t* xq;
        float* dx;
        float* sx;
    };
    Copy copy_for(int64_t rows, int64_t nbp) {
        if (rows > kPrivateRows) {
            assert(static_cast<int64_t>(dx.size()) >= rows * nbp);  // reserve() was told
            return Copy{xq.data(), dx.data(), sx.data()};
        }
        int64_t thread = 0;
#if defined(_OPENMP)
        thread = omp_get_thread_num();
#endif
        const int64_t first = thread * kPrivateRows * own_nbp;  // in blocks
        assert(nbp <= own_nbp && first + kPrivateRows * own_nbp <= static_cast<int64_t>(own_dx.size()));
        return Copy{own_xq.data() + first * kBlock, own_dx.data() + first, own_sx.data() + first};
    }
};

// A GGUF weight as the kernels take it (see the top of this file).
struct BlockMatrix {
    const uint8_t* qs;
    const uint16_t* d;  // kRows only: kX16 blocks hold their scales (quant_blocks.h)
    const uint16_t* m;  // kRows, Q4_1 only
    int64_t format;
    int64_t nbp;     // blocks per row as stored (kX16: nb)
    int64_t layout;  // kRows or kX16 (quant_blocks.h)
};

// out [rows, N] = x [rows, K] @ W.T with integer dot products, work-shared over the calling team: the
// rows are quantized into `scratch` (reserved for rows x nbp by the caller, before the team starts),
// then the team splits the columns (scratch.split). Call it from every thread of a team, or from outside one.
// `out` may be float32 for bf16 x (logits, written unrounded).
template <typename TX, typename TO>
void integer_product_for(const TX* x, const BlockMatrix& w, TO* out, int64_t rows, int64_t K, int64_t N,
                         Scratch& scratch) {
    const int64_t nbp = w.nbp, nb = K / kBlock;
    const Scratch::Copy copy = scratch.copy_for(rows, nbp);
    auto quantize = [&](int64_t r) {
        quantize_row(x + r * K, copy.xq + r * nbp * kBlock, copy.dx + r * nbp, copy.sx + r * nbp, nb, nbp);
    };
    if (rows <= kPrivateRows) {
        for (int64_t r = 0; r < rows; ++r) quantize(r);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) quantize(r);
    }
    const Activations a{copy.xq, copy.dx, copy.sx, nbp};
    if (w.layout == kX16) {
        switch (w.format) {
            case kQ4_0: x16_matmul_for<kQ4_0>(w.qs, nb, a, rows, N, out, scratch.split); break;
            case kQ4_1: x16_matmul_for<kQ4_1>(w.qs, nb, a, rows, N, out, scratch.split); break;
            default: x16_matmul_for<kQ8_0>(w.qs, nb, a, rows, N, out, scratch.split); break;
        }
        return;
    }
    const Weights weights{w.qs, w.d, w.format == kQ4_1 ? w.m : nullptr, N,
                          w.format == kQ8_0 ? nbp * kBlock : nbp * kBlock / 2};
    switch (w.format) {
        case kQ4_0: matmul_for<kQ4_0>(weights, a, rows, out, scratch.split); break;
        case kQ4_1: matmul_for<kQ4_1>(weights, a, rows, out, scratch.split); break;
        default: matmul_for<kQ8_0>(weights, a, rows, out, scratch.split); break;
    }
}

}  // namespace quant
}  // namespace pagedserve
