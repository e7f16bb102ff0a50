// How the prefill attention kernels (prefill_attention.cpp for bf16, prefill_attention_f32.cpp for float32) walk
// a prompt chunk: their work items, and the prefetch of a kv head's next key rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <immintrin.h>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace pagedserve::prefill {

// Calls attend(q0, q1, kv, scratch) for every work item (kv head `kv`, query positions [q0, q1) of one tile of
// `q_tile`), spread dynamically over the threads, each with its own Scratch(scratch_rows). Kv head after kv head,
// each one's later tiles (more keys) first: the threads read one kv head's K/V at a time, which stays in the
// caches from item to item. Taken tile by tile across the kv heads, the K/V of 8 or 16 kv heads at a long context
// did not fit the L3, and every item read its own from memory (docs/performance.md).
template <typename Scratch, typename Attend>
void for_each_item(int64_t query_len, int64_t kv_heads, int64_t q_tile, int64_t scratch_rows, const Attend& attend) {
    const int64_t tiles = (query_len + q_tile - 1) / q_tile, items = tiles * kv_heads;
#pragma omp parallel if (items > 1)
    {
        Scratch scratch(scratch_rows);
#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < items; ++index) {
            const int64_t tile = tiles - 1 - index % tiles, kv = index / tiles;
            const int64_t q0 = tile * q_tile;
            attend(q0, std::min(query_len, q0 + q_tile), kv, scratch);
        }
    }
}

// Calls attend(std::integral_constant<int, D>) for a head size the kernels are built for (64, 128); false, having
// called nothing, for another.
template <typename Attend>
bool with_head_dim(int64_t head_dim, const Attend& attend) {
    switch (head_dim) {
        case 64: attend(std::integral_constant<int, 64>{}); return true;
        case 128: attend(std::integral_constant<int, 128>{}); return true;
        default: return false;
    }
}

// Prefetches the K and V rows of tokens [t0, t1) at element `column` of each token's cache row (a kv head's
// `width` elements): a kv head's rows lie token_size apart, a stride the hardware prefetchers do not follow.
template <typename C>
inline void prefetch_rows(const C* key_cache, const C* value_cache, const int32_t* table, int64_t block_size,
                          int64_t token_size, int64_t column, int64_t width, int64_t t0, int64_t t1) {
    const int64_t bytes = width * static_cast<int64_t>(sizeof(C));
    for (int64_t t = t0; t < t1; ++t) {
        const int64_t at = (table[t / block_size] * block_size + t % block_size) * token_size + column;
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(key_cache + at) + b, _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(value_cache + at) + b, _MM_HINT_T0);
        }
    }
}

}  // namespace pagedserve::prefill
