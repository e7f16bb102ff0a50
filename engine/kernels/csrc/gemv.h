// Small-batch matrix product for CPUs (csrc/gemv.cpp exports it; csrc/decode_layer.cpp runs it inside
// its fused kernels), bound by reading the weight once:
//   out[r, o] = sum_k x[r, k] w[o, k] (+ bias[o])      r < rows (1..8 is the target, 1..16 in float32's small
//                                                      engines), o < out_features
// on the weight as the model stores it (row-major [out, in], no repacking: larger batches multiply the
// same tensor with torch/oneDNN). A micro-kernel takes kGroup = 4 weight rows and up to kMaxR batch rows,
// walks the weight rows one after the other in memory order (one sequential stream, which the hardware
// prefetcher follows: walking the 4 rows side by side, or prefetching ahead in software, measured
// 9-10 GB/s per thread against ~20-28), two independent accumulator chains per (weight row, batch row),
// then sums each accumulator's lanes. Threads split groups of weight rows by team_split.h: each streams its
// own contiguous slice of the weight, and takes from the others' when it is done. vdpbf16ps and widening to
// float32 + FMA measured the same (memory-bound); -DPAGEDSERVE_GEMV_WIDEN forces the latter.
// Measured on a 2-core AVX512-BF16 machine, one thread, bf16 3072x576 (CPU time, a shared machine):
// 28.6 GB/s at 1 row (the process's streaming read: ~23), 18.9 at 2, 16.0 at 4, 8.2 at 8 (the 8 rows
// take two passes of 4; past one row the dot products, not the memory, bound it).
// -DPAGEDSERVE_GEMV_PREFETCH=<bytes> (set by engine/kernels/cpu.py, except on AMD CPUs with AVX-512) adds a
// software prefetch of the stream that far ahead: on a 2-core Xeon with AMX, 2 threads, the embedded model's
// batch-1 products from memory went from 16-17.6 to 21-22 GB/s with 2048 bytes, and on an AVX2 EPYC (Zen 3) bf16
// decode steps ran 0.91-0.94x as long (on an AVX-512 EPYC, the measurement above, without it).
//
// Inner products by instruction set (chosen at compile time, -march):
//   AVX512-BF16  bf16: vdpbf16ps on pairs (32 k per step); float32: 16-lane FMA
//   AVX512F      bf16: both widened to float32 (shift / mask), FMA; float32: FMA
//   AVX2 + FMA   8-lane versions of the same
//   otherwise    scalar
// The k tail beyond the last full vector step is summed in scalar code.
//
// Layouts: x [rows, K] contiguous; w [N, K] contiguous; out [rows, N] contiguous; bias [N] or null.
#pragma once

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"
#include "team_split.h"

namespace pagedserve {
namespace gemv_detail {

constexpr int kGroup = 4;  // weight rows per micro-kernel call
constexpr int64_t kGroupsPerStep = 2;  // groups a thread takes at a time (team_split.h)
constexpr int64_t kParallelMinMacs = 1 << 16;  // below this, one thread beats waking the pool

// ---------------------------------------------------------------------------------- vector policies
// Each: kStep (k per step), kMaxR (batch rows per micro-kernel), Acc, zero(), madd(acc, w + k, x + k)
// accumulating the step's products, sum(acc).

#if defined(__AVX512F__)
struct F32x16 {
    static constexpr int kStep = 16, kMaxR = 4;
    using Acc = __m512;
    static Acc zero() { return _mm512_setzero_ps(); }
    static __m512 load_w(const float* w) { return _mm512_loadu_ps(w); }
    static Acc madd(Acc acc, __m512 w, const float* x) { return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc); }
    static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
    static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

#if defined(__AVX512BF16__) && !defined(PAGEDSERVE_GEMV_WIDEN)
struct Bf16x32 {  // vdpbf16ps: acc[i] += w[2i] x[2i] + w[2i+1] x[2i+1]
    static constexpr int kStep = 32, kMaxR = 4;
    using Acc = __m512;
    static Acc zero() { return _mm512_setzero_ps(); }
    static __m512i load_w(const uint16_t* w) { return _mm512_loadu_si512(w); }
    static Acc madd(Acc acc, __m512i w, const uint16_t* x) {
        return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
    }
    static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
    static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#else
struct Bf16x32 {  // 32 bf16 as two float32 vectors: even elements (shifted up), odd ones (masked)
    static constexpr int kStep = 32, kMaxR = 4;
    using Acc = __m512;
    static Acc zero() { return _mm512_setzero_ps(); }
    static __m512i load_w(const uint16_t* w) { return _mm512_loadu_si512(w); }
    static Acc madd(Acc acc, __m512i w, const uint16_t* x) {
        const __m512i xv = _mm512_loadu_si512(x);
        const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                              _mm512_castsi512_ps(_mm512_slli_epi32(xv, 16)), acc);
        return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)),
                               _mm512_castsi512_ps(_mm512_and_si512(xv, high)), acc);
    }
    static Acc add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
    static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif
