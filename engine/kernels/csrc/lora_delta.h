// A step's LoRA deltas on one (fused) projection, added into the projection's output. csrc/lora_add.cpp
// exports it for the unfused path (engine/lora/lora_step.py); csrc/decode_layer.cpp runs it inside its
// fused kernels: both paths give the same bits.
//
//   out[t, part p's columns] += sum over token t's (slot, scale) pairs of
//                               scale * (x[t] @ A[slot, part p]^T) @ B[slot, part p]
//
// Stacks as engine/lora/lora_stack.py keeps them (R = max_rank, parts = 1..3 fused HF projections):
//   a [max_loras, parts * R, K]   rows [p R, p R + rank) part p's lora_A; rows past the slot's rank zero
//   b [max_loras, parts * R, N]   lora_B^T, block-diagonal: rows of part p reach part p's columns only
// Only each token's own slots are read (not the whole slot range, which a dense product would multiply by
// zeros: 8x the shrink's work for 8 adapters), B only on its diagonal blocks (1/parts of its rows x columns),
// and only the first `ranks[slot]` rows of each part.
//
//   shrink  t[e, p R + j] = scale_e * (x[token_e] . a[slot_e, p R + j])    e: a (token, pair) entry, j < rank
//           entries grouped by slot, so each A row is read once per step and dotted with all its tokens
//   expand  out[t, c] = round(out[t, c] + sum over t's entries e, j < rank: t[e, p R + j] * b[slot_e, p R + j, c])
//
// Rounding: t and the sums stay float32; the output is rounded once, after the delta is added (a base
// token's row is not written). Two work-shared loops (orphaned `omp for`s): call from every thread of a team.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"
#include "gemv.h"

namespace pagedserve {
namespace lora {

constexpr int64_t kMaxParts = 3;
constexpr int64_t kExpandColumns = 512;  // output columns per expand work item: B read in 1 KiB runs
// (64 columns, 128-byte runs at a stride of N, read the step's cold B at a third of the speed)

// One projection's stacked adapters (see the file comment).
template <typename T>
struct Projection {
    const T* a;
    const T* b;
    int64_t K, N, parts;
    int64_t widths[kMaxParts];  // each part's output columns, in order along N
};

// The step's adapters: which slots each token reads, grouped by slot for the shrink.
struct Plan {
    const int32_t* slots;   // [rows, width]: each token's slots (-1: none)
    const float* scales;    // [rows, width]: their scales
    const int32_t* ranks;   // [max_loras]: each slot's rank (<= max_rank)
    int64_t rows, width, max_rank;
    std::vector<int32_t> order;   // entries e = token * width + pair, grouped by slot
    std::vector<int32_t> starts;  // group g's entries: order[starts[g], starts[g + 1])
    std::vector<int32_t> tokens;  // the tokens with adapters, by their first slot (the expand reuses B hot)

