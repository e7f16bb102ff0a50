// The column-block product of column_blocks.h, exported for float32 and bfloat16 (engine/kernels/cpu.py
// loads it): the engine's bf16 product on AVX512-BF16 builds, and batch-invariant mode's product everywhere.

#include "column_blocks.h"

namespace {

template <typename T>
void column_block_product(const T* x, const T* packed, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel if (M * N * K >= pagedserve::column_blocks::kParallelMinMacs)
    pagedserve::column_blocks::product_for(x, packed, bias, out, M, N, K);
}

}  // namespace

#define PAGEDSERVE_INVARIANT_LINEAR(SUFFIX, T)                                                                 \
    void pagedserve_invariant_linear_##SUFFIX(const T* x, const T* packed, const T* bias, T* out, int64_t M,    \
                                              int64_t N, int64_t K) {                                           \
        column_block_product(x, packed, bias, out, M, N, K);                                                    \
    }

extern "C" {
PAGEDSERVE_INVARIANT_LINEAR(f32, float)
PAGEDSERVE_INVARIANT_LINEAR(bf16, uint16_t)

int64_t pagedserve_column_blocks_bf16_native() {  // 1 where the bf16 product runs on vdpbf16ps (AVX512-BF16)
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
}
