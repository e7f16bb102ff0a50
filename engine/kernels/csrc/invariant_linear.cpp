// The column-block product of column_blocks.h, exported for float32 and bfloat16 (engine/kernels/cpu.py
// loads it): the engine's bf16 product on AVX512-BF16 builds, its float32 product on AVX2 and AVX-512
// builds, and batch-invariant mode's product everywhere.

#include "column_blocks.h"

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

template <typename T>
void column_block_product(const T* x, const T* packed, const T* bias, T* out, int64_t M, int64_t N, int64_t K,
                          bool amx) {
    pagedserve::TeamSplit split;
    split.reset();
#pragma omp parallel if (M * N * K >= pagedserve::column_blocks::kParallelMinMacs)
    pagedserve::column_blocks::product_for(x, packed, bias, out, M, N, K, split, amx);
}

}  // namespace

#define PAGEDSERVE_INVARIANT_LINEAR(SUFFIX, T)                                                                 \
    void pagedserve_invariant_linear_##SUFFIX(const T* x, const T* packed, const T* bias, T* out, int64_t M,    \
                                              int64_t N, int64_t K, int64_t amx) {                              \
        column_block_product(x, packed, bias, out, M, N, K, amx != 0);                                          \
    }

extern "C" {
PAGEDSERVE_INVARIANT_LINEAR(f32, float)
PAGEDSERVE_INVARIANT_LINEAR(bf16, uint16_t)

// 1 where the bf16 product may run on AMX tiles: built with them, and Linux granted the process their state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; torch and oneDNN ask the same, the grant is per process).
int64_t pagedserve_amx_tiles() {
#if defined(PAGEDSERVE_COLUMN_BLOCKS_AMX) && defined(__linux__)
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
    pagedserve::column_blocks::amx_permitted().store(granted);
    return granted ? 1 : 0;
#else
    return 0;
#endif
}

int64_t pagedserve_column_blocks_f32_native() {  // 1 where the float32 product has vector tiles (AVX2 or AVX-512)
#if defined(PAGEDSERVE_COLUMN_BLOCKS_F32_TILES)
    return 1;
#else
    return 0;
#endif
}

int64_t pagedserve_column_blocks_bf16_native() {  // 1 where the bf16 product runs on vdpbf16ps (AVX512-BF16)
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
}