    Plan(const int32_t* slots_, const float* scales_, const int32_t* ranks_, int64_t rows_, int64_t width_,
         int64_t max_rank_, int64_t max_loras, bool grouped = true)
        : slots(slots_), scales(scales_), ranks(ranks_), rows(rows_), width(width_), max_rank(max_rank_) {
        std::vector<std::vector<int32_t>> by_slot(max_loras);
        for (int64_t e = 0; e < rows * width; ++e)
            if (slots[e] >= 0 && ranks[slots[e]] > 0) by_slot[slots[e]].push_back(static_cast<int32_t>(e));
        starts.push_back(0);
        for (const auto& entries : by_slot)
            for (size_t i = 0; i < entries.size(); ++i) {
                order.push_back(entries[i]);
                // ungrouped (benchmarks/lora.py --micro): every entry reads its own A rows
                if (!grouped || i + 1 == entries.size()) starts.push_back(static_cast<int32_t>(order.size()));
            }
        std::vector<bool> seen(rows, false);
        for (const int32_t e : order)
            if (!seen[e / width]) {
                seen[e / width] = true;
                tokens.push_back(static_cast<int32_t>(e / width));
            }
    }
    int64_t groups() const { return static_cast<int64_t>(starts.size()) - 1; }
    bool empty() const { return order.empty(); }
};

namespace detail {

// sums[g * R + r] = w[g] . xs[r] over K, for G rows of w (contiguous, [G, K]) and R rows of x (anywhere).
template <typename T, int G, int R>
void dot_rows(const T* w, const T* const* xs, int64_t K, float* sums) {
#if defined(PAGEDSERVE_GEMV_VECTOR)
    using P = typename gemv_detail::Policy<T>::type;
    const int64_t main = K - K % P::kStep;
    for (int g = 0; g < G; ++g) {
        const T* wg = w + g * K;
        typename P::Acc acc[R];
        for (int r = 0; r < R; ++r) acc[r] = P::zero();
        for (int64_t k = 0; k < main; k += P::kStep) {
            const auto wv = P::load_w(wg + k);
            for (int r = 0; r < R; ++r) acc[r] = P::madd(acc[r], wv, xs[r] + k);
        }
        for (int r = 0; r < R; ++r) {
            float s = P::sum(acc[r]);
            for (int64_t k = main; k < K; ++k) s += to_float(wg[k]) * to_float(xs[r][k]);
            sums[g * R + r] = s;
        }
    }
#else
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += to_float(w[g * K + k]) * to_float(xs[r][k]);
            sums[g * R + r] = s;
        }
#endif
}

#if defined(PAGEDSERVE_GEMV_VECTOR)
template <typename T>
constexpr int kMaxTokens = gemv_detail::Policy<T>::type::kMaxR;
#else
template <typename T>
constexpr int kMaxTokens = 4;
#endif

// G A rows (from `a_rows`, part-local row j0) against every entry of one group, R entries at a time.
template <typename T, int G>
void shrink_rows(const T* x, const T* a_rows, int64_t K, const Plan& plan, const int32_t* entries, int64_t count,
                 int64_t column, int64_t stride, float* shrunk) {
    constexpr int R = kMaxTokens<T>;
    float sums[G * R];
    const T* xs[R];
    for (int64_t e0 = 0; e0 < count; e0 += R) {
        const int n = static_cast<int>(count - e0 < R ? count - e0 : R);
        for (int r = 0; r < n; ++r) xs[r] = x + (entries[e0 + r] / plan.width) * K;
        switch (n) {
            case 1: dot_rows<T, G, 1>(a_rows, xs, K, sums); break;
            case 2: dot_rows<T, G, 2>(a_rows, xs, K, sums); break;
            case 3: if constexpr (R >= 3) dot_rows<T, G, 3>(a_rows, xs, K, sums); break;
            default: if constexpr (R >= 4) dot_rows<T, G, 4>(a_rows, xs, K, sums); break;
        }
        for (int r = 0; r < n; ++r) {
            const int32_t e = entries[e0 + r];
            for (int g = 0; g < G; ++g) shrunk[e * stride + column + g] = plan.scales[e] * sums[g * n + r];
        }
    }
}

}  // namespace detail

// The shrink: t for every entry (see the file comment); `shrunk` holds rows * width * parts * max_rank floats.
// Work-shared over the calling team; with `nowait` its threads go on without waiting for the others (the
// fused step runs the projection's base product next, whose barrier then orders the expand after it).
template <typename T>
void shrink_for(const T* x, const Projection<T>& proj, const Plan& plan, float* shrunk, bool nowait) {
    const int64_t R = plan.max_rank, parts = proj.parts, stride = parts * R, K = proj.K;
    constexpr int64_t kRows = 4;  // A rows per shrink item
    const int64_t blocks = (R + kRows - 1) / kRows, groups = plan.groups();
    auto item = [&](int64_t g, int64_t p, int64_t block) {
        const int32_t* entries = plan.order.data() + plan.starts[g];
        const int64_t count = plan.starts[g + 1] - plan.starts[g];
        const int32_t slot = plan.slots[entries[0]];
        const int64_t j0 = block * kRows, rank = plan.ranks[slot];
        if (j0 >= rank) return;
        const T* a_rows = proj.a + (slot * stride + p * R + j0) * K;
        if (j0 + kRows <= R)  // rows past the rank are zeros: a whole block of 4 costs the same
            detail::shrink_rows<T, kRows>(x, a_rows, K, plan, entries, count, p * R + j0, stride, shrunk);
        else
            for (int64_t j = j0; j < rank; ++j)
                detail::shrink_rows<T, 1>(x, a_rows + (j - j0) * K, K, plan, entries, count, p * R + j, stride,
                                          shrunk);
    };
    if (nowait) {
#pragma omp for collapse(3) schedule(dynamic, 1) nowait
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t p = 0; p < parts; ++p)
                for (int64_t block = 0; block < blocks; ++block) item(g, p, block);
    } else {
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t p = 0; p < parts; ++p)
                for (int64_t block = 0; block < blocks; ++block) item(g, p, block);
    }
}

// The expand: out [rows, N] += each token's deltas from `shrunk` (after shrink_for, a barrier between).
// Work-shared over the calling team.
template <typename T>
void expand_for(T* out, const Projection<T>& proj, const Plan& plan, const float* shrunk) {
    const int64_t R = plan.max_rank, parts = proj.parts, stride = parts * R, N = proj.N;
    int64_t chunks_before[kMaxParts + 1] = {0};  // expand items: each part's columns in chunks
    for (int64_t p = 0; p < parts; ++p)
        chunks_before[p + 1] = chunks_before[p] + (proj.widths[p] + kExpandColumns - 1) / kExpandColumns;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < chunks_before[parts]; ++item) {
        int64_t p = 0, column0 = 0;
        while (item >= chunks_before[p + 1]) column0 += proj.widths[p++];
        const int64_t c0 = column0 + (item - chunks_before[p]) * kExpandColumns;
        const int64_t cols = std::min(kExpandColumns, column0 + proj.widths[p] - c0);
        for (const int64_t t : plan.tokens) {
            float acc[kExpandColumns] = {0.0f};
            bool any = false;
            for (int64_t m = 0; m < plan.width; ++m) {
                const int64_t e = t * plan.width + m;
                const int32_t slot = plan.slots[e];
                if (slot < 0) continue;
                const int64_t rank = plan.ranks[slot];
                any = any || rank > 0;
                const float* tv = shrunk + e * stride + p * R;
                const T* b_rows = proj.b + (slot * stride + p * R) * N + c0;
                for (int64_t j = 0; j < rank; ++j) {
                    const float s = tv[j];
                    const T* bj = b_rows + j * N;
#pragma omp simd
                    for (int64_t c = 0; c < cols; ++c) acc[c] += s * to_float(bj[c]);
                }
            }
            if (!any) continue;
            T* o = out + t * N + c0;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) store(o + c, to_float(o[c]) + acc[c]);
        }
    }
}

// out [rows, N] += the deltas of x [rows, K]: shrink, then expand. Work-shared over the calling team.
template <typename T>
void add_for(const T* x, T* out, const Projection<T>& proj, const Plan& plan, float* shrunk) {
    shrink_for(x, proj, plan, shrunk, false);
    expand_for(out, proj, plan, shrunk);
}

}  // namespace lora
}  // namespace pagedserve
