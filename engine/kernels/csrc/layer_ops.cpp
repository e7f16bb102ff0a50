// Fused per-token operations of a decoder layer for CPUs, each one pass over memory:
//   rms_norm        out = x / sqrt(mean(x^2) + eps) * weight
//   add_rms_norm    residual += x; out = rms_norm(residual)           (residual updated in place)
//   silu_and_mul    out = silu(gate) * up, with gate_up = [gate | up] per row
//   rotary          q and k heads rotated in place (HF's half-split layout), per-token positions
// Rows may be strided (row_stride in elements); within a row elements are contiguous.

#include <cstdint>
#include <vector>

#include "common.h"

namespace {

using pagedserve::fast_exp;
using pagedserve::store;
using pagedserve::to_float;

constexpr int64_t kParallelMinElements = 1 << 15;  // below this, one thread beats waking the pool

template <typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) {
        const float v = to_float(x[i]);
        sum += v * v;
    }
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) store(out + i, to_float(weight[i]) * (to_float(x[i]) * inv));
}

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * hidden, weight, out + r * hidden, hidden, eps);
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) {
        T* res = residual + r * hidden;
        const T* delta = x + r * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) store(res + i, to_float(res[i]) + to_float(delta[i]));
        rms_norm_row(res, weight, out + r * hidden, hidden, eps);
    }
}

template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * 2 * width;
        const T* up = gate + width;
        T* dst = out + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
            const float g = to_float(gate[i]);
            store(dst + i, g / (1.0f + fast_exp(-g)) * to_float(up[i]));
        }
    }
}

// x' = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; cos/sin tables [positions, head_dim]
// hold each frequency twice (HF's layout), sin_signed has the first half negated.
template <typename T>
void rotary(T* x, const int64_t* positions, const T* cos, const T* sin_signed, int64_t rows, int64_t row_stride,
            int64_t num_heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (rows * num_heads * head_dim >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) {
        const T* c = cos + positions[r] * head_dim;
        const T* s = sin_signed + positions[r] * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            T* v = x + r * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = to_float(v[i]);
                const float x2 = to_float(v[i + half]);
                store(v + i, x1 * to_float(c[i]) + x2 * to_float(s[i]));
                store(v + i + half, x2 * to_float(c[i + half]) + x1 * to_float(s[i + half]));
            }
        }
    }
}

}  // namespace

#define PAGEDSERVE_LAYER_OPS(SUFFIX, T)                                                                          \
    void pagedserve_rms_norm_##SUFFIX(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden,         \
                                      float eps) {                                                               \
        rms_norm(x, weight, out, rows, hidden, eps);                                                             \
    }                                                                                                            \
    void pagedserve_add_rms_norm_##SUFFIX(const T* x, T* residual, const T* weight, T* out, int64_t rows,        \
                                          int64_t hidden, float eps) {                                           \
        add_rms_norm(x, residual, weight, out, rows, hidden, eps);                                               \
    }                                                                                                            \
    void pagedserve_silu_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t width) {               \
        silu_and_mul(gate_up, out, rows, width);                                                                 \
    }                                                                                                            \
    void pagedserve_rotary_##SUFFIX(T* x, const int64_t* positions, const T* cos, const T* sin_signed,           \
                                    int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim) {     \
        rotary(x, positions, cos, sin_signed, rows, row_stride, num_heads, head_dim);                            \
    }

extern "C" {
PAGEDSERVE_LAYER_OPS(f32, float)
PAGEDSERVE_LAYER_OPS(bf16, uint16_t)
}
