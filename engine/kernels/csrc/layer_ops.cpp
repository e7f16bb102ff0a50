// Fused per-token operations of a decoder layer for CPUs, each one pass over memory:
//   rms_norm        out = x / sqrt(mean(x^2) + eps) * weight
//   add_rms_norm    residual += x; out = rms_norm(residual)           (residual updated in place)
//   silu_and_mul    out = silu(gate) * up, with gate_up = [gate | up] per row
//   gelu_tanh_and_mul  out = gelu_tanh(gate) * up (GeGLU)
//   rotary          q and k heads rotated in place (HF's half-split layout, over each head's first rotary_dim
//                   dimensions), per-token positions
// Rows may be strided (row_stride in elements); within a row elements are contiguous.

#include <cstdint>
#include <vector>

#include "row_ops.h"

namespace {

using pagedserve::add_rms_norm_row;
using pagedserve::rms_norm_row;
using pagedserve::rotary_row;
using pagedserve::gelu_tanh_and_mul_row;
using pagedserve::silu_and_mul_row;

constexpr int64_t kParallelMinElements = 1 << 15;  // below this, one thread beats waking the pool

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) rms_norm_row(x + r * hidden, weight, out + r * hidden, hidden, eps);
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows * hidden >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r)
        add_rms_norm_row(x + r * hidden, residual + r * hidden, weight, out + r * hidden, hidden, eps);
}

template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) silu_and_mul_row(gate_up + r * 2 * width, out + r * width, width);
}

template <typename T>
void gelu_tanh_and_mul(const T* gate_up, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r) gelu_tanh_and_mul_row(gate_up + r * 2 * width, out + r * width, width);
}

// x [rows (strided), heads, head_dim]; cos/sin tables [positions, rotary_dim] (see rotary_row)
template <typename T>
void rotary(T* x, const int64_t* positions, const T* cos, const T* sin_signed, int64_t rows, int64_t row_stride,
            int64_t num_heads, int64_t head_dim, int64_t rotary_dim) {
#pragma omp parallel for if (rows * num_heads * rotary_dim >= kParallelMinElements)
    for (int64_t r = 0; r < rows; ++r)
        rotary_row(x + r * row_stride, cos + positions[r] * rotary_dim, sin_signed + positions[r] * rotary_dim,
                   num_heads, head_dim, rotary_dim);
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
    void pagedserve_gelu_tanh_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t width) {          \
        gelu_tanh_and_mul(gate_up, out, rows, width);                                                            \
    }                                                                                                            \
    void pagedserve_rotary_##SUFFIX(T* x, const int64_t* positions, const T* cos, const T* sin_signed,           \
                                    int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim,       \
                                    int64_t rotary_dim) {                                                        \
        rotary(x, positions, cos, sin_signed, rows, row_stride, num_heads, head_dim, rotary_dim);                \
    }

extern "C" {
PAGEDSERVE_LAYER_OPS(f32, float)
PAGEDSERVE_LAYER_OPS(bf16, uint16_t)
}
