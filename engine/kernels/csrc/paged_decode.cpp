// Paged decode attention for CPUs: one query token per sequence, attending to
// every cached token of its sequence, with K/V read in place from the block
// cache (no gather into a padded copy, no mask).
//
// Layouts (row-major, contiguous):
//   query        [num_seqs, num_heads, head_dim]
//   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
//   block_tables [num_seqs, table_width] int32
//   context_lens [num_seqs] int32, each >= 1
//   out          [num_seqs, num_heads, head_dim]
//
// Each sequence is one work item: one token's K (all kv heads) is a contiguous
// row, read once and scored against every query head. Threads come from the
// OpenMP runtime torch has already loaded (same soname, so one thread pool).
// Built and loaded by engine/kernels/cpu.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using pagedserve::fast_exp;
using pagedserve::store;
using pagedserve::to_float;

// Loads `count` bf16/f32 values as floats into `dst`; float rows are used in place instead.
template <typename T>
inline const float* as_floats(const T* src, float* dst, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
        (void)dst;
        (void)count;
        return src;
    } else {
#pragma omp simd
        for (int64_t i = 0; i < count; ++i) dst[i] = to_float(src[i]);
        return dst;
    }
}

// One pass over a sequence's blocks with an online softmax (running max m, running sum l per
// head): K and V of each block are read once, scores live in a block-sized buffer. (Measured: 1.6x
// faster than scoring all tokens first, then softmax, then a second pass for V; prefetching the
// next block explicitly made no measurable difference.)
// HD > 0: head_dim known at compile time (the inner loops unroll fully); HD == 0: any head_dim.
template <typename T, int HD>
void paged_decode(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
                  const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t runtime_head_dim, int64_t block_size, int64_t table_width, float scale) {
    const int64_t head_dim = HD > 0 ? HD : runtime_head_dim;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_size = num_kv_heads * head_dim;  // one token's K (or V) over all kv heads
    const int64_t block_stride = block_size * token_size;
    const int64_t query_size = num_heads * head_dim;

#pragma omp parallel if (num_seqs > 1)  // one sequence: no team to wake
    {
        std::vector<float> q(query_size), acc(query_size), row(token_size);
        std::vector<float> running_max(num_heads), running_sum(num_heads);
        std::vector<float> scores(num_heads * block_size);

#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq) {
            const int64_t len = context_lens[seq];
            const int64_t num_blocks = (len + block_size - 1) / block_size;
            const int32_t* table = block_tables + seq * table_width;
            const T* q_src = query + seq * query_size;
            for (int64_t i = 0; i < query_size; ++i) q[i] = to_float(q_src[i]) * scale;
            std::fill(acc.begin(), acc.end(), 0.0f);
            std::fill(running_max.begin(), running_max.end(), -INFINITY);
            std::fill(running_sum.begin(), running_sum.end(), 0.0f);
            float* s = scores.data();

            for (int64_t b = 0; b < num_blocks; ++b) {
                const T* keys = key_cache + table[b] * block_stride;
                const T* values = value_cache + table[b] * block_stride;
                const int64_t n = std::min(block_size, len - b * block_size);

                // s[h][j] = q[h] . K[j][kv_head(h)]
                for (int64_t j = 0; j < n; ++j) {
                    const float* k = as_floats(keys + j * token_size, row.data(), token_size);
                    for (int64_t h = 0; h < num_heads; ++h) {
                        const float* qh = q.data() + h * head_dim;
                        const float* kh = k + (h / group) * head_dim;
                        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
                        s[h * block_size + j] = dot;
                    }
                }

                // online softmax: rescale what was accumulated when the maximum grows
                for (int64_t h = 0; h < num_heads; ++h) {
                    float* sh = s + h * block_size;
                    float block_max = sh[0];
                    for (int64_t j = 1; j < n; ++j) block_max = std::max(block_max, sh[j]);
                    const float new_max = std::max(running_max[h], block_max);
                    const float correction = fast_exp(running_max[h] - new_max);
                    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                    for (int64_t j = 0; j < n; ++j) {
                        sh[j] = fast_exp(sh[j] - new_max);
                        sum += sh[j];
                    }
                    running_sum[h] = running_sum[h] * correction + sum;
                    running_max[h] = new_max;
                    if (correction != 1.0f) {
                        float* a = acc.data() + h * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
                    }
                }

                // acc[h] += sum_j p[h][j] V[j][kv_head(h)]
                for (int64_t j = 0; j < n; ++j) {
                    const float* v = as_floats(values + j * token_size, row.data(), token_size);
                    for (int64_t h = 0; h < num_heads; ++h) {
                        const float p = s[h * block_size + j];
                        const float* vh = v + (h / group) * head_dim;
                        float* a = acc.data() + h * head_dim;
#pragma omp simd
                        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
                    }
                }
            }

            T* dst = out + seq * query_size;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float inv = 1.0f / running_sum[h];
                for (int64_t d = 0; d < head_dim; ++d) store(dst + h * head_dim + d, acc[h * head_dim + d] * inv);
            }
        }
    }
}

template <typename T>
void dispatch(const T* query, const T* key_cache, const T* value_cache, const int32_t* block_tables,
              const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, int64_t table_width, float scale) {
#define PAGEDSERVE_DECODE(HD)                                                                                   \
    paged_decode<T, HD>(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads,   \
                        num_kv_heads, head_dim, block_size, table_width, scale)
    switch (head_dim) {
        case 64: PAGEDSERVE_DECODE(64); break;
        case 128: PAGEDSERVE_DECODE(128); break;
        case 256: PAGEDSERVE_DECODE(256); break;
        default: PAGEDSERVE_DECODE(0); break;
    }
#undef PAGEDSERVE_DECODE
}

}  // namespace

#define PAGEDSERVE_PAGED_DECODE(SUFFIX, T)                                                                     \
    void pagedserve_paged_decode_##SUFFIX(const T* query, const T* key_cache, const T* value_cache,             \
                                          const int32_t* block_tables, const int32_t* context_lens, T* out,     \
                                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,            \
                                          int64_t head_dim, int64_t block_size, int64_t table_width,            \
                                          float scale) {                                                        \
        dispatch(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads,          \
                 num_kv_heads, head_dim, block_size, table_width, scale);                                      \
    }

extern "C" {
PAGEDSERVE_PAGED_DECODE(f32, float)
PAGEDSERVE_PAGED_DECODE(bf16, uint16_t)
}
