// A whole decode step's layers in one call, for small batches (one new token per sequence). Per layer,
// two fused kernels, each a single OpenMP team whose phases are separated by the work-sharing loops'
// barriers, around the paged attention kernel (paged_decode.cpp):
//   decode_qkv     [residual += h;] x = rms_norm(residual); qkv = x @ w_qkv^T (+ b); RoPE on q and k;
//                  k and v stored at each token's cache slot; q out, contiguous [rows, heads, head_dim]
//   decode_o_mlp   residual += attn @ w_o^T (+ b); x = rms_norm(residual); [g | u] = x @ w_gu^T (+ b);
//                  out = (silu(g) * u) @ w_down^T (+ b)
// Every intermediate is
// rounded to T where the unfused ops (layer_ops.cpp, gemv.cpp) round it, so the results are theirs.
//
// Layouts (row-major, contiguous): h, residual [rows, hidden]; weights [out, in]; caches
// [num_blocks * block_size, kv_heads, head_dim] addressed by slot; positions, slots [rows] int64;
// cos / sin_signed [max_positions, head_dim]; attn [rows, heads * head_dim]; out [rows, hidden];
// block_tables [rows, table_width] int32, context_lens [rows] int32 (the new token included); per layer
// one row of the weight table (WeightColumn) and one address in key_caches / value_caches.

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
        for (int64_t r = 0; r < rows; ++r)
            silu_and_mul_row(gate_up.data() + r * 2 * inter, act.data() + r * inter, inter);
        gemv_for(act.data(), w_down, b_down, out, rows, hidden, inter);
    }
}

// The exported paged attention (paged_decode.cpp), per element type.
extern "C" {
void pagedserve_paged_decode_f32(const float*, const float*, const float*, const int32_t*, const int32_t*, float*,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float);
void pagedserve_paged_decode_bf16(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*,
                                  const int32_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  float);
}

inline void paged_decode(const float* q, const float* k, const float* v, const int32_t* tables, const int32_t* lens,
                         float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t width, float scale) {
    pagedserve_paged_decode_f32(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width, scale);
}

inline void paged_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables,
                         const int32_t* lens, uint16_t* out, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t width, float scale) {
    pagedserve_paged_decode_bf16(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width,
                                 scale);
}

// Columns of a layer's row in the weight table (addresses; 0 for an absent bias).
enum WeightColumn { kInputNorm, kQkv, kQkvBias, kOProj, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias,
                    kWeightColumns };

struct DecodeShape {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter, block_size, table_width;
    float eps, scale;
};

// Every layer of a decode step: decode_qkv, paged attention, decode_o_mlp. `out` ends as the last
// layer's MLP output (the caller adds it to the residual).
template <typename T>
void decode_layers(T* residual, const int64_t* weights, const int64_t* key_caches, const int64_t* value_caches,
                   const int64_t* positions, const T* cos, const T* sin_signed, const int64_t* slots,
                   const int32_t* block_tables, const int32_t* context_lens, T* out, int64_t num_layers,
                   const DecodeShape& s) {
    std::vector<T> query(s.rows * s.heads * s.head_dim), attn(query.size());
    const T* h = nullptr;
    for (int64_t layer = 0; layer < num_layers; ++layer) {
        const int64_t* row = weights + layer * kWeightColumns;
        auto w = [row](WeightColumn column) { return reinterpret_cast<const T*>(row[column]); };
        T* key_cache = reinterpret_cast<T*>(key_caches[layer]);
        T* value_cache = reinterpret_cast<T*>(value_caches[layer]);
        decode_qkv(h, residual, w(kInputNorm), w(kQkv), w(kQkvBias), positions, cos, sin_signed, key_cache,
                   value_cache, slots, query.data(), s.rows, s.hidden, s.heads, s.kv_heads, s.head_dim, s.eps);
        paged_decode(query.data(), key_cache, value_cache, block_tables, context_lens, attn.data(), s.rows, s.heads,
                     s.kv_heads, s.head_dim, s.block_size, s.table_width, s.scale);
        decode_o_mlp(attn.data(), residual, w(kOProj), w(kOBias), w(kPostNorm), w(kGateUp), w(kGateUpBias), w(kDown),
                     w(kDownBias), out, s.rows, s.hidden, s.heads * s.head_dim, s.inter, s.eps);
        h = out;
    }
}

}  // namespace

#define PAGEDSERVE_DECODE_LAYERS(SUFFIX, T)                                                                      \
    void pagedserve_decode_layers_##SUFFIX(T* residual, const int64_t* weights, const int64_t* key_caches,       \
                                           const int64_t* value_caches, const int64_t* positions, const T* cos,  \
                                           const T* sin_signed, const int64_t* slots, const int32_t* block_tables,\
                                           const int32_t* context_lens, T* out, int64_t num_layers, int64_t rows,\
                                           int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,    \
                                           int64_t inter, int64_t block_size, int64_t table_width, float eps,    \
                                           float scale) {                                                        \
        const DecodeShape shape{rows, hidden, heads, kv_heads, head_dim, inter, block_size, table_width, eps, scale}; \
        decode_layers(residual, weights, key_caches, value_caches, positions, cos, sin_signed, slots, block_tables, \
                      context_lens, out, num_layers, shape);                                                     \
    }

extern "C" {
PAGEDSERVE_DECODE_LAYERS(f32, float)
PAGEDSERVE_DECODE_LAYERS(bf16, uint16_t)
}

