// The small-batch product of gemv.h, exported for float32 and bfloat16 (engine/kernels/cpu.py loads it).

#include "gemv.h"

extern "C" {
void pagedserve_gemv_f32(const float* x, const float* w, const float* bias, float* out, int64_t rows, int64_t N,
                         int64_t K) {
    pagedserve::gemv(x, w, bias, out, rows, N, K);
}
void pagedserve_gemv_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int64_t rows,
                          int64_t N, int64_t K) {
    pagedserve::gemv(x, w, bias, out, rows, N, K);
}
}
