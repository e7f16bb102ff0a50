// One row of each per-token operation of a decoder layer (layer_ops.cpp runs them over rows in parallel,
// decode_layer.cpp inside its fused kernels). Elements of a row are contiguous.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace pagedserve {

// out = x / sqrt(mean(x^2) + eps) * weight
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

// residual += x (rounded to T); out = rms_norm(residual)
template <typename T>
void add_rms_norm_row(const T* x, T* residual, const T* weight, T* out, int64_t hidden, float eps) {
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) store(residual + i, to_float(residual[i]) + to_float(x[i]));
    rms_norm_row(residual, weight, out, hidden, eps);
}

// out = silu(gate) * up, gate_up = [gate | up]
template <typename T>
void silu_and_mul_row(const T* gate_up, T* out, int64_t width) {
    const T* up = gate_up + width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate_up[i]);
        store(out + i, g / (1.0f + fast_exp(-g)) * to_float(up[i]));
    }
}

// out = gelu_tanh(gate) * up, gate_up = [gate | up] (GeGLU, Gemma): gelu_tanh(g) = g / 2 * (1 + tanh(y)) with
// y = sqrt(2 / pi) * (g + 0.044715 g^3), computed as g * sigmoid(2 y), the same value without tanh's cancellation
template <typename T>
void gelu_tanh_and_mul_row(const T* gate_up, T* out, int64_t width) {
    const T* up = gate_up + width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
        const float g = to_float(gate_up[i]);
        const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        store(out + i, g / (1.0f + fast_exp(-2.0f * y)) * to_float(up[i]));
    }
}

// num_heads heads of head_dim, their first rotary_dim dimensions rotated in place (the rest pass): x' = x * cos +
// rotate_half(x) * sin, rotate_half(x) = [-x2, x1] over those dimensions; c, s: the position's rows of the cos /
// sin tables (rotary_dim wide: each frequency twice, HF's layout; s with its first half negated).
template <typename T>
void rotary_row(T* x, const T* c, const T* s, int64_t num_heads, int64_t head_dim, int64_t rotary_dim) {
    const int64_t half = rotary_dim / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        T* v = x + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float(v[i]);
            const float x2 = to_float(v[i + half]);
            store(v + i, x1 * to_float(c[i]) + x2 * to_float(s[i]));
            store(v + i + half, x2 * to_float(c[i + half]) + x1 * to_float(s[i + half]));
        }
    }
}

}  // namespace pagedserve