#define PAGEDSERVE_GEMV_VECTOR 1

#elif defined(__AVX2__) && defined(__FMA__)
inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

struct F32x16 {  // two 8-lane vectors per step
    static constexpr int kStep = 16, kMaxR = 2;
    struct Acc { __m256 a, b; };
    struct W { __m256 a, b; };
    static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static W load_w(const float* w) { return {_mm256_loadu_ps(w), _mm256_loadu_ps(w + 8)}; }
    static Acc madd(Acc acc, W w, const float* x) {
        return {_mm256_fmadd_ps(w.a, _mm256_loadu_ps(x), acc.a), _mm256_fmadd_ps(w.b, _mm256_loadu_ps(x + 8), acc.b)};
    }
    static Acc add(Acc x, Acc y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
    static float sum(Acc acc) { return sum8(_mm256_add_ps(acc.a, acc.b)); }
};

struct Bf16x32 {  // 16 bf16 per half-step as two float32 vectors: even elements shifted up, odd masked
    static constexpr int kStep = 16, kMaxR = 2;
    struct Acc { __m256 a, b; };
    using W = __m256i;
    static Acc zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static W load_w(const uint16_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
    static Acc madd(Acc acc, W w, const uint16_t* x) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        return {_mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
                                _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)), acc.a),
                _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(w, high)),
                                _mm256_castsi256_ps(_mm256_and_si256(xv, high)), acc.b)};
    }
    static Acc add(Acc x, Acc y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
    static float sum(Acc acc) { return sum8(_mm256_add_ps(acc.a, acc.b)); }
};
#define PAGEDSERVE_GEMV_VECTOR 1
#endif

template <typename T>
struct Policy;
#if defined(PAGEDSERVE_GEMV_VECTOR)
template <>
struct Policy<float> { using type = F32x16; };
template <>
struct Policy<uint16_t> { using type = Bf16x32; };
#endif

// ---------------------------------------------------------------------------------- micro-kernels

