// A whole decode step's layers in one call, for small batches (one new token per sequence). Per layer,
// two fused kernels, each a single OpenMP team whose phases are separated by the work-sharing loops'
// barriers, around the paged attention kernel (paged_decode.cpp):
//   decode_qkv     [residual += h;] x = rms_norm(residual); qkv = x @ w_qkv^T (+ b); [each q and k head
//                  rms_norm'd by q_norm / k_norm (Qwen3), or all of q and all of k (qk_norm_projection,
//                  OLMo 2);] RoPE on q and k; k and v stored at each token's cache slot; q out, contiguous
//                  [rows, heads, head_dim]
//   decode_o_mlp   residual += attn @ w_o^T (+ b); x = rms_norm(residual); [g | u] = x @ w_gu^T (+ b);
//                  out = (act(g) * u) @ w_down^T (+ b), act silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
// (Llama's layer.) A norm before a branch may be absent (x = residual: OLMo 2), and a branch's output may be
// normalized before it is added (attn_post / mlp_post norms: OLMo 2, Gemma), then multiplied by residual_scale
// (Granite's; 1: as it is); the attention may be soft-capped, and each layer sliding-windowed over the blocks of
// its own KV group, with its own RoPE tables (layer_table, LayerColumn). Every intermediate is rounded to T where
// the unfused ops (layer_ops.cpp, gemv.cpp, quant_gemm.cpp) round it, so the results are theirs. A matrix is
// plain T [out, in] (the small-batch product of gemv.h), packed in column blocks (the product of
// column_blocks.h), or GGUF blocks (the integer product of quant_product.h, which the unfused path takes below
// its bf16-tile row count).
//
// Layouts (row-major, contiguous): h, residual [rows, hidden]; weights [out, in]; caches
// [num_blocks * block_size, kv_heads, head_dim] addressed by slot; positions, slots [rows] int64;
// cos / sin_signed [max_positions, head_dim]; attn [rows, heads * head_dim]; out [rows, hidden];
// block_tables [rows, table_width] int32, context_lens [rows] int32 (the new token included); per layer
// one row of the weight table (WeightColumn: addresses of the norms and biases, then per matrix
// kMatrixColumns values, see Matrix) and one address in key_caches / value_caches. A layer table (null: none)
// gives each layer its own block tables, context lengths, table width, slots, window and cos / sin tables instead
// (LayerColumn).
//
// With LoRA adapters (a null lora_table: none), each projection's deltas (lora_delta.h) are added to its
// output inside the same team, before anything reads it: the unfused path adds them with the same code.
// lora_table [num_layers, 8] holds per layer the stacked A and B of qkv, o, gate_up and down
// (engine/lora/lora_stack.py's a / b); lora_slots / lora_scales [rows, lora_width] each token's slots
// (-1: none) and scales; lora_ranks [max_loras] each slot's rank.

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "column_blocks.h"
#include "gemv.h"
#include "lora_delta.h"
#include "quant_product.h"
#include "row_ops.h"

