// Fused decode kernels for small batches (one new token per sequence), each a single OpenMP team whose
// phases are separated by the work-sharing loops' barriers:
//   decode_qkv     [residual += h;] x = rms_norm(residual); qkv = x @ w_qkv^T (+ b); RoPE on q and k;
//                  k and v stored at each token's cache slot; q out, contiguous [rows, heads, head_dim]
//   decode_o_mlp   residual += attn @ w_o^T (+ b); x = rms_norm(residual); [g | u] = x @ w_gu^T (+ b);
//                  out = (silu(g) * u) @ w_down^T (+ b)
// Between the two, the paged attention kernel (paged_decode.cpp) reads the cache. Every intermediate is
// rounded to T where the unfused ops (layer_ops.cpp, gemv.cpp) round it, so the results are theirs.
//
// Layouts (row-major, contiguous): h, residual [rows, hidden]; weights [out, in]; caches
// [num_blocks * block_size, kv_heads, head_dim] addressed by slot; positions, slots [rows] int64;
// cos / sin_signed [max_positions, head_dim]; attn [rows, heads * head_dim]; out [rows, hidden].

#include <cstdint>
#include <cstring>
#include <vector>

#include "gemv.h"
#include "row_ops.h"

namespace {

using pagedserve::add_rms_norm_row;
using pagedserve::gemv_for;
using pagedserve::rms_norm_row;
using pagedserve::rotary_row;
using pagedserve::silu_and_mul_row;

template <typename T>
void decode_qkv(const T* h, T* residual, const T* norm, const T* w_qkv, const T* b_qkv, const int64_t* positions,
                const T* cos, const T* sin_signed, T* key_cache, T* value_cache, const int64_t* slots, T* query,
                int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, float eps) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    std::vector<T> x(rows * hidden), qkv(rows * width);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* res = residual + r * hidden;
            if (h != nullptr) add_rms_norm_row(h + r * hidden, res, norm, x.data() + r * hidden, hidden, eps);
            else rms_norm_row(res, norm, x.data() + r * hidden, hidden, eps);
        }
        gemv_for(x.data(), w_qkv, b_qkv, qkv.data(), rows, width, hidden);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* row = qkv.data() + r * width;  // [q heads | k heads | v heads] x head_dim
            rotary_row(row, cos + positions[r] * head_dim, sin_signed + positions[r] * head_dim, heads + kv_heads,
                       head_dim);
            std::memcpy(query + r * q_size, row, q_size * sizeof(T));
            std::memcpy(key_cache + slots[r] * kv_size, row + q_size, kv_size * sizeof(T));
            std::memcpy(value_cache + slots[r] * kv_size, row + q_size + kv_size, kv_size * sizeof(T));
        }
    }
}

template <typename T>
void decode_o_mlp(const T* attn, T* residual, const T* w_o, const T* b_o, const T* norm, const T* w_gu,
                  const T* b_gu, const T* w_down, const T* b_down, T* out, int64_t rows, int64_t hidden,
                  int64_t attn_width, int64_t inter, float eps) {
    std::vector<T> o(rows * hidden), x(rows * hidden), gate_up(rows * 2 * inter), act(rows * inter);
#pragma omp parallel
    {
        gemv_for(attn, w_o, b_o, o.data(), rows, hidden, attn_width);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            add_rms_norm_row(o.data() + r * hidden, residual + r * hidden, norm, x.data() + r * hidden, hidden, eps);
        gemv_for(x.data(), w_gu, b_gu, gate_up.data(), rows, 2 * inter, hidden);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) silu_and_mul_row(gate_up.data() + r * 2 * inter, act.data() + r * inter, inter);
        gemv_for(act.data(), w_down, b_down, out, rows, hidden, inter);
    }
}

}  // namespace

#define PAGEDSERVE_DECODE_LAYER(SUFFIX, T)                                                                       \
    void pagedserve_decode_qkv_##SUFFIX(const T* h, T* residual, const T* norm, const T* w_qkv, const T* b_qkv,  \
                                        const int64_t* positions, const T* cos, const T* sin_signed,             \
                                        T* key_cache, T* value_cache, const int64_t* slots, T* query,            \
                                        int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads,           \
                                        int64_t head_dim, float eps) {                                           \
        decode_qkv(h, residual, norm, w_qkv, b_qkv, positions, cos, sin_signed, key_cache, value_cache, slots,   \
                   query, rows, hidden, heads, kv_heads, head_dim, eps);                                         \
    }                                                                                                            \
    void pagedserve_decode_o_mlp_##SUFFIX(const T* attn, T* residual, const T* w_o, const T* b_o, const T* norm, \
                                          const T* w_gu, const T* b_gu, const T* w_down, const T* b_down,        \
                                          T* out, int64_t rows, int64_t hidden, int64_t attn_width,              \
                                          int64_t inter, float eps) {                                            \
        decode_o_mlp(attn, residual, w_o, b_o, norm, w_gu, b_gu, w_down, b_down, out, rows, hidden, attn_width,  \
                     inter, eps);                                                                                \
    }

extern "C" {
PAGEDSERVE_DECODE_LAYER(f32, float)
PAGEDSERVE_DECODE_LAYER(bf16, uint16_t)
}