// sums[g * R + r] = w[g] . x[r] over k in [0, K), for G weight rows and R batch rows.
#if defined(PAGEDSERVE_GEMV_VECTOR)
template <typename T, int G, int R>
void dot_tile(const T* w, const T* x, int64_t K, float* sums) {
    using P = typename Policy<T>::type;
    const int64_t main = K - K % P::kStep;
    for (int g = 0; g < G; ++g) {  // the G rows in memory order: one sequential stream
        const T* wg = w + g * K;
        typename P::Acc even[R], odd[R];  // two chains per batch row: half the dependent steps
        for (int r = 0; r < R; ++r) even[r] = odd[r] = P::zero();
        int64_t k = 0;
        for (; k + 2 * P::kStep <= main; k += 2 * P::kStep) {
#if defined(PAGEDSERVE_GEMV_PREFETCH)
            // each 64-byte line of the step once (AVX-512 bf16: 2 lines per step; AVX2 bf16: 1)
            for (int64_t line = 0; line < 2 * P::kStep * static_cast<int64_t>(sizeof(T)); line += 64)
                _mm_prefetch(reinterpret_cast<const char*>(wg + k) + PAGEDSERVE_GEMV_PREFETCH + line, _MM_HINT_T0);
#endif
            const auto w0 = P::load_w(wg + k);
            const auto w1 = P::load_w(wg + k + P::kStep);
            for (int r = 0; r < R; ++r) {
                even[r] = P::madd(even[r], w0, x + r * K + k);
                odd[r] = P::madd(odd[r], w1, x + r * K + k + P::kStep);
            }
        }
        for (; k < main; k += P::kStep) {
            const auto wv = P::load_w(wg + k);
            for (int r = 0; r < R; ++r) even[r] = P::madd(even[r], wv, x + r * K + k);
        }
        for (int r = 0; r < R; ++r) {
            float s = P::sum(P::add(even[r], odd[r]));
            for (k = main; k < K; ++k) s += to_float(wg[k]) * to_float(x[r * K + k]);
            sums[g * R + r] = s;
        }
    }
}
#else
template <typename T, int G, int R>
void dot_tile(const T* w, const T* x, int64_t K, float* sums) {
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; ++k) s += to_float(w[g * K + k]) * to_float(x[r * K + k]);
            sums[g * R + r] = s;
        }
}
#endif

#if defined(PAGEDSERVE_GEMV_VECTOR)
template <typename T>
constexpr int kMaxR = Policy<T>::type::kMaxR;
#else
template <typename T>
constexpr int kMaxR = 4;
#endif

// G weight rows starting at row o, every batch row (in groups of at most kMaxR).
template <typename T, int G>
void rows_of_group(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K,
                   int64_t o) {
    float sums[G * kMaxR<T>];
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxR<T>) {
        const int64_t count = rows - r0 < kMaxR<T> ? rows - r0 : kMaxR<T>;
        const T* xr = x + r0 * K;
        const T* wg = w + o * K;
        switch (count) {
            case 1: dot_tile<T, G, 1>(wg, xr, K, sums); break;
            case 2: dot_tile<T, G, 2>(wg, xr, K, sums); break;
            case 3: if constexpr (kMaxR<T> >= 3) dot_tile<T, G, 3>(wg, xr, K, sums); break;
            default: if constexpr (kMaxR<T> >= 4) dot_tile<T, G, 4>(wg, xr, K, sums); break;
        }
        for (int g = 0; g < G; ++g) {
            const float b = bias ? to_float(bias[o + g]) : 0.0f;
            for (int64_t r = 0; r < count; ++r) store(out + (r0 + r) * N + o + g, sums[g * count + r] + b);
        }
    }
}

}  // namespace gemv_detail

// out = x @ w^T (+ bias), work-shared over the calling OpenMP team by `split` (team_split.h: call it from inside a
// parallel region, every thread of the team, or from outside one to run it on this thread). Items: groups of
// kGroup weight rows, then one item for the rows past the last whole group.
template <typename T>
void gemv_for(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K, TeamSplit& split) {
    using namespace gemv_detail;
    const int64_t groups = N / kGroup;
    auto run = [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i) {
            if (i < groups) rows_of_group<T, kGroup>(x, w, bias, out, rows, N, K, i * kGroup);
            else
                for (int64_t o = groups * kGroup; o < N; ++o) rows_of_group<T, 1>(x, w, bias, out, rows, N, K, o);
        }
    };
    const int64_t items = groups + (N % kGroup != 0);
    split.run(items, kGroupsPerStep, run);
}

// The same with a team of its own when the product is large enough to pay for one.
template <typename T>
void gemv(const T* x, const T* w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K) {
    TeamSplit split;
    split.reset();
#pragma omp parallel if (N * K * rows >= gemv_detail::kParallelMinMacs)
    gemv_for(x, w, bias, out, rows, N, K, split);
}

}  // namespace pagedserve
