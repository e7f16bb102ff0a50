// A batch-invariant matrix product for CPUs: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]), where every
// output element is summed in one fixed order (k ascending, in float32; on AVX512-BF16 a pair of k at a
// time, as vdpbf16ps computes it, denormals flushed) whatever the number of rows M,
// the row's place in the batch or the thread count. (oneDNN's products pick other kernels, and other
// reduction orders, for other M: one row alone and the same row among others round differently.)
//
// The weight is packed once, at load, into blocks of kBlockN = 64 output columns (the last one padded
// with zero columns):
//   float32   packed[N / 64][K][64]           column j of block b at packed[b][k][j]
//   bfloat16  packed[N / 64][K / 2][64][2]    k pairs side by side (K padded to even with zeros), the
//                                              layout AVX512-BF16's dot product of pairs reads
// A micro-kernel keeps an [MR rows x 64 columns] tile of float32 accumulators in registers and walks k
// once, so each element's sum is the same sequence of operations for every M (a short last tile of
// rows runs the same per-element code). Threads split blocks of columns (and, for long batches,
// chunks of rows): never the k sum.
//
// Layouts (row-major): x [M, K] contiguous; out [M, N] contiguous; bias [N] or null.
// Built and loaded by engine/kernels/cpu.py.

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

namespace {

using pagedserve::store;
using pagedserve::to_float;

constexpr int64_t kBlockN = 64;
constexpr int kRowsPerTile = 4;
constexpr int64_t kRowsPerChunk = 128;          // rows one work item covers (bounds the x read per item)
constexpr int64_t kParallelMinMacs = 1 << 18;   // below this, one thread beats waking the pool

// Stores one tile row of float32 sums (+ bias) into columns [0, n_valid) of out.
template <typename T>
inline void store_row(const float* acc, const T* bias, T* out, int64_t n_valid) {
    for (int64_t j = 0; j < n_valid; ++j) store(out + j, bias ? acc[j] + to_float(bias[j]) : acc[j]);
}

#if defined(__AVX512F__)

template <int MR>
void tile_f32(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t N,
              int64_t n_valid) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = w + k * kBlockN;
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
        const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    alignas(64) float row[kBlockN];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < 4; ++c) _mm512_store_ps(row + 16 * c, acc[r][c]);
        store_row(row, bias, out + r * N, n_valid);
    }
}

#else

template <int MR>
void tile_f32(const float* x, int64_t K, const float* w, const float* bias, float* out, int64_t N,
              int64_t n_valid) {
    float acc[MR][kBlockN] = {};
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = w + k * kBlockN;
        for (int r = 0; r < MR; ++r) {
            const float xv = x[r * K + k];
#pragma omp simd
            for (int64_t j = 0; j < kBlockN; ++j) acc[r][j] += xv * wk[j];
        }
    }
    for (int r = 0; r < MR; ++r) store_row(acc[r], bias, out + r * N, n_valid);
}

#endif

#if defined(__AVX512BF16__)

// Two bf16 of row r at k = 2p, 2p + 1 as one 32-bit lane (the second one zero past K).
inline uint32_t bf16_pair(const uint16_t* row, int64_t p, int64_t K) {
    const uint32_t lo = row[2 * p];
    const uint32_t hi = 2 * p + 1 < K ? row[2 * p + 1] : 0u;
    return lo | (hi << 16);
}

template <int MR>
void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* out,
               int64_t N, int64_t n_valid) {
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = (K + 1) / 2;
    for (int64_t p = 0; p < pairs; ++p) {
        const uint16_t* wp = w + p * 2 * kBlockN;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 64), w3 = (__m512bh)_mm512_loadu_si512(wp + 96);
        for (int r = 0; r < MR; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(bf16_pair(x + r * K, p, K)));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
            acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
        }
    }
    alignas(64) float row[kBlockN];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < 4; ++c) _mm512_store_ps(row + 16 * c, acc[r][c]);
        store_row(row, bias, out + r * N, n_valid);
    }
}

#else

template <int MR>
void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* out,
               int64_t N, int64_t n_valid) {
    float acc[MR][kBlockN] = {};
    for (int64_t k = 0; k < K; ++k) {
        const uint16_t* wk = w + (k / 2) * 2 * kBlockN + (k % 2);
        for (int r = 0; r < MR; ++r) {
            const float xv = to_float(x[r * K + k]);
#pragma omp simd
            for (int64_t j = 0; j < kBlockN; ++j) acc[r][j] += xv * to_float(wk[2 * j]);
        }
    }
    for (int r = 0; r < MR; ++r) store_row(acc[r], bias, out + r * N, n_valid);
}

#endif

inline void tile(const float* x, int rows, int64_t K, const float* w, const float* bias, float* out, int64_t N,
                 int64_t n_valid) {
    switch (rows) {
        case 4: tile_f32<4>(x, K, w, bias, out, N, n_valid); break;
        case 3: tile_f32<3>(x, K, w, bias, out, N, n_valid); break;
        case 2: tile_f32<2>(x, K, w, bias, out, N, n_valid); break;
        default: tile_f32<1>(x, K, w, bias, out, N, n_valid); break;
    }
}

inline void tile(const uint16_t* x, int rows, int64_t K, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                 int64_t N, int64_t n_valid) {
    switch (rows) {
        case 4: tile_bf16<4>(x, K, w, bias, out, N, n_valid); break;
        case 3: tile_bf16<3>(x, K, w, bias, out, N, n_valid); break;
        case 2: tile_bf16<2>(x, K, w, bias, out, N, n_valid); break;
        default: tile_bf16<1>(x, K, w, bias, out, N, n_valid); break;
    }
}

// Elements of one packed column block: K x 64 (float32) or ceil(K / 2) x 64 x 2 (bfloat16).
template <typename T>
constexpr int64_t block_elements(int64_t K) {
    return (sizeof(T) == 2 ? (K + 1) / 2 * 2 : K) * kBlockN;
}

template <typename T>
void invariant_linear(const T* x, const T* packed, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
    const int64_t num_blocks = (N + kBlockN - 1) / kBlockN;
    const int64_t num_chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
    const int64_t items = num_blocks * num_chunks;
    const int64_t block_size = block_elements<T>(K);
#pragma omp parallel for schedule(static) if (M * N * K >= kParallelMinMacs)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t block = item % num_blocks, chunk = item / num_blocks;
        const int64_t n0 = block * kBlockN;
        const int64_t n_valid = N - n0 < kBlockN ? N - n0 : kBlockN;
        const T* w = packed + block * block_size;
        const T* b = bias ? bias + n0 : nullptr;
        const int64_t m_end = (chunk + 1) * kRowsPerChunk < M ? (chunk + 1) * kRowsPerChunk : M;
        for (int64_t m = chunk * kRowsPerChunk; m < m_end; m += kRowsPerTile) {
            const int rows = static_cast<int>(m_end - m < kRowsPerTile ? m_end - m : kRowsPerTile);
            tile(x + m * K, rows, K, w, b, out + m * N + n0, N, n_valid);
        }
    }
}

}  // namespace

#define PAGEDSERVE_INVARIANT_LINEAR(SUFFIX, T)                                                                 \
    void pagedserve_invariant_linear_##SUFFIX(const T* x, const T* packed, const T* bias, T* out, int64_t M,    \
                                              int64_t N, int64_t K) {                                           \
        invariant_linear(x, packed, bias, out, M, N, K);                                                        \
    }

extern "C" {
PAGEDSERVE_INVARIANT_LINEAR(f32, float)
PAGEDSERVE_INVARIANT_LINEAR(bf16, uint16_t)
}