namespace {

using pagedserve::add_rms_norm_row;
using pagedserve::gemv_for;
using pagedserve::store;
using pagedserve::to_float;
using pagedserve::quant::BlockMatrix;
using pagedserve::quant::integer_product_for;
using pagedserve::quant::Scratch;
using pagedserve::rms_norm_row;
using pagedserve::rotary_row;
using pagedserve::gelu_tanh_and_mul_row;
using pagedserve::silu_and_mul_row;

// A projection's weight: plain T [N, K] at `data` (format kPlain), packed in column blocks (kColumnBlocks,
// column_blocks.h; kColumnBlocksTiles: its product may run on AMX tiles), or GGUF blocks (qs at `data`,
// scales d, Q4_1 minimums m (kRows; kX16 records hold their own), nbp blocks per row; format a
// pagedserve::quant::Format >= 0, layout a ...::Layout).
struct Matrix {
    const void* data;
    const uint16_t* d;
    const uint16_t* m;
    int64_t format;
    int64_t nbp;
    int64_t layout;
};
constexpr int kMatrixColumns = 6;  // its values in a row of the weight table, in the order above
constexpr int64_t kPlain = -1, kColumnBlocks = -2, kColumnBlocksTiles = -3;  // fused_decode.py's format codes

// One layer's adapters (lora_delta.h) for the step, or none (`plan` null).
template <typename T>
struct LayerLoRA {
    pagedserve::lora::Projection<T> qkv, o, gate_up, down;
    const pagedserve::lora::Plan* plan;
    float* shrunk;  // the shrink's scratch, large enough for any projection
};

// A projection's deltas around its base product: the shrink (of its input) before it, without waiting, and the
// expand into its output after the product's barrier (the expand's own barrier, and a row loop's, come before
// the next projection's shrink: one scratch serves them all).
template <typename T>
void shrink_lora_for(const T* x, const LayerLoRA<T>& lora, const pagedserve::lora::Projection<T>& proj,
                     float* shrunk) {
    if (lora.plan != nullptr) pagedserve::lora::shrink_for(x, proj, *lora.plan, shrunk, true);
}

template <typename T>
void expand_lora_for(T* out, const LayerLoRA<T>& lora, const pagedserve::lora::Projection<T>& proj,
                     const float* shrunk) {
    if (lora.plan != nullptr) pagedserve::lora::expand_for(out, proj, *lora.plan, shrunk);
}

// out [rows, N] = x [rows, K] @ W.T (+ bias), work-shared over the calling team; `scratch` holds the int8
// activations of a block-quantized W (reserved for rows x nbp before the team started).
template <typename T>
void product_for(const T* x, const Matrix& w, const T* bias, T* out, int64_t rows, int64_t N, int64_t K,
                 Scratch& scratch) {
    if (w.format == kColumnBlocks || w.format == kColumnBlocksTiles) {
        pagedserve::column_blocks::product_for(x, static_cast<const T*>(w.data), bias, out, rows, N, K, scratch.split,
                                               w.format == kColumnBlocksTiles);
        return;
    }
    if (w.format == kPlain) {
        gemv_for(x, static_cast<const T*>(w.data), bias, out, rows, N, K, scratch.split);
        return;
    }
    integer_product_for(x, BlockMatrix{static_cast<const uint8_t*>(w.data), w.d, w.m, w.format, w.nbp, w.layout},
                        out, rows, K, N, scratch);
    if (bias == nullptr) return;
#pragma omp for schedule(static)  // rounded, then the bias added and rounded: as `out + bias` in torch
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = 0; n < N; ++n) store(out + r * N + n, to_float(out[r * N + n]) + to_float(bias[n]));
}

// K/V of a token into its cache slot: copied, or converted to the cache's fp8 (as kv_cache.to_cache does).
template <typename T>
inline void to_cache(const T* src, T* dst, int64_t count) { std::memcpy(dst, src, count * sizeof(T)); }

template <typename T>
inline void to_cache(const T* src, pagedserve::Fp8E4M3* dst, int64_t count) {
    for (int64_t i = 0; i < count; ++i) store(dst + i, to_float(src[i]));
}

// [residual += h (rounded to T);] out = rms_norm(residual), or residual itself without a norm (OLMo 2's layers
// have none before their branches).
template <typename T>
void add_norm_row(const T* h, T* residual, const T* norm, T* out, int64_t hidden, float eps) {
    if (norm != nullptr) {
        if (h != nullptr) add_rms_norm_row(h, residual, norm, out, hidden, eps);
        else rms_norm_row(residual, norm, out, hidden, eps);
        return;
    }
    if (h != nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) store(residual + i, to_float(residual[i]) + to_float(h[i]));
    }
    std::memcpy(out, residual, hidden * sizeof(T));
}

