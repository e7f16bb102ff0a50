// Products with GGUF block-quantized weights (Q4_0, Q4_1, Q8_0) kept quantized: out = x @ W.T, and the
// float matrix the blocks stand for. The layouts and the integer products: quant_product.h.
// From `tile_min_rows` rows, quant_dense_bf16.cpp's bf16 tile product is used instead (AVX512-BF16 builds).
// Built and loaded by engine/kernels/cpu.py and engine/kernels/quant.py.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"
#include "quant_blocks.h"
#include "quant_product.h"

namespace {

using namespace pagedserve::quant;

using pagedserve::store;

template <typename TX, typename TO>
void quant_linear(const TX* x, const uint8_t* qs, const uint16_t* d, const uint16_t* m, TO* out, int64_t rows,
                  int64_t in_features, int64_t columns, int64_t nbp, int64_t format, int64_t layout,
                  int64_t tile_min_rows) {
    if constexpr (std::is_same_v<TX, TO>) {  // (float32 out of bf16 x: the integer product only)
        if (rows >= tile_min_rows &&
            dense_bf16_product(x, qs, d, m, out, rows, in_features, columns, nbp, format, layout))
            return;  // the bf16 tile product (quant_dense_bf16.cpp)
    }
    static thread_local Scratch calling_thread_scratch;  // reused across calls by the calling thread
    Scratch& scratch = calling_thread_scratch;  // (by name in the team, each thread would see its own)
    scratch.reserve(rows, nbp);
    scratch.split.reset();
    const BlockMatrix w{qs, d, m, format, nbp, layout};
    const bool parallel = rows * columns * nbp * kBlock >= kParallelMinWork && columns > kColumnsPerTask;
#pragma omp parallel if (parallel)
    integer_product_for(x, w, out, rows, in_features, columns, scratch);
}

// Rows [N, K] of the float matrix the blocks stand for (design (a)'s dense product, tests, fallbacks).
template <typename T>
void dequantize_row(const uint8_t* qs, const uint16_t* d, const uint16_t* m, T* out, int64_t nb, int64_t format) {
    for (int64_t b = 0; b < nb; b += 2) {  // a pair of blocks (the second may be padding: not written)
        const float d0 = half_to_float(d[b]), m0 = block_min(format, d, m, b);
        const float d1 = half_to_float(d[b + 1]), m1 = block_min(format, d, m, b + 1);
        T* dst = out + b * kBlock;
        const bool second = b + 1 < nb;
        if (format == kQ8_0) {
            const uint8_t* src = qs + b * kBlock;
#pragma omp simd
            for (int64_t j = 0; j < kBlock; ++j) store(dst + j, d0 * static_cast<float>(src[j]) + m0);
            if (second) {
#pragma omp simd
                for (int64_t j = 0; j < kBlock; ++j)
                    store(dst + kBlock + j, d1 * static_cast<float>(src[kBlock + j]) + m1);
            }
        } else {
            const uint8_t* src = qs + (b / 2) * kBlock;
#pragma omp simd
            for (int64_t j = 0; j < kBlock; ++j) store(dst + j, d0 * static_cast<float>(src[j] & 0x0f) + m0);
            if (second) {
#pragma omp simd
                for (int64_t j = 0; j < kBlock; ++j) store(dst + kBlock + j, d1 * static_cast<float>(src[j] >> 4) + m1);
            }
        }
    }
}

// Column c (weight row 16 g + c) of the kX16 block record at p into dst [32].
template <typename T>
inline void x16_block_column(const uint8_t* p, int64_t c, int64_t format, T* dst) {
    const float step = half_to_float(x16_scales(p, format)[c]);
    const float offset = format == kQ4_1 ? half_to_float(x16_mins(p, format)[c])
                                         : step * (format == kQ4_0 ? -8.0f : -128.0f);
    if (format == kQ8_0) {
        for (int64_t q = 0; q < 8; ++q)
            for (int64_t j = 0; j < 4; ++j) store(dst + 4 * q + j, step * p[64 * q + 4 * c + j] + offset);
        return;
    }
    for (int64_t q = 0; q < 4; ++q)
        for (int64_t j = 0; j < 4; ++j) {
            const uint8_t byte = p[64 * q + 4 * c + j];
            store(dst + 4 * q + j, step * static_cast<float>(byte & 0x0f) + offset);
            store(dst + 16 + 4 * q + j, step * static_cast<float>(byte >> 4) + offset);
        }
}

// The 16 rows of kX16 group g into out (rows 16 g .. 16 g + 15 of [N, K]), block by block (the group's
// bytes read once, in order).
template <typename T>
void dequantize_x16_group(const uint8_t* qs, T* out, int64_t g, int64_t nb, int64_t format) {
    const int64_t bytes = x16_block_bytes(format), in_features = nb * kBlock;
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t c = 0; c < kGroupColumns; ++c)
            x16_block_column(qs + (g * nb + b) * bytes, c, format,
                             out + (g * kGroupColumns + c) * in_features + b * kBlock);
}

