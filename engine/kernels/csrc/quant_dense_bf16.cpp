// Batched products of bf16 activations with GGUF blocks on AVX512-BF16: out = x @ W.T, where each work
// item dequantizes a tile of 16 weight rows (output columns) to bf16 once, into a per-thread scratch
// [16, K] that stays in L1/L2, and multiplies every activation row with it (vdpbf16ps, float32 sums):
//
//     for a tile of columns:  dequantize W[n0:n0+16, :] -> tile (bf16)
//         for rows r0 += 4:  for columns c0 += 4:  acc[4 x 4] += x[r, k:k+32] . tile[c, k:k+32]  (k += 32)
//
// float32 activations are rounded to bf16 first (finer than the int8 blocks of the integer kernel); the sums
// and the output stay float32. The dequantization is paid once per weight per call, so this wins over the
// integer kernel of quant_gemm.cpp from a few rows on (its per-block scaling is paid per row); below that
// the integer kernel is kept. Both layouts of quant_blocks.h (a kX16 work item is one group of 16 rows,
// whose columns are gathered 4 bytes at a time: slower to dequantize than the row layout, so on kX16 the
// tiles are used for prefill-sized products only, where their float sums matter for accuracy).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "quant_blocks.h"

namespace pagedserve {
namespace quant {

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

// 32 unsigned quants (element order) and the block's step and offset, as bf16 into dst[0:32].
inline void block_to_bf16(__m256i u, float step, float offset, uint16_t* dst) {
    const __m512 scale = _mm512_set1_ps(step), shift = _mm512_set1_ps(offset);
    const __m512 low = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(u))), scale, shift);
    const __m512 high =
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(u, 1))), scale, shift);
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
}

// The 16 columns of kX16 group g as bf16 into tile [16, K] (a work item is exactly one group).
template <int64_t FORMAT>
void dequantize_x16_tile(const uint8_t* qs, int64_t in_features, int64_t g, uint16_t* tile) {
    const int64_t nb = in_features / kBlock;
    const uint8_t* group = qs + g * nb * x16_block_bytes(FORMAT);
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* record = group + b * x16_block_bytes(FORMAT);
        const uint16_t *dg = x16_scales(record, FORMAT), *mg = x16_mins(record, FORMAT);
        const int32_t* p = reinterpret_cast<const int32_t*>(record);
        for (int64_t c = 0; c < kGroupColumns; ++c) {  // column c's 4-byte pieces sit 16 int32 apart
            __m256i u;
            if constexpr (FORMAT == kQ8_0) {
                u = _mm256_i32gather_epi32(reinterpret_cast<const int*>(p + c),
                                           _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112), 4);
            } else {  // low nibbles: elements 0-15, high nibbles: 16-31
                const __m128i both =
                    _mm_i32gather_epi32(reinterpret_cast<const int*>(p + c), _mm_setr_epi32(0, 16, 32, 48), 4);
                u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(both, 4), low), _mm_and_si128(both, low));
            }
            const float step = half_to_float(dg[c]);
            const float offset = FORMAT == kQ4_1 ? half_to_float(mg[c])
                                                 : step * (FORMAT == kQ4_0 ? -8.0f : -128.0f);
            block_to_bf16(u, step, offset, tile + c * in_features + b * kBlock);
        }
    }
}

// Rows [n0, n1) of W as bf16 into tile [n1 - n0, K].
template <int64_t FORMAT>
void dequantize_tile(const uint8_t* qs, const uint16_t* d, const uint16_t* m, int64_t in_features, int64_t nbp,
                     int64_t n0, int64_t n1, uint16_t* tile) {
    const int64_t nb = in_features / kBlock;
    const int64_t row_bytes = FORMAT == kQ8_0 ? nbp * kBlock : nbp * kBlock / 2;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* row = qs + n * row_bytes;
        const uint16_t *dn = d + n * nbp, *mn = m ? m + n * nbp : nullptr;
        uint16_t* dst = tile + (n - n0) * in_features;
        for (int64_t b = 0; b < nb; b += 2) {
            const __m512i pair = load_pair<FORMAT>(row, b);
            for (int64_t h = 0; h < 2 && b + h < nb; ++h) {
                const __m256i u = h ? _mm512_extracti64x4_epi64(pair, 1) : _mm512_castsi512_si256(pair);
                block_to_bf16(u, half_to_float(dn[b + h]), block_min(FORMAT, dn, mn, b + h), dst + (b + h) * kBlock);
            }
        }
    }
}