template <typename T, typename C>
void decode_qkv(const T* h, T* residual, const T* norm, const Matrix& w_qkv, const T* b_qkv, const T* q_norm,
                const T* k_norm, bool qk_norm_projection, const int64_t* positions, const T* cos,
                const T* sin_signed, C* key_cache, C* value_cache, const int64_t* slots, T* query,
                int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t rotary_dim,
                float eps,
                Scratch& scratch, const LayerLoRA<T>& lora) {
    const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    std::vector<T> x(rows * hidden), qkv(rows * width);
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            add_norm_row(h != nullptr ? h + r * hidden : nullptr, residual + r * hidden, norm, x.data() + r * hidden,
                         hidden, eps);
        shrink_lora_for(x.data(), lora, lora.qkv, lora.shrunk);
        product_for(x.data(), w_qkv, b_qkv, qkv.data(), rows, width, hidden, scratch);
        expand_lora_for(qkv.data(), lora, lora.qkv, lora.shrunk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            T* row = qkv.data() + r * width;  // [q heads | k heads | v heads] x head_dim
            // each head normalized in place, as the unfused path's rms_norm over heads, or all of q and all of k
            // (_model_fits: both norms or neither)
            if (q_norm != nullptr && qk_norm_projection) {
                rms_norm_row(row, q_norm, row, q_size, eps);
                rms_norm_row(row + q_size, k_norm, row + q_size, kv_size, eps);
            } else if (q_norm != nullptr) {
                for (int64_t head = 0; head < heads; ++head)
                    rms_norm_row(row + head * head_dim, q_norm, row + head * head_dim, head_dim, eps);
                for (int64_t head = heads; head < heads + kv_heads; ++head)
                    rms_norm_row(row + head * head_dim, k_norm, row + head * head_dim, head_dim, eps);
            }
            // each head's first rotary_dim dimensions (the tables' width; Phi-4-mini's partial rotary, else all)
            rotary_row(row, cos + positions[r] * rotary_dim, sin_signed + positions[r] * rotary_dim, heads + kv_heads,
                       head_dim, rotary_dim);
            std::memcpy(query + r * q_size, row, q_size * sizeof(T));
            to_cache(row + q_size, key_cache + slots[r] * kv_size, kv_size);
            to_cache(row + q_size + kv_size, value_cache + slots[r] * kv_size, kv_size);
        }
    }
}

// Each branch's output times `residual_scale` before it joins the residual stream (Granite's residual_multiplier;
// 1: as it is), rounded to T in a pass of its own as torch's `branch * scale` rounds it before the add: the build
// leaves GCC's contraction on (-ffp-contract=fast, even with -std=c++17), and a multiply feeding the add in one
// loop would become an FMA, unrounded in between.
template <typename T>
void scale_row(T* x, int64_t n, float scale) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store(x + i, to_float(x[i]) * scale);
}

// A branch's output as it joins the residual stream: normalized by `post_norm` (if any), then times
// `residual_scale`, each rounded to T as the unfused path's ops round them.
template <typename T>
void finish_branch_row(T* x, const T* post_norm, float residual_scale, int64_t hidden, float eps) {
    if (post_norm != nullptr) rms_norm_row(x, post_norm, x, hidden, eps);
    if (residual_scale != 1.0f) scale_row(x, hidden, residual_scale);
}

template <typename T>
void decode_o_mlp(const T* attn, T* residual, const Matrix& w_o, const T* b_o, const T* attn_post_norm,
                  const T* norm, const Matrix& w_gu, const T* b_gu, const Matrix& w_down, const T* b_down,
                  const T* mlp_post_norm, T* out, int64_t rows, int64_t hidden, int64_t attn_width, int64_t inter,
                  bool gelu, float eps, float residual_scale, Scratch& scratch, const LayerLoRA<T>& lora) {
    std::vector<T> o(rows * hidden), x(rows * hidden), gate_up(rows * 2 * inter), act(rows * inter);
#pragma omp parallel
    {
        shrink_lora_for(attn, lora, lora.o, lora.shrunk);
        product_for(attn, w_o, b_o, o.data(), rows, hidden, attn_width, scratch);
        expand_lora_for(o.data(), lora, lora.o, lora.shrunk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            finish_branch_row(o.data() + r * hidden, attn_post_norm, residual_scale, hidden, eps);
            add_norm_row(o.data() + r * hidden, residual + r * hidden, norm, x.data() + r * hidden, hidden, eps);
        }
        shrink_lora_for(x.data(), lora, lora.gate_up, lora.shrunk);
        product_for(x.data(), w_gu, b_gu, gate_up.data(), rows, 2 * inter, hidden, scratch);
        expand_lora_for(gate_up.data(), lora, lora.gate_up, lora.shrunk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r)
            if (gelu) gelu_tanh_and_mul_row(gate_up.data() + r * 2 * inter, act.data() + r * inter, inter);
            else silu_and_mul_row(gate_up.data() + r * 2 * inter, act.data() + r * inter, inter);
        shrink_lora_for(act.data(), lora, lora.down, lora.shrunk);
        product_for(act.data(), w_down, b_down, out, rows, hidden, inter, scratch);
        expand_lora_for(out, lora, lora.down, lora.shrunk);
        if (mlp_post_norm != nullptr || residual_scale != 1.0f) {  // (the next layer's add, or the step's last,
#pragma omp for schedule(static)                                       // takes it finished)
            for (int64_t r = 0; r < rows; ++r)
                finish_branch_row(out + r * hidden, mlp_post_norm, residual_scale, hidden, eps);
        }
    }
}

