// y = x W^T + b for a few rows of x (decode batches): W [out, in] row-major, read once per call.
//
// torch's products (oneDNN / MKL) at one to a few rows run far below memory bandwidth on CPUs,
// and in bfloat16 they are slower still; a decode step of a small model is mostly these
// products. Here each thread takes a contiguous range of output features and streams their
// weight rows once: every row is dotted with every input row (the inputs, converted to float
// once, stay in L1/L2), four weight rows at a time for independent accumulators. Float32
// accumulation; bfloat16 weights are widened in registers (a shift), never copied.
#include <cstdint>
#include <vector>

#include "common.h"

namespace pagedserve {
namespace {

constexpr int64_t kParallelMinWeights = 1 << 15;

template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < n; ++k) sum += to_float(w[k]) * x[k];
    return sum;
}

template <typename T>
inline void dot4(const T* w, int64_t stride, const float* x, int64_t n, float* sums) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    const T* w0 = w;
    const T* w1 = w + stride;
    const T* w2 = w + 2 * stride;
    const T* w3 = w + 3 * stride;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < n; ++k) {
        const float xk = x[k];
        s0 += to_float(w0[k]) * xk;
        s1 += to_float(w1[k]) * xk;
        s2 += to_float(w2[k]) * xk;
        s3 += to_float(w3[k]) * xk;
    }
    sums[0] = s0;
    sums[1] = s1;
    sums[2] = s2;
    sums[3] = s3;
}

template <typename T>
void small_linear(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t out_features,
                  int64_t in_features) {
    std::vector<float> xf(static_cast<size_t>(rows * in_features));
    for (int64_t i = 0; i < rows * in_features; ++i) xf[i] = to_float(x[i]);
    const int64_t groups = (out_features + 3) / 4;
#pragma omp parallel for schedule(static) if (out_features * in_features >= kParallelMinWeights)
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t o = g * 4;
        for (int64_t r = 0; r < rows; ++r) {
            const float* xr = xf.data() + r * in_features;
            T* yr = out + r * out_features;
            if (o + 4 <= out_features) {
                float sums[4];
                dot4(w + o * in_features, in_features, xr, in_features, sums);
                for (int j = 0; j < 4; ++j) store(yr + o + j, sums[j] + (bias ? to_float(bias[o + j]) : 0.0f));
            } else {
                for (int64_t j = o; j < out_features; ++j)
                    store(yr + j, dot(w + j * in_features, xr, in_features) + (bias ? to_float(bias[j]) : 0.0f));
            }
        }
    }
}

}  // namespace
}  // namespace pagedserve

extern "C" {

void pagedserve_small_linear_f32(const float* x, const float* w, const float* bias, float* out, int64_t rows,
                                 int64_t out_features, int64_t in_features) {
    pagedserve::small_linear(x, w, bias, out, rows, out_features, in_features);
}

void pagedserve_small_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                                  int64_t rows, int64_t out_features, int64_t in_features) {
    pagedserve::small_linear(x, w, bias, out, rows, out_features, in_features);
}

}  // extern "C"
