// The LoRA deltas of lora_delta.h on one projection, exported for float32 and bfloat16 (engine/lora/lora_step.py
// calls it on the unfused path through engine/kernels/cpu.py), with a team of its own.

#include <vector>

#include "lora_delta.h"

namespace {

template <typename T>
void lora_add(const T* x, T* out, const T* a, const T* b, const int32_t* slots, const float* scales,
              const int32_t* ranks, const int64_t* widths, int64_t rows, int64_t K, int64_t N, int64_t parts,
              int64_t max_rank, int64_t max_loras, int64_t width, int64_t grouped) {
    using namespace pagedserve::lora;
    Projection<T> proj{a, b, K, N, parts, {0, 0, 0}};
    for (int64_t p = 0; p < parts; ++p) proj.widths[p] = widths[p];
    const Plan plan(slots, scales, ranks, rows, width, max_rank, max_loras, grouped != 0);
    if (plan.empty()) return;
    std::vector<float> shrunk(rows * width * parts * max_rank);
    // a team only when the work pays for waking it (a few rows of a rank-8 adapter do not)
    const int64_t macs = static_cast<int64_t>(plan.order.size()) * max_rank * (K + N);
#pragma omp parallel if (macs >= (1 << 16))
    add_for(x, out, proj, plan, shrunk.data());
}

}  // namespace

#define PAGEDSERVE_LORA_ADD(SUFFIX, T)                                                                         \
    void pagedserve_lora_add_##SUFFIX(const T* x, T* out, const T* a, const T* b, const int32_t* slots,       \
                                      const float* scales, const int32_t* ranks, const int64_t* widths,        \
                                      int64_t rows, int64_t K, int64_t N, int64_t parts, int64_t max_rank,     \
                                      int64_t max_loras, int64_t width, int64_t grouped) {                     \
        lora_add(x, out, a, b, slots, scales, ranks, widths, rows, K, N, parts, max_rank, max_loras, width,   \
                 grouped);                                                                                     \
    }

extern "C" {
PAGEDSERVE_LORA_ADD(f32, float)
PAGEDSERVE_LORA_ADD(bf16, uint16_t)
}