// The exported paged attention (paged_decode.cpp), per element type.
extern "C" {
void pagedserve_paged_decode_f32(const float*, const float*, const float*, const int32_t*, const int32_t*, float*,
                                 int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, int64_t,
                                 float, const float*);
void pagedserve_paged_decode_bf16(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*,
                                  const int32_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  float, int64_t, int64_t, float, const float*);
void pagedserve_paged_decode_f32_fp8(const float*, const pagedserve::Fp8E4M3*, const pagedserve::Fp8E4M3*,
                                     const int32_t*, const int32_t*, float*, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t, float, int64_t, int64_t, float, const float*);
void pagedserve_paged_decode_bf16_fp8(const uint16_t*, const pagedserve::Fp8E4M3*, const pagedserve::Fp8E4M3*,
                                      const int32_t*, const int32_t*, uint16_t*, int64_t, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, float, int64_t, int64_t, float, const float*);
}

inline void paged_decode(const float* q, const float* k, const float* v, const int32_t* tables, const int32_t* lens,
                         float* out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim,
                         int64_t block_size, int64_t width, float scale, int64_t window, float softcap) {
    pagedserve_paged_decode_f32(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width, scale,
                                1, window, softcap, nullptr);  // (the fused step serves models without sinks)
}

inline void paged_decode(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int32_t* tables,
                         const int32_t* lens, uint16_t* out, int64_t rows, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
                         float softcap) {
    pagedserve_paged_decode_bf16(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width,
                                 scale, 1, window, softcap, nullptr);
}

inline void paged_decode(const float* q, const pagedserve::Fp8E4M3* k, const pagedserve::Fp8E4M3* v,
                         const int32_t* tables, const int32_t* lens, float* out, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale,
                         int64_t window, float softcap) {
    pagedserve_paged_decode_f32_fp8(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width,
                                    scale, 1, window, softcap, nullptr);
}

inline void paged_decode(const uint16_t* q, const pagedserve::Fp8E4M3* k, const pagedserve::Fp8E4M3* v,
                         const int32_t* tables, const int32_t* lens, uint16_t* out, int64_t rows, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale,
                         int64_t window, float softcap) {
    pagedserve_paged_decode_bf16_fp8(q, k, v, tables, lens, out, rows, heads, kv_heads, head_dim, block_size, width,
                                     scale, 1, window, softcap, nullptr);
}

// Columns of a layer's row in the weight table: addresses of the norms and biases (0 for an absent bias or norm;
// the q and k norms both or neither), then each matrix's kMatrixColumns values.
enum WeightColumn {
    kInputNorm, kPostNorm, kQkvBias, kOBias, kGateUpBias, kDownBias, kQNorm, kKNorm, kAttnPostNorm, kMlpPostNorm,
    kQkv, kOProj = kQkv + kMatrixColumns, kGateUp = kOProj + kMatrixColumns, kDown = kGateUp + kMatrixColumns,
    kWeightColumns = kDown + kMatrixColumns
};

Matrix matrix_at(const int64_t* row, int column) {
    const int64_t* v = row + column;
    return Matrix{reinterpret_cast<const void*>(v[0]), reinterpret_cast<const uint16_t*>(v[1]),
                  reinterpret_cast<const uint16_t*>(v[2]), v[3], v[4], v[5]};
}

struct DecodeShape {
    int64_t rows, hidden, heads, kv_heads, head_dim, rotary_dim, inter, block_size, table_width;
    bool qk_norm_projection, gelu;  // gelu: GeGLU (gelu_tanh(g) * u, Gemma), else SwiGLU
    float eps, scale, residual_scale, softcap;  // softcap: of the attention scores (0: none)
};

