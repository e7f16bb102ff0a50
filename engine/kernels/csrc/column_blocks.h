// The column-block matrix product for CPUs: out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) on a weight
// packed once, at load, into blocks of kBlockN = 64 output columns (the last one padded with zero columns):
//   float32   packed[N / 64][K][64]           column j of block b at packed[b][k][j]
//   bfloat16  packed[N / 64][K / 2][64][2]    k pairs side by side (K padded to even with zeros), the
//                                              layout AVX512-BF16's dot product of pairs reads
// A micro-kernel keeps an [MR rows x 16 NC columns] tile of float32 accumulators in registers, one vector
// of 16 output columns each, and walks k once: per k (a k pair in bf16) it loads NC weight vectors and,
// per row, broadcasts the row's x (pair) and multiplies-adds it into the row's NC vectors (vdpbf16ps in
// bf16). Every output element is summed in one fixed order (k ascending, float32; on AVX512-BF16 a pair
// of k at a time, denormals flushed, as vdpbf16ps computes it) whatever the number of rows, the row's
// place in the batch, the tile shape or the thread count: the product is batch invariant by construction
// (the AMX tile path below groups the sums by 32 k instead: batch-invariant mode never takes it).
// No per-output horizontal sums, and each weight vector loaded is used by up to MR rows: on a 2-core
// AVX512-BF16 machine, one thread, it measured 108-113 G MAC/s from 16 rows on (torch's oneDNN: 80-110)
// and 35 GB/s of weight read at 1 row (the plain-layout kernel of gemv.h: 31; torch: 13), so it is the
// engine's bf16 product there at every row count (engine/models/invariant_linear.py); on CPUs with AMX,
// on the tile unit (below).
//
// float32 on AVX-512: tiles of up to 6 rows x 64 columns in one pass over K. AVX2 builds (no AVX-512) have tiles
// of their own: 16 vector registers of 8 lanes hold at most 12 accumulators, so a tile of MR <= 6 rows walks K
// once per part of 12 / MR vectors (6 rows: four parts of 16 columns; 1 row: the whole block in one pass). A
// block read in several passes would stall its first pass on memory while the others run from L2 with the
// memory idle, so those items prefetch the next block's lines spread through all their k steps (Spread). Either
// way an item's rows are split into tiles as evenly as can be. Against oneDNN's packed weights from memory the
// float32 product is about as fast or faster at every row count measured (1 to 2,048: docs/performance.md,
// "Float32 column blocks on AVX2" and "... on AVX-512"), so it is the engine's float32 product there.
//
// Work items are (column block, chunk of up to kRowsPerChunk rows) pairs, or, when a product has fewer
// items than 4 per thread (576 output columns at one row are 9 items: fewer than 16 on 4 threads), half
// blocks of 32 columns, so that the threads split a small matrix evenly; threads share the items by
// team_split.h (a contiguous run each, and a preempted thread's items go to the running one). The k sum is
// never split.
//
// Layouts (row-major): x [M, K] contiguous; out [M, N] contiguous; bias [N] or null.
#pragma once

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"
#include "team_split.h"