// Weight row n of either layout into out [in_features].
template <typename T>
void dequantize_one(const uint8_t* qs, const uint16_t* d, const uint16_t* m, T* out, int64_t n, int64_t in_features,
                    int64_t nbp, int64_t format, int64_t layout) {
    if (layout == kX16) {
        const int64_t g = n / kGroupColumns, nb = in_features / kBlock, bytes = x16_block_bytes(format);
        for (int64_t b = 0; b < nb; ++b)
            x16_block_column(qs + (g * nb + b) * bytes, n % kGroupColumns, format, out + b * kBlock);
        return;
    }
    const int64_t row_bytes = format == kQ8_0 ? nbp * kBlock : nbp * kBlock / 2;
    dequantize_row(qs + n * row_bytes, d + n * nbp, m ? m + n * nbp : nullptr, out, in_features / kBlock, format);
}

template <typename T>
void dequantize(const uint8_t* qs, const uint16_t* d, const uint16_t* m, T* out, int64_t columns,
                int64_t in_features, int64_t nbp, int64_t format, int64_t layout) {
    if (layout == kX16) {
#pragma omp parallel for if (columns * in_features >= kParallelMinWork)
        for (int64_t g = 0; g < columns / kGroupColumns; ++g)
            dequantize_x16_group(qs, out, g, in_features / kBlock, format);
        return;
    }
#pragma omp parallel for if (columns * in_features >= kParallelMinWork)
    for (int64_t n = 0; n < columns; ++n)
        dequantize_one(qs, d, m, out + n * in_features, n, in_features, nbp, format, layout);
}

// Weight rows index[0 .. count) into out [count, in_features] (an embedding lookup: a few rows, one thread).
// Returns how many indices fall outside [0, columns) (their rows are zeros).
template <typename T>
int64_t dequantize_rows(const uint8_t* qs, const uint16_t* d, const uint16_t* m, const int64_t* index, int64_t count,
                        T* out, int64_t columns, int64_t in_features, int64_t nbp, int64_t format, int64_t layout) {
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
        T* dst = out + i * in_features;
        if (index[i] < 0 || index[i] >= columns) {
            std::fill(dst, dst + in_features, T{});
            ++bad;
            continue;
        }
        dequantize_one(qs, d, m, dst, index[i], in_features, nbp, format, layout);
    }
    return bad;
}

}  // namespace

#define PAGEDSERVE_QUANT(SUFFIX, T)                                                                          \
    void pagedserve_quant_linear_##SUFFIX(const void* x, const void* qs, const void* d, const void* m,       \
                                          void* out, int64_t rows, int64_t in_features, int64_t columns,     \
                                          int64_t nbp, int64_t format, int64_t layout,                       \
                                          int64_t tile_min_rows) {                                           \
        quant_linear(static_cast<const T*>(x), static_cast<const uint8_t*>(qs),                              \
                     static_cast<const uint16_t*>(d), static_cast<const uint16_t*>(m), static_cast<T*>(out), \
                     rows, in_features, columns, nbp, format, layout, tile_min_rows);                        \
    }                                                                                                        \
    void pagedserve_quant_dequantize_##SUFFIX(const void* qs, const void* d, const void* m, void* out,       \
                                              int64_t columns, int64_t in_features, int64_t nbp,             \
                                              int64_t format, int64_t layout) {                              \
        dequantize(static_cast<const uint8_t*>(qs), static_cast<const uint16_t*>(d),                         \
                   static_cast<const uint16_t*>(m), static_cast<T*>(out), columns, in_features, nbp, format, \
                   layout);                                                                                  \
    }                                                                                                        \
    int64_t pagedserve_quant_dequantize_rows_##SUFFIX(const void* qs, const void* d, const void* m,          \
                                                      const int64_t* index, int64_t count, void* out,        \
                                                      int64_t columns, int64_t in_features, int64_t nbp,     \
                                                      int64_t format, int64_t layout) {                      \
        return dequantize_rows(static_cast<const uint8_t*>(qs), static_cast<const uint16_t*>(d),             \
                               static_cast<const uint16_t*>(m), index, count, static_cast<T*>(out), columns, \
                               in_features, nbp, format, layout);                                            \
    }

extern "C" {
PAGEDSERVE_QUANT(f32, float)
PAGEDSERVE_QUANT(bf16, uint16_t)

// bf16 activations, float32 out, by the integer product (tile_min_rows is not read): logits written unrounded,
// without a separate widening pass over them.
void pagedserve_quant_linear_bf16_f32(const void* x, const void* qs, const void* d, const void* m, void* out,
                                      int64_t rows, int64_t in_features, int64_t columns, int64_t nbp,
                                      int64_t format, int64_t layout, int64_t) {
    quant_linear(static_cast<const uint16_t*>(x), static_cast<const uint8_t*>(qs), static_cast<const uint16_t*>(d),
                 static_cast<const uint16_t*>(m), static_cast<float*>(out), rows, in_features, columns, nbp, format,
                 layout, INT64_MAX);
}
}