// A layer's row of the step's layer table (null table: every layer takes the step's own arguments): its KV group's
// block tables, context lengths, table width and K/V slots, its sliding window (0: none), its RoPE tables (Gemma:
// sliding and full layers in two groups, each with its blocks; Gemma 3's sliding layers with their own RoPE).
enum LayerColumn { kTables, kLens, kWidth, kSlots, kWindow, kCos, kSin, kLayerColumns };

// The step's adapters as the exported function receives them (see the file comment).
struct StepLoRA {
    const int64_t* table;
    const int32_t* slots;
    const float* scales;
    const int32_t* ranks;
    int64_t width, max_rank, max_loras;
};
constexpr int kLoRAColumns = 8;  // a row of lora_table: (A, B) of qkv, o, gate_up, down

template <typename T>
LayerLoRA<T> layer_lora(const StepLoRA& step, const pagedserve::lora::Plan* plan, float* shrunk, int64_t layer,
                        const DecodeShape& s) {
    using pagedserve::lora::Projection;
    LayerLoRA<T> lora{};
    if (plan == nullptr) return lora;
    const int64_t* row = step.table + layer * kLoRAColumns;
    auto at = [row](int column) { return reinterpret_cast<const T*>(row[column]); };
    const int64_t q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    lora.qkv = Projection<T>{at(0), at(1), s.hidden, q + 2 * kv, 3, {q, kv, kv}};
    lora.o = Projection<T>{at(2), at(3), q, s.hidden, 1, {s.hidden, 0, 0}};
    lora.gate_up = Projection<T>{at(4), at(5), s.hidden, 2 * s.inter, 2, {s.inter, s.inter, 0}};
    lora.down = Projection<T>{at(6), at(7), s.inter, s.hidden, 1, {s.hidden, 0, 0}};
    lora.plan = plan;
    lora.shrunk = shrunk;
    return lora;
}

// Every layer of a decode step: decode_qkv, paged attention, decode_o_mlp. `out` ends as the last
// layer's MLP output and `residual` as the stream after it (that output added, rounded as torch's add).
// C: the caches' element type (T, or fp8 e4m3 with --kv-cache-dtype fp8).
template <typename T, typename C>
void decode_layers(T* residual, const int64_t* weights, const int64_t* key_caches, const int64_t* value_caches,
                   const int64_t* positions, const T* cos, const T* sin_signed, const int64_t* slots,
                   const int32_t* block_tables, const int32_t* context_lens, T* out, int64_t num_layers,
                   const int64_t* layer_table, const DecodeShape& s, const StepLoRA& step_lora) {
    std::vector<T> query(s.rows * s.heads * s.head_dim), attn(query.size());
    std::unique_ptr<pagedserve::lora::Plan> plan;  // built once for every layer of the step
    if (step_lora.table != nullptr)
        plan = std::make_unique<pagedserve::lora::Plan>(step_lora.slots, step_lora.scales, step_lora.ranks, s.rows,
                                                         step_lora.width, step_lora.max_rank, step_lora.max_loras);
    if (plan != nullptr && plan->empty()) plan.reset();
    std::vector<float> shrunk(plan == nullptr ? 0 : s.rows * step_lora.width * pagedserve::lora::kMaxParts * step_lora.max_rank);
    Scratch scratch;  // int8 activations of block-quantized matrices and the products' split, shared by each team
    scratch.split.reset();
    for (int64_t layer = 0; layer < num_layers; ++layer)
        for (int column : {kQkv, kOProj, kGateUp, kDown}) {
            const Matrix m = matrix_at(weights + layer * kWeightColumns, column);
            if (m.format >= 0) scratch.reserve(s.rows, m.nbp);
        }
    const T* h = nullptr;
    for (int64_t layer = 0; layer < num_layers; ++layer) {
        const int64_t* row = weights + layer * kWeightColumns;
        auto w = [row](WeightColumn column) { return reinterpret_cast<const T*>(row[column]); };
        auto matrix = [row](WeightColumn column) { return matrix_at(row, column); };
        C* key_cache = reinterpret_cast<C*>(key_caches[layer]);
        C* value_cache = reinterpret_cast<C*>(value_caches[layer]);
        const LayerLoRA<T> lora = layer_lora<T>(step_lora, plan.get(), shrunk.data(), layer, s);
        const int64_t* own = layer_table != nullptr ? layer_table + layer * kLayerColumns : nullptr;
        const int32_t* tables = own ? reinterpret_cast<const int32_t*>(own[kTables]) : block_tables;
        const int32_t* lens = own ? reinterpret_cast<const int32_t*>(own[kLens]) : context_lens;
        const int64_t* layer_slots = own ? reinterpret_cast<const int64_t*>(own[kSlots]) : slots;
        const T* layer_cos = own ? reinterpret_cast<const T*>(own[kCos]) : cos;
        const T* layer_sin = own ? reinterpret_cast<const T*>(own[kSin]) : sin_signed;
        decode_qkv(h, residual, w(kInputNorm), matrix(kQkv), w(kQkvBias), w(kQNorm), w(kKNorm), s.qk_norm_projection,
                   positions, layer_cos, layer_sin, key_cache, value_cache, layer_slots, query.data(), s.rows, s.hidden,
                   s.heads, s.kv_heads, s.head_dim, s.rotary_dim, s.eps, scratch, lora);
        paged_decode(query.data(), key_cache, value_cache, tables, lens, attn.data(), s.rows, s.heads, s.kv_heads,
                     s.head_dim, s.block_size, own ? own[kWidth] : s.table_width, s.scale, own ? own[kWindow] : 0,
                     s.softcap);
        decode_o_mlp(attn.data(), residual, matrix(kOProj), w(kOBias), w(kAttnPostNorm), w(kPostNorm),
                     matrix(kGateUp), w(kGateUpBias), matrix(kDown), w(kDownBias), w(kMlpPostNorm), out, s.rows,
                     s.hidden, s.heads * s.head_dim, s.inter, s.gelu, s.eps, s.residual_scale, scratch, lora);
        h = out;
    }
    for (int64_t i = 0; i < s.rows * s.hidden; ++i) store(residual + i, to_float(residual[i]) + to_float(out[i]));
}

}  // namespace

