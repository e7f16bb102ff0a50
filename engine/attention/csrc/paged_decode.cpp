// Paged decode attention for CPUs: one query token per sequence, attending to
// every cached token of its sequence, with K/V read in place from the block
// cache (no gather into a padded copy, no mask).
//
// Layouts (row-major, contiguous):
//   query        [num_seqs, num_heads, head_dim]
//   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike)
//   block_tables [num_seqs, table_width] int64
//   context_lens [num_seqs] int64, each >= 1
//   out          [num_seqs, num_heads, head_dim]
//
// Each sequence is one work item: one token's K (all kv heads) is a contiguous
// row, read once and scored against every query head. Threads come from the
// OpenMP runtime torch has already loaded (same soname, so one thread pool).
// Built and loaded by engine/attention/cpu_kernels.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t bf16) {
    uint32_t bits = static_cast<uint32_t>(bf16) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

inline void store(float* dst, float x) { *dst = x; }

inline void store(uint16_t* dst, float x) {  // bfloat16, round to nearest even; NaN stays NaN
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        *dst = static_cast<uint16_t>((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u);
    *dst = static_cast<uint16_t>(bits >> 16);
}

// exp(x) for x <= 0 (a score minus its row maximum), in a form loops vectorize:
// x = k ln2 + r with |r| <= ln2 / 2, exp(x) = 2^k p(r); relative error ~2e-7.
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);
    const float k = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t exponent_bits = (static_cast<int32_t>(k) + 127) << 23;
    float two_k;
    std::memcpy(&two_k, &exponent_bits, sizeof two_k);
    return p * two_k;
}

// HD > 0: head_dim known at compile time (the inner loops unroll fully); HD == 0: any head_dim.
template <typename T, int HD>
void paged_decode(const T* query, const T* key_cache, const T* value_cache, const int64_t* block_tables,
                  const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t runtime_head_dim, int64_t block_size, int64_t table_width, float scale) {
    const int64_t head_dim = HD > 0 ? HD : runtime_head_dim;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_size = num_kv_heads * head_dim;  // one token's K (or V) over all kv heads
    const int64_t block_stride = block_size * token_size;
    const int64_t query_size = num_heads * head_dim;

#pragma omp parallel
    {
        std::vector<float> q(query_size);
        std::vector<float> acc(query_size);
        std::vector<float> row(token_size);
        std::vector<float> inv_sum(num_heads);
        std::vector<float> scores;

#pragma omp for schedule(dynamic, 1)
        for (int64_t seq = 0; seq < num_seqs; ++seq) {
            const int64_t len = context_lens[seq];
            const int64_t* table = block_tables + seq * table_width;
            const T* q_src = query + seq * query_size;
            for (int64_t i = 0; i < query_size; ++i) q[i] = to_float(q_src[i]) * scale;
            scores.resize(static_cast<size_t>(num_heads * len));
            float* s = scores.data();
            float* r = row.data();

            // s[h][t] = q[h] . K[t][kv_head(h)]
            for (int64_t t = 0; t < len; ++t) {
                const T* k = key_cache + table[t / block_size] * block_stride + (t % block_size) * token_size;
#pragma omp simd
                for (int64_t i = 0; i < token_size; ++i) r[i] = to_float(k[i]);
                for (int64_t h = 0; h < num_heads; ++h) {
                    const float* qh = q.data() + h * head_dim;
                    const float* kh = r + (h / group) * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
                    s[h * len + t] = dot;
                }
            }

            // softmax over t for each head; the 1 / sum is applied to the output
            for (int64_t h = 0; h < num_heads; ++h) {
                float* sh = s + h * len;
                float m = sh[0];
#pragma omp simd reduction(max : m)
                for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; ++t) {
                    sh[t] = exp_nonpositive(sh[t] - m);
                    sum += sh[t];
                }
                inv_sum[h] = 1.0f / sum;
            }

            // acc[h] = sum_t p[h][t] V[t][kv_head(h)]
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t t = 0; t < len; ++t) {
                const T* v = value_cache + table[t / block_size] * block_stride + (t % block_size) * token_size;
#pragma omp simd
                for (int64_t i = 0; i < token_size; ++i) r[i] = to_float(v[i]);
                for (int64_t h = 0; h < num_heads; ++h) {
                    const float p = s[h * len + t];
                    const float* vh = r + (h / group) * head_dim;
                    float* a = acc.data() + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
                }
            }

            T* dst = out + seq * query_size;
            for (int64_t h = 0; h < num_heads; ++h)
                for (int64_t d = 0; d < head_dim; ++d) store(dst + h * head_dim + d, acc[h * head_dim + d] * inv_sum[h]);
        }
    }
}

template <typename T>
void dispatch(const T* query, const T* key_cache, const T* value_cache, const int64_t* block_tables,
              const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
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

extern "C" {

int pagedserve_kernels_abi() { return 1; }

void pagedserve_paged_decode_f32(const float* query, const float* key_cache, const float* value_cache,
                                 const int64_t* block_tables, const int64_t* context_lens, float* out,
                                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                 int64_t block_size, int64_t table_width, float scale) {
    dispatch(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
             head_dim, block_size, table_width, scale);
}

void pagedserve_paged_decode_bf16(const uint16_t* query, const uint16_t* key_cache, const uint16_t* value_cache,
                                  const int64_t* block_tables, const int64_t* context_lens, uint16_t* out,
                                  int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  int64_t block_size, int64_t table_width, float scale) {
    dispatch(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
             head_dim, block_size, table_width, scale);
}

}  // extern "C"