// out[r * out_stride + c] = x[r, :] . w[c, :] for NR rows and NC columns (K a multiple of 32).
template <int NR, int NC>
void tile_product(const uint16_t* x, const uint16_t* w, int64_t in_features, float* out, int64_t out_stride) {
    __m512 acc[NR][NC];
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < in_features; k += kBlock) {
        __m512bh wv[NC];
        for (int c = 0; c < NC; ++c) wv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + c * in_features + k));
        for (int r = 0; r < NR; ++r) {
            const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + r * in_features + k));
            for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
        }
    }
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NC; ++c) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int NR>
void row_chunk(const uint16_t* x, const uint16_t* w, int64_t in_features, int64_t columns, float* out) {
    int64_t c = 0;
    for (; c + 4 <= columns; c += 4) tile_product<NR, 4>(x, w + c * in_features, in_features, out + c, kColumnsPerTask);
    switch (columns - c) {
        case 1: tile_product<NR, 1>(x, w + c * in_features, in_features, out + c, kColumnsPerTask); break;
        case 2: tile_product<NR, 2>(x, w + c * in_features, in_features, out + c, kColumnsPerTask); break;
        case 3: tile_product<NR, 3>(x, w + c * in_features, in_features, out + c, kColumnsPerTask); break;
        default: break;
    }
}

template <int64_t FORMAT, typename T>
void product(const uint16_t* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, T* out,
             int64_t rows, int64_t in_features, int64_t columns, int64_t nbp, int64_t layout) {
    const int64_t tasks = (columns + kColumnsPerTask - 1) / kColumnsPerTask;
#pragma omp parallel for schedule(static) if (tasks > 1 && rows * columns * in_features >= kParallelMinWork)
    for (int64_t task = 0; task < tasks; ++task) {
        static thread_local std::vector<uint16_t> tile;
        tile.resize(kColumnsPerTask * in_features);
        const int64_t n0 = task * kColumnsPerTask, n1 = std::min(columns, n0 + kColumnsPerTask);
        if (layout == kX16) dequantize_x16_tile<FORMAT>(qs, in_features, task, tile.data());
        else dequantize_tile<FORMAT>(qs, d, m, in_features, nbp, n0, n1, tile.data());
        float sums[4 * kColumnsPerTask];
        for (int64_t r0 = 0; r0 < rows; r0 += 4) {
            const int64_t nr = std::min<int64_t>(4, rows - r0);
            const uint16_t* xr = x + r0 * in_features;
            switch (nr) {
                case 1: row_chunk<1>(xr, tile.data(), in_features, n1 - n0, sums); break;
                case 2: row_chunk<2>(xr, tile.data(), in_features, n1 - n0, sums); break;
                case 3: row_chunk<3>(xr, tile.data(), in_features, n1 - n0, sums); break;
                default: row_chunk<4>(xr, tile.data(), in_features, n1 - n0, sums); break;
            }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t n = n0; n < n1; ++n)
                    store(out + (r0 + r) * columns + n, sums[r * kColumnsPerTask + n - n0]);
        }
    }
}

template <typename T>
void dispatch(const uint16_t* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, T* out, int64_t rows,
              int64_t in_features, int64_t columns, int64_t nbp, int64_t format, int64_t layout) {
    switch (format) {
        case kQ4_0: product<kQ4_0>(x, qs, d, m, out, rows, in_features, columns, nbp, layout); break;
        case kQ4_1: product<kQ4_1>(x, qs, d, m, out, rows, in_features, columns, nbp, layout); break;
        default: product<kQ8_0>(x, qs, d, m, out, rows, in_features, columns, nbp, layout); break;
    }
}

}  // namespace

bool dense_bf16_product(const uint16_t* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m,
                        uint16_t* out, int64_t rows, int64_t in_features, int64_t columns, int64_t nbp,
                        int64_t format, int64_t layout) {
    dispatch(x, qs, d, m, out, rows, in_features, columns, nbp, format, layout);
    return true;
}

bool dense_bf16_product(const float* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, float* out,
                        int64_t rows, int64_t in_features, int64_t columns, int64_t nbp, int64_t format,
                        int64_t layout) {
    static thread_local std::vector<uint16_t> rounded;  // x [rows, K] rounded to bf16
    rounded.resize(rows * in_features);
    for (int64_t i = 0; i < rows * in_features; ++i) store(rounded.data() + i, x[i]);
    dispatch(rounded.data(), qs, d, m, out, rows, in_features, columns, nbp, format, layout);
    return true;
}

#else

bool dense_bf16_product(const uint16_t*, const uint8_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t) {
    return false;
}

bool dense_bf16_product(const float*, const uint8_t*, const uint16_t*, const uint16_t*, float*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t) {
    return false;
}

#endif

}  // namespace quant
}  // namespace pagedserve

extern "C" int64_t pagedserve_quant_bf16_tiles() {  // 1 where dense_bf16_product runs (AVX512-BF16 builds)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return 1;
#else
    return 0;
#endif
}