#define PAGEDSERVE_DECODE_LAYERS(SUFFIX, T, C)                                                                    \
    void pagedserve_decode_layers_##SUFFIX(T* residual, const int64_t* weights, const int64_t* key_caches,       \
                                           const int64_t* value_caches, const int64_t* positions, const T* cos,  \
                                           const T* sin_signed, const int64_t* slots, const int32_t* block_tables,\
                                           const int32_t* context_lens, T* out, const int64_t* lora_table,      \
                                           const int32_t* lora_slots, const float* lora_scales,                  \
                                           const int32_t* lora_ranks, const int64_t* layer_table,                \
                                           int64_t num_layers, int64_t rows, int64_t hidden, int64_t heads,      \
                                           int64_t kv_heads, int64_t head_dim, int64_t rotary_dim, int64_t inter,\
                                           int64_t block_size, int64_t table_width, int64_t lora_width,          \
                                           int64_t lora_max_rank,                                                \
                                           int64_t max_loras, int64_t qk_norm_projection, int64_t gelu,          \
                                           float eps, float scale, float residual_scale, float softcap) {        \
        const DecodeShape shape{rows, hidden, heads, kv_heads, head_dim, rotary_dim, inter, block_size,          \
                                table_width, qk_norm_projection != 0, gelu != 0, eps, scale, residual_scale,    \
                                softcap};                                                                        \
        const StepLoRA lora{lora_table, lora_slots, lora_scales, lora_ranks, lora_width, lora_max_rank, max_loras}; \
        decode_layers<T, C>(residual, weights, key_caches, value_caches, positions, cos, sin_signed, slots,       \
                            block_tables, context_lens, out, num_layers, layer_table, shape, lora);             \
    }

extern "C" {
PAGEDSERVE_DECODE_LAYERS(f32, float, float)
PAGEDSERVE_DECODE_LAYERS(bf16, uint16_t, uint16_t)
PAGEDSERVE_DECODE_LAYERS(f32_fp8, float, pagedserve::Fp8E4M3)  // an fp8 cache (--kv-cache-dtype fp8)
PAGEDSERVE_DECODE_LAYERS(bf16_fp8, uint16_t, pagedserve::Fp8E4M3)
}