namespace pagedserve {
namespace column_blocks {

constexpr int64_t kBlockN = 64;
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
// float32 tiles in vector registers (below): the engine's float32 product where built (invariant_linear.cpp's probe)
#define PAGEDSERVE_COLUMN_BLOCKS_F32_TILES 1
#endif
#if defined(PAGEDSERVE_COLUMN_BLOCKS_F32_TILES)
// AVX-512: 6 x 4 = 24 of the 32 registers accumulate, the 4 weight vectors and a broadcast beside them; AVX2:
// 12 of the 16, in parts (below)
constexpr int kRowsPerTile = 6;
#else
constexpr int kRowsPerTile = 4;
#endif
constexpr int64_t kRowsPerChunk = 128;          // rows one work item covers (bounds the x read per item)
constexpr int64_t kParallelMinMacs = 1 << 18;   // below this, one thread beats waking the pool
constexpr int64_t kItemsPerThread = 4;          // fewer blocks than this per thread: split them in halves

// Stores one tile row of float32 sums (+ bias) into columns [0, n_valid) of out.
template <typename T>
inline void store_row(const float* acc, const T* bias, T* out, int64_t n_valid) {
    for (int64_t j = 0; j < n_valid; ++j) store(out + j, bias ? acc[j] + to_float(bias[j]) : acc[j]);
}

// A tile of MR rows by NC vectors of 16 columns, the block's columns [16 c0, 16 (c0 + NC)); `w` points at the
// block, `out` and `bias` at its first column; n_valid of the tile's 16 NC columns are stored.
#if defined(__AVX512F__)

template <int MR, int NC>
void tile_f32(const float* x, int64_t K, const float* w, int c0, const float* bias, float* out, int64_t N,
              int64_t n_valid) {
    __m512 acc[MR][NC];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = w + k * kBlockN + 16 * c0;
        __m512 wv[NC];
        for (int c = 0; c < NC; ++c) {
            wv[c] = _mm512_loadu_ps(wk + 16 * c);
            // kept in a register: GCC would fold the load into each row's FMA, MR loads of every vector per k,
            // and the loads, not the FMAs, would then set the pace
            asm("" : "+v"(wv[c]));
        }
        for (int r = 0; r < MR; ++r) {
            const __m512 xv = _mm512_set1_ps(x[r * K + k]);
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    alignas(64) float row[16 * NC];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NC; ++c) _mm512_store_ps(row + 16 * c, acc[r][c]);
        store_row(row, bias, out + r * N, n_valid);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

// The next block's lines prefetched a few at a time through the k steps of this one (Bresenham: `lines` of them
// spread evenly over `steps`), so that its read overlaps the arithmetic of this block's passes instead of
// stalling the first of them.
struct Spread {
    const char* at;
    int64_t lines, steps, credit;
    void step() {
        for (credit += lines; credit >= steps; credit -= steps, at += 64) _mm_prefetch(at, _MM_HINT_T0);
    }
};

// MR rows by V vectors of 8 columns from the block's column `col` (MR x V accumulators held in registers).
template <int MR, int V>
inline void part_f32(const float* x, int64_t K, const float* w, int64_t col, const float* bias, float* out,
                     int64_t N, int64_t n_valid, Spread* spread) {
    __m256 acc[MR][V];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
    const float* wk = w + col;
    auto step = [&](int64_t k) {
        __m256 wv[V];
        for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(wk + 8 * v);
        for (int r = 0; r < MR; ++r) {
            const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
            for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
        }
        wk += kBlockN;
    };
    if (spread != nullptr) {
        for (int64_t k = 0; k < K; ++k) {
            spread->step();
            step(k);
        }
    } else {
        for (int64_t k = 0; k < K; ++k) step(k);
    }
    // every accumulator stored by constant indices first: indexed by a loop variable, GCC keeps acc in memory
    // and stores it on every k
    alignas(32) float rows[MR][8 * V];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) _mm256_store_ps(rows[r] + 8 * v, acc[r][v]);
    for (int r = 0; r < MR; ++r) store_row(rows[r], bias, out + r * N, n_valid);
}

// Vectors per part of an MR-row tile: at most 12 accumulators (and 2 NC, the tile's width).
template <int MR, int NC>
constexpr int kVectors = 12 / MR < 2 * NC ? 12 / MR : 2 * NC;

// The columns [col, col + width) of an MR-row tile, V vectors at a time (the last part narrower).
template <int MR, int V>
inline void parts_f32(const float* x, int64_t K, const float* w, int64_t col, int64_t width, const float* bias,
                      float* out, int64_t N, int64_t n_valid, Spread* spread) {
    for (int64_t j = 0; j < width && j < n_valid; j += 8 * V) {
        const int64_t valid = n_valid - j < 8 * V ? n_valid - j : 8 * V;
        if (width - j >= 8 * V)
            part_f32<MR, V>(x, K, w, col + j, bias ? bias + j : nullptr, out + j, N, valid, spread);
        else if constexpr (V > 1)
            parts_f32<MR, V - 1>(x, K, w, col + j, width - j, bias ? bias + j : nullptr, out + j, N, valid, spread);
    }
}

// Passes over K that an MR-row tile of NC x 16 columns makes.
template <int MR, int NC>
constexpr int64_t passes_f32() {
    constexpr int V = kVectors<MR, NC>;
    return (16 * NC + 8 * V - 1) / (8 * V);
}

template <int MR, int NC>
void tile_f32(const float* x, int64_t K, const float* w, int c0, const float* bias, float* out, int64_t N,
              int64_t n_valid, Spread* spread) {
    parts_f32<MR, kVectors<MR, NC>>(x, K, w, 16 * c0, 16 * NC, bias, out, N, n_valid, spread);
}
#define PAGEDSERVE_COLUMN_BLOCKS_SPREAD 1

#else

template <int MR, int NC>
void tile_f32(const float* x, int64_t K, const float* w, int c0, const float* bias, float* out, int64_t N,
              int64_t n_valid) {
    float acc[MR][16 * NC] = {};
    for (int64_t k = 0; k < K; ++k) {
        const float* wk = w + k * kBlockN + 16 * c0;
        for (int r = 0; r < MR; ++r) {
            const float xv = x[r * K + k];
#pragma omp simd
            for (int64_t j = 0; j < 16 * NC; ++j) acc[r][j] += xv * wk[j];
        }
    }
    for (int r = 0; r < MR; ++r) store_row(acc[r], bias, out + r * N, n_valid);
}

#endif

#if defined(__AVX512BF16__)

// Two bf16 of row r at k = 2p, 2p + 1 as one 32-bit lane (the second one zero past an odd K).
inline int32_t bf16_pair(const uint16_t* row, int64_t p, int64_t K) {
    if (2 * p + 1 < K) {
        int32_t both;
        std::memcpy(&both, row + 2 * p, sizeof both);  // little endian: k = 2p in the low half
        return both;
    }
    return static_cast<int32_t>(row[2 * p]);
}

template <int MR, int NC>
void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, int c0, const uint16_t* bias, uint16_t* out,
               int64_t N, int64_t n_valid) {
    __m512 acc[MR][NC];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = (K + 1) / 2, even_pairs = K / 2;
    const uint16_t* wc = w + 32 * c0;
    int64_t p = 0;
    for (; p < even_pairs; ++p) {  // whole pairs: each row's pair read as one 32-bit broadcast
        const uint16_t* wp = wc + p * 2 * kBlockN;
#if defined(PAGEDSERVE_GEMV_PREFETCH)
        for (int c = 0; c < NC; ++c)
            _mm_prefetch(reinterpret_cast<const char*>(wp + 32 * c) + PAGEDSERVE_GEMV_PREFETCH, _MM_HINT_T0);
#endif
        __m512bh wv[NC];
        for (int c = 0; c < NC; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp + 32 * c);
        for (int r = 0; r < MR; ++r) {
            int32_t both;
            std::memcpy(&both, x + r * K + 2 * p, sizeof both);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(both);
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (; p < pairs; ++p) {  // an odd K's last element, paired with zero
        const uint16_t* wp = wc + p * 2 * kBlockN;
        __m512bh wv[NC];
        for (int c = 0; c < NC; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(wp + 32 * c);
        for (int r = 0; r < MR; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(bf16_pair(x + r * K, p, K));
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    alignas(64) float row[16 * NC];
    for (int r = 0; r < MR; ++r) {
        for (int c = 0; c < NC; ++c) _mm512_store_ps(row + 16 * c, acc[r][c]);
        store_row(row, bias, out + r * N, n_valid);
    }
}

#else

template <int MR, int NC>
void tile_bf16(const uint16_t* x, int64_t K, const uint16_t* w, int c0, const uint16_t* bias, uint16_t* out,
               int64_t N, int64_t n_valid) {
    float acc[MR][16 * NC] = {};
    for (int64_t k = 0; k < K; ++k) {
        const uint16_t* wk = w + (k / 2) * 2 * kBlockN + 32 * c0 + (k % 2);
        for (int r = 0; r < MR; ++r) {
            const float xv = to_float(x[r * K + k]);
#pragma omp simd
            for (int64_t j = 0; j < 16 * NC; ++j) acc[r][j] += xv * to_float(wk[2 * j]);
        }
    }
    for (int r = 0; r < MR; ++r) store_row(acc[r], bias, out + r * N, n_valid);
}

#endif

// ------------------------------------------------------------------------------------- AMX tiles (bf16)
// On CPUs with AMX (Sapphire Rapids and newer), products whose K is a multiple of 32 run on the tile unit,
// at every row count: the bf16 packing above is already the layout its B tiles read (16 k pairs x 16
// columns, one 64-byte row per pair, a 256-byte stride within a block). Per group of up to 16 rows and per
// 32 k: one A tile of x, one B tile per 16 columns, tdpbf16ps into float32 C tiles. Sums are grouped by 32 k,
// not pairs: other bits than the vdpbf16ps path, so batch-invariant mode never takes it. 2-core Xeon, 2
// threads, the embedded model's 121 products from memory (ms; vdpbf16ps, then oneDNN on weights packed for
// AMX, in brackets): 1 row 13.5-14.3 (13.7-14.8 with the prefetch in tile_bf16), 4 rows 13.4-14.4 (15.9),
// 16 rows 13.1-14.2 (oneDNN 15.6), 64 rows 23.3-24.7 (oneDNN 20.3). A software prefetch of the B rows, and
// two row groups sharing each B tile, measured no gain.
constexpr int64_t kAmxK = 32;

// Whether the process may use the tile unit (Linux grants it on request: pagedserve_amx_tiles()); callers
// still choose per product (`amx`), since batch-invariant mode and a failed self-check keep products off it.
inline std::atomic<bool>& amx_permitted() {
    static std::atomic<bool> permitted{false};
    return permitted;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGEDSERVE_COLUMN_BLOCKS_AMX 1

struct alignas(64) AmxConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Tiles 0-3: C (rows x 16 float32), 4: A (rows x 32 bf16), 5-7: B (16 pairs x 16 columns).
inline void amx_configure(int rows) {
    AmxConfig config;
    for (int t = 0; t < 5; ++t) config.rows[t] = static_cast<uint8_t>(rows), config.colsb[t] = 64;
    for (int t = 5; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

// `rows` (<= 16) rows of x times NT x 16 columns of the block from column 16 c0; n_valid stored.
template <int NT>
void amx_rows(const uint16_t* x, int rows, int64_t K, const uint16_t* w, int c0, const uint16_t* bias,
              uint16_t* out, int64_t N, int64_t n_valid) {
    amx_configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (NT == 4) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const uint16_t* wc = w + 32 * c0;
    const int64_t stride = K * static_cast<int64_t>(sizeof(uint16_t));
    for (int64_t k = 0; k < K; k += kAmxK) {
        const uint16_t* wk = wc + (k / 2) * 2 * kBlockN;
        _tile_loadd(4, x + k, stride);
        _tile_loadd(5, wk, 4 * kBlockN);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wk + 32, 4 * kBlockN);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (NT == 4) {
            _tile_loadd(7, wk + 64, 4 * kBlockN);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, wk + 96, 4 * kBlockN);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    alignas(64) float sums[16 * 64];
    _tile_stored(0, sums, 64 * sizeof(float));
    _tile_stored(1, sums + 16, 64 * sizeof(float));
    if constexpr (NT == 4) {
        _tile_stored(2, sums + 32, 64 * sizeof(float));
        _tile_stored(3, sums + 48, 64 * sizeof(float));
    }
    for (int r = 0; r < rows; ++r) store_row(sums + 64 * r, bias, out + r * N, n_valid);
}
#endif

#if !defined(PAGEDSERVE_COLUMN_BLOCKS_SPREAD)
struct Spread {};
#endif

template <int MR, int NC>
inline void tile_of(const float* x, int64_t K, const float* w, int c0, const float* bias, float* out, int64_t N,
                    int64_t n_valid, Spread* spread) {
#if defined(PAGEDSERVE_COLUMN_BLOCKS_SPREAD)
    tile_f32<MR, NC>(x, K, w, c0, bias, out, N, n_valid, spread);
#else
    (void)spread;
    tile_f32<MR, NC>(x, K, w, c0, bias, out, N, n_valid);
#endif
}

template <int MR, int NC>
inline void tile_of(const uint16_t* x, int64_t K, const uint16_t* w, int c0, const uint16_t* bias, uint16_t* out,
                    int64_t N, int64_t n_valid, Spread*) {
    tile_bf16<MR, NC>(x, K, w, c0, bias, out, N, n_valid);
}

template <typename T, int NC>
inline void tile(const T* x, int rows, int64_t K, const T* w, int c0, const T* bias, T* out, int64_t N,
                 int64_t n_valid, Spread* spread) {
    switch (rows) {
        case 6: if constexpr (kRowsPerTile >= 6) tile_of<6, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
        case 5: if constexpr (kRowsPerTile >= 5) tile_of<5, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
        case 4: tile_of<4, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
        case 3: tile_of<3, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
        case 2: tile_of<2, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
        default: tile_of<1, NC>(x, K, w, c0, bias, out, N, n_valid, spread); break;
    }
}

// The rows of tile `index` of `tiles`: 6-row tiles split an item's rows as evenly as can be (8 rows: 4 + 4, not
// 6 + 2, whose 2-row tile runs at a third of the FMA rate); 4-row ones keep full tiles first.
inline int tile_rows(int64_t rows, int64_t tiles, int64_t index) {
    if constexpr (kRowsPerTile == 6) return static_cast<int>(rows / tiles + (index < rows % tiles));
    const int64_t left = rows - index * kRowsPerTile;
    return static_cast<int>(left < kRowsPerTile ? left : kRowsPerTile);
}

// Elements of one packed column block: K x 64 (float32) or ceil(K / 2) x 64 x 2 (bfloat16).
template <typename T>
constexpr int64_t block_elements(int64_t K) {
    return (sizeof(T) == 2 ? (K + 1) / 2 * 2 : K) * kBlockN;
}

// Whether a product of M rows by K runs on the AMX tiles (`amx`: the caller allows it).
template <typename T>
inline bool on_amx(bool amx, int64_t M, int64_t K) {
#if defined(PAGEDSERVE_COLUMN_BLOCKS_AMX)
    return sizeof(T) == 2 && amx && M > 0 && K % kAmxK == 0 && amx_permitted().load();
#else
    (void)amx, (void)M, (void)K;
    return false;
#endif
}

// Rows [m0, m1) of the block's columns [32 half, 32 half + width) (width 64: the whole block).
template <typename T>
void run_item(const T* x, const T* packed, const T* bias, T* out, int64_t N, int64_t K, int64_t block, int half,
              int64_t width, int64_t m0, int64_t m1, bool tiles) {
    const int64_t n0 = block * kBlockN + 32 * half;
    if (n0 >= N) return;  // a padding half
    const int64_t n_valid = N - n0 < width ? N - n0 : width;
    const T* w = packed + block * block_elements<T>(K);
    const T* b = bias ? bias + n0 : nullptr;
#if defined(PAGEDSERVE_COLUMN_BLOCKS_AMX)
    if constexpr (sizeof(T) == 2) {
        if (tiles) {
            for (int64_t m = m0; m < m1; m += 16) {
                const int rows = static_cast<int>(m1 - m < 16 ? m1 - m : 16);
                if (width == kBlockN) amx_rows<4>(x + m * K, rows, K, w, 0, b, out + m * N + n0, N, n_valid);
                else amx_rows<2>(x + m * K, rows, K, w, 2 * half, b, out + m * N + n0, N, n_valid);
            }
            return;
        }
    }
#endif
    (void)tiles;
    const int64_t count = (m1 - m0 + kRowsPerTile - 1) / kRowsPerTile;
    Spread* spread = nullptr;
#if defined(PAGEDSERVE_COLUMN_BLOCKS_SPREAD)
    // A whole block's item in more than one pass over K prefetches the next block through its passes (one pass
    // reads in address order, which the hardware prefetcher follows alone).
    Spread next{};
    if constexpr (sizeof(T) == 4) {
        int64_t passes = 0;
        for (int64_t i = 0; i < count; ++i) {
            switch (tile_rows(m1 - m0, count, i)) {
                case 6: passes += passes_f32<6, 4>(); break;
                case 5: passes += passes_f32<5, 4>(); break;
                case 4: passes += passes_f32<4, 4>(); break;
                case 3: passes += passes_f32<3, 4>(); break;
                case 2: passes += passes_f32<2, 4>(); break;
                default: passes += passes_f32<1, 4>(); break;
            }
        }
        if (width == kBlockN && passes > 1 && (block + 1) * kBlockN < N) {
            next = Spread{reinterpret_cast<const char*>(w + block_elements<T>(K)),
                          block_elements<T>(K) * static_cast<int64_t>(sizeof(T)) / 64, passes * K, 0};
            spread = &next;
        }
    }
#endif
    for (int64_t i = 0, m = m0; i < count; ++i) {
        const int rows = tile_rows(m1 - m0, count, i);
        if (width == kBlockN) tile<T, 4>(x + m * K, rows, K, w, 0, b, out + m * N + n0, N, n_valid, spread);
        else tile<T, 2>(x + m * K, rows, K, w, 2 * half, b, out + m * N + n0, N, n_valid, spread);
        m += rows;
    }
}

// out = x @ W^T (+ bias), work-shared over the calling OpenMP team by `split` (team_split.h: call it from
// inside a parallel region, every thread of the team, or from outside one to run it on this thread).
// `amx`: bf16 products whose K is a multiple of 32 may run on the tile unit where it is built in and permitted.
template <typename T>
void product_for(const T* x, const T* packed, const T* bias, T* out, int64_t M, int64_t N, int64_t K, TeamSplit& split,
                 bool amx = false) {
    const bool tiles = on_amx<T>(amx, M, K);
    const int64_t threads = omp_get_num_threads();
    const int64_t num_blocks = (N + kBlockN - 1) / kBlockN;
    const int64_t num_chunks = (M + kRowsPerChunk - 1) / kRowsPerChunk;
    const bool halves = num_blocks * num_chunks < kItemsPerThread * threads;
    const int64_t column_items = halves ? 2 * num_blocks : num_blocks;
    const int64_t items = column_items * num_chunks;
    auto run = [&](int64_t first, int64_t last) {
        for (int64_t item = first; item < last; ++item) {
            const int64_t column_item = item % column_items, chunk = item / column_items;
            const int64_t m0 = chunk * kRowsPerChunk, m1 = m0 + kRowsPerChunk < M ? m0 + kRowsPerChunk : M;
            if (halves)
                run_item(x, packed, bias, out, N, K, column_item / 2, static_cast<int>(column_item % 2), 32, m0, m1,
                         tiles);
            else run_item(x, packed, bias, out, N, K, column_item, 0, kBlockN, m0, m1, tiles);
        }
    };
    split.run(items, 1, run);
}

}  // namespace column_blocks
}  // namespace pagedserve

