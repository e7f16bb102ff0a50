// Causal attention of a float32 prompt chunk over its sequence's paged K/V cache (the cached prefix and the
// chunk's own keys, written to the cache before the call), on AVX-512 or AVX2 with FMA: the float32 sibling of
// prefill_attention.cpp, for the CPUs and models that run in float32 (`dtype auto` without native bf16, or
// `--dtype float32`), where torch's CPU flash kernel spends a third of its time outside its products. The cache
// holds float32, or bf16 or fp8 e4m3 (`--kv-cache-dtype bfloat16 / fp8` under a float32 model: the `_bf16` and
// `_fp8` entry points), which torch's path would gather and widen whole before every chunk.
//
// Layouts (row-major, contiguous):
//   query        [query_len, heads, head_dim] float32; query i sits at position offset + i, offset = context_len -
//                query_len, and sees keys [0, offset + i]
//   key_cache    [num_blocks, block_size, kv_heads, head_dim] float32, bf16 or fp8 (value_cache alike), the
//                sequence's tokens at block_table[t / block_size], row t % block_size
//   out          [query_len, heads, head_dim] float32
//
// Work items: (kv head, tile of kQTile query positions), taken in prefill_items.h's order; the next key tile's
// rows are prefetched while a tile runs. An item's rows are its positions x the kv head's GQA group of query
// heads, and a vector holds W rows (16 on AVX-512, 8 on AVX2), not W keys: the query is transposed once per item
// (qt[d] holds dim d of every row), so that
//   a score vector is D FMAs of qt[d] with key j's dim d broadcast, read in place from the cache;
//   the online softmax runs lane-wise, one row per lane: the running max, the correction and the sums are
//   vectors, no horizontal reductions;
//   P.V accumulates into the transposed output ot[d] (every row's dim d) with value j's dim d broadcast: a
//   float32 cache's K and V rows are read as they lie, never packed or transposed; a bf16 or fp8 cache's are
//   widened exactly to float32 into the thread's scratch once per key tile (a kv head's rows of 64 or 128
//   values), for every row block of the item to read.
// Per tile of kKTile keys each block of kRowVecs vectors of rows takes its scores (kKeys keys at a time, their
// accumulators in registers), its softmax, then P.V (kDims dims at a time). Every sum runs over the keys in
// ascending order, in float32: the result does not depend on the thread count. Built and loaded by
// engine/kernels/cpu.py; engine/attention/cpu_backend.py calls it for float32 chunks without windows, soft-caps
// or sinks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGEDSERVE_PREFILL_F32 1
#include <immintrin.h>

#include "exp16.h"
#include "fp8.h"
#include "prefill_items.h"

namespace {

#if defined(__AVX512F__)
// 16 float32 lanes and 32 registers: 8 keys (scores) or 8 dims (P.V) by 2 row vectors in registers.
struct Lanes {
    using V = __m512;
    static constexpr int W = 16, kRowVecs = 2, kKeys = 8, kDims = 8;
    static V load(const float* p) { return _mm512_load_ps(p); }
    static void store(float* p, V v) { _mm512_store_ps(p, v); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    static V zero() { return _mm512_setzero_ps(); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V exp(V x) { return pagedserve::exp16(x); }
    // key <= limit ? a : b, lane-wise (the key and limits are whole numbers below 2^24: exact as floats)
    static V visible(V key, V limit, V a, V b) {
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key, limit, _CMP_LE_OQ), b, a);
    }
    static bool any_greater(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
};
#else
// 8 float32 lanes and 16 registers: 4 keys or 4 dims by 3 row vectors (12 accumulators, the chains two FMA
// pipes of 4-5 cycles' latency need, the row vectors and a broadcast).
struct Lanes {
    using V = __m256;
    static constexpr int W = 8, kRowVecs = 3, kKeys = 4, kDims = 4;
    static V load(const float* p) { return _mm256_load_ps(p); }
    static void store(float* p, V v) { _mm256_store_ps(p, v); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    static V zero() { return _mm256_setzero_ps(); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V exp(V x) { return pagedserve::exp8(x); }
    static V visible(V key, V limit, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(key, limit, _CMP_LE_OQ)); }
    static bool any_greater(V a, V b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
};
#endif

using V = Lanes::V;
constexpr int W = Lanes::W;
constexpr int kRowVecs = Lanes::kRowVecs;  // row vectors per block
constexpr int kBlockRows = kRowVecs * W;   // rows per block
constexpr int64_t kQTile = kBlockRows;     // query positions per work item: its rows (x group) fill whole blocks
// keys per tile: 32, except on AVX-512 at head_dim 128, where a block's queries and 32 keys take 16 KB each and
// spill out of a 32 KB L1 (AVX2's 24-row blocks are smaller, and lose more to a tile's softmax than they gain)
template <int D>
constexpr int kKTile = D <= 64 || Lanes::W == 8 ? 32 : 16;
static_assert(kKTile<128> % Lanes::kKeys == 0, "a tile is whole score passes");

// A thread's buffers for one work item, rows padded to whole blocks.
template <int D>
struct Scratch {
    int64_t stride;                     // padded rows: a row-major [D][stride] layout for qt and ot
    std::vector<float> buffer;
    float* qt;                          // [D][stride] the queries, transposed (padding rows 0)
    float* ot;                          // [D][stride] the P.V sums, transposed
    float* m;                           // [stride] running max
    float* l;                           // [stride] running sum of the probabilities
    float* limit;                       // [stride] each row's last visible key
    float* s;                           // [kKTile<D>][kBlockRows] a block's scores, then probabilities
    float* keys;                        // [kKTile<D>][D] a bf16 or fp8 cache's key tile, widened
    float* values;                      // [kKTile<D>][D] its values
    explicit Scratch(int64_t rows)
        : stride((rows + kBlockRows - 1) / kBlockRows * kBlockRows),
          buffer((2 * D + 3) * stride + kKTile<D> * (kBlockRows + 2 * D) + 16) {
        float* base = buffer.data();
        base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64 / sizeof(float);  // 64-byte aligned
        qt = base;
        ot = qt + D * stride;
        m = ot + D * stride;
        l = m + stride;
        limit = l + stride;
        s = limit + stride;
        keys = s + kKTile<D> * kBlockRows;
        values = keys + kKTile<D> * D;
    }
};

// One cached K or V row of a kv head (D values) as float32, exactly: bf16's bits moved up, fp8 by fp8.h's
// conversions (AVX512BW) or common.h's scalar one.
template <int D>
void widen_row(const uint16_t* src, float* dst) {
#if defined(__AVX512F__)
    for (int i = 0; i < D; i += 16) {
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
        _mm512_store_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(words, 16)));
    }
#else
    for (int i = 0; i < D; i += 8) {
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
        _mm256_store_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
    }
#endif
}

template <int D>
void widen_row(const pagedserve::Fp8E4M3* src, float* dst) {
#if defined(__AVX512BW__)
    for (int i = 0; i < D; i += 16) _mm512_store_ps(dst + i, pagedserve::fp8::f32_from_fp8(src + i));
#else
    for (int i = 0; i < D; ++i) dst[i] = pagedserve::to_float(src[i]);
#endif
}

// Scores of the block's rows (from row `base`) against keys[0, count), scaled, into s[j][*] (count a multiple of
// kKeys: keys past the block's visible ones are scored and never read).
template <int D>
void block_scores(const Scratch<D>& sc, int64_t base, const float* const* keys, int count, float scale) {
    constexpr int K = Lanes::kKeys;
    const V factor = Lanes::set1(scale);
    for (int j0 = 0; j0 < count; j0 += K) {
        V acc[K][kRowVecs];
        for (int k = 0; k < K; ++k)
            for (int v = 0; v < kRowVecs; ++v) acc[k][v] = Lanes::zero();
        for (int d = 0; d < D; ++d) {
            V q[kRowVecs];
            for (int v = 0; v < kRowVecs; ++v) q[v] = Lanes::load(sc.qt + d * sc.stride + base + v * W);
            for (int k = 0; k < K; ++k) {
                const V key = Lanes::set1(keys[j0 + k][d]);
                for (int v = 0; v < kRowVecs; ++v) acc[k][v] = Lanes::fmadd(q[v], key, acc[k][v]);
            }
        }
        for (int k = 0; k < K; ++k)
            for (int v = 0; v < kRowVecs; ++v)
                Lanes::store(sc.s + (j0 + k) * kBlockRows + v * W, Lanes::mul(acc[k][v], factor));
    }
}

// The online softmax of the block's rows over the tile's first `count` keys (from key index t0): m, l and ot
// rescaled where the max moves, s[j] replaced by the probabilities (0 where a key is past a row's limit when
// `masked`).
template <int D>
void block_softmax(Scratch<D>& sc, int64_t base, int count, int64_t t0, bool masked) {
    const V minus_infinity = Lanes::set1(-INFINITY);
    for (int v = 0; v < kRowVecs; ++v) {
        const int64_t at = base + v * W;
        const V limit = Lanes::load(sc.limit + at), old_max = Lanes::load(sc.m + at);
        V new_max = old_max;
        for (int j = 0; j < count; ++j) {
            float* row = sc.s + j * kBlockRows + v * W;
            V score = Lanes::load(row);
            if (masked) {
                score = Lanes::visible(Lanes::set1(static_cast<float>(t0 + j)), limit, score, minus_infinity);
                Lanes::store(row, score);
            }
            new_max = Lanes::max(new_max, score);
        }
        V sum = Lanes::load(sc.l + at);
        // a maximum still -inf (every score so far -inf) shifts by 0: -inf - -inf would be NaN
        const V shift = Lanes::visible(new_max, minus_infinity, Lanes::zero(), new_max);
        if (Lanes::any_greater(new_max, old_max)) {  // the first tiles, mostly; exp(0) is exactly 1
            const V correction = Lanes::exp(Lanes::sub(old_max, shift));  // m = -inf at first: ~0, all is 0
            sum = Lanes::mul(sum, correction);
            for (int d = 0; d < D; ++d) {
                float* o = sc.ot + d * sc.stride + at;
                Lanes::store(o, Lanes::mul(Lanes::load(o), correction));
            }
            Lanes::store(sc.m + at, new_max);
        }
        for (int j = 0; j < count; ++j) {
            float* row = sc.s + j * kBlockRows + v * W;
            V p = Lanes::exp(Lanes::sub(Lanes::load(row), shift));
            if (masked) p = Lanes::visible(Lanes::set1(static_cast<float>(t0 + j)), limit, p, Lanes::zero());
            sum = Lanes::add(sum, p);
            Lanes::store(row, p);
        }
        Lanes::store(sc.l + at, sum);
    }
}

// ot[d] += sum_j s[j] value_j[d] for the block's rows, keys [0, count) in order.
template <int D>
void block_values(Scratch<D>& sc, int64_t base, const float* const* values, int count) {
    constexpr int C = Lanes::kDims;
    static_assert(D % C == 0, "whole passes of dims");
    for (int d0 = 0; d0 < D; d0 += C) {
        V acc[C][kRowVecs];
        for (int c = 0; c < C; ++c)
            for (int v = 0; v < kRowVecs; ++v) acc[c][v] = Lanes::load(sc.ot + (d0 + c) * sc.stride + base + v * W);
        for (int j = 0; j < count; ++j) {
            V p[kRowVecs];
            for (int v = 0; v < kRowVecs; ++v) p[v] = Lanes::load(sc.s + j * kBlockRows + v * W);
            for (int c = 0; c < C; ++c) {
                const V value = Lanes::set1(values[j][d0 + c]);
                for (int v = 0; v < kRowVecs; ++v) acc[c][v] = Lanes::fmadd(p[v], value, acc[c][v]);
            }
        }
        for (int c = 0; c < C; ++c)
            for (int v = 0; v < kRowVecs; ++v) Lanes::store(sc.ot + (d0 + c) * sc.stride + base + v * W, acc[c][v]);
    }
}

template <typename C, int D>
void attend_item(const float* query, const C* key_cache, const C* value_cache, const int32_t* table, float* out,
                 int64_t q0, int64_t q1, int64_t offset, int64_t heads, int64_t kv_heads, int64_t kv,
                 int64_t block_size, float scale, Scratch<D>& sc) {
    const int64_t group = heads / kv_heads, rows = (q1 - q0) * group, token_size = kv_heads * D;
    // row r: position q0 + r / group, head kv * group + r % group; padding rows: zero queries that see what the
    // last row sees (never written out)
    auto query_row = [&](int64_t r) { return query + ((q0 + r / group) * heads + kv * group + r % group) * D; };
    // only the blocks that hold rows: a chunk's short last tile, or a chunk of a few tokens, leaves the rest idle
    const int64_t used = (rows + kBlockRows - 1) / kBlockRows * kBlockRows;
    for (int64_t r = 0; r < used; ++r) {
        const float* q = r < rows ? query_row(r) : nullptr;
        for (int d = 0; d < D; ++d) sc.qt[d * sc.stride + r] = q ? q[d] : 0.0f;
        sc.limit[r] = static_cast<float>(offset + q0 + std::min(r, rows - 1) / group);
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.0f;
    }
    for (int d = 0; d < D; ++d) std::fill(sc.ot + d * sc.stride, sc.ot + d * sc.stride + used, 0.0f);
    const int64_t keys = offset + q1;  // the last row sees keys [0, keys)
    constexpr int tile = kKTile<D>;
    const float* key_rows[tile];
    const float* value_rows[tile];
    for (int64_t t0 = 0; t0 < keys; t0 += tile) {
        const int n = static_cast<int>(std::min<int64_t>(tile, keys - t0));
        for (int j = 0; j < tile; ++j) {  // past n: the tile's last key again (scored, never read)
            if constexpr (std::is_same_v<C, float>) {
                const int64_t t = t0 + std::min(j, n - 1);
                const int64_t at = (table[t / block_size] * block_size + t % block_size) * token_size + kv * D;
                key_rows[j] = key_cache + at;
                value_rows[j] = value_cache + at;
            } else {
                if (j < n) {
                    const int64_t t = t0 + j;
                    const int64_t at = (table[t / block_size] * block_size + t % block_size) * token_size + kv * D;
                    widen_row<D>(key_cache + at, sc.keys + j * D);
                    widen_row<D>(value_cache + at, sc.values + j * D);
                }
                key_rows[j] = sc.keys + std::min(j, n - 1) * D;
                value_rows[j] = sc.values + std::min(j, n - 1) * D;
            }
        }
        pagedserve::prefill::prefetch_rows(key_cache, value_cache, table, block_size, token_size, kv * D, D,
                                           t0 + tile, std::min<int64_t>(keys, t0 + 2 * tile));  // the next tile
        for (int64_t base = 0; base < used; base += kBlockRows) {
            // rows ascend in position: the block's first row sees the fewest keys, its last the most
            const int64_t first = static_cast<int64_t>(sc.limit[base]);
            const int64_t last = static_cast<int64_t>(sc.limit[base + kBlockRows - 1]);
            if (last < t0) continue;  // none of this tile (the first blocks of the item's last tiles)
            const int count = static_cast<int>(std::min<int64_t>(n, last - t0 + 1));
            const int scored = (count + Lanes::kKeys - 1) / Lanes::kKeys * Lanes::kKeys;
            block_scores<D>(sc, base, key_rows, scored, scale);
            block_softmax<D>(sc, base, count, t0, first < t0 + count - 1);
            block_values<D>(sc, base, value_rows, count);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float inverse = sc.m[r] == -INFINITY ? NAN : 1.0f / sc.l[r];  // every score -inf: NaN, as torch's
        float* dst = out + ((q0 + r / group) * heads + kv * group + r % group) * D;
        for (int d = 0; d < D; ++d) dst[d] = sc.ot[d * sc.stride + r] * inverse;
    }
}

template <typename C, int D>
void prefill_attention(const float* query, const C* key_cache, const C* value_cache, const int32_t* table,
                       float* out, int64_t query_len, int64_t context_len, int64_t heads, int64_t kv_heads,
                       int64_t block_size, float scale) {
    const int64_t offset = context_len - query_len;
    pagedserve::prefill::for_each_item<Scratch<D>>(
        query_len, kv_heads, kQTile, kQTile * (heads / kv_heads),
        [&](int64_t q0, int64_t q1, int64_t kv, Scratch<D>& sc) {
            attend_item<C, D>(query, key_cache, value_cache, table, out, q0, q1, offset, heads, kv_heads, kv,
                              block_size, scale, sc);
        });
}

// Returns 0 when head_dim is not one it is built for (64, 128), else computes `out` and returns 1.
template <typename C>
int64_t prefill_attention_of(const float* query, const C* key_cache, const C* value_cache, const int32_t* table,
                             float* out, int64_t query_len, int64_t context_len, int64_t heads, int64_t kv_heads,
                             int64_t head_dim, int64_t block_size, float scale) {
    return pagedserve::prefill::with_head_dim(head_dim, [&](auto d) {
        prefill_attention<C, decltype(d)::value>(query, key_cache, value_cache, table, out, query_len, context_len,
                                                 heads, kv_heads, block_size, scale);
    });
}

}  // namespace
#endif

extern "C" {
// 1 when this build has the kernel (AVX-512, or AVX2 with FMA), 0 otherwise (the caller keeps torch's attention).
int64_t pagedserve_prefill_attention_f32_native() {
#if defined(PAGEDSERVE_PREFILL_F32)
    return 1;
#else
    return 0;
#endif
}

// Returns 0 when this build has no kernel or head_dim is not one it is built for (64, 128), else computes `out`
// and returns 1. The same arguments as pagedserve_prefill_attention_bf16, in float32; the cache in float32
// (`_f32`), bf16 (`_f32_bf16`) or fp8 e4m3 (`_f32_fp8`).
#if defined(PAGEDSERVE_PREFILL_F32)
#define PAGEDSERVE_PREFILL_ATTENTION_F32(SUFFIX, C)                                                              \
    int64_t pagedserve_prefill_attention_##SUFFIX(const float* query, const C* key_cache, const C* value_cache,   \
                                                  const int32_t* block_table, float* out, int64_t query_len,      \
                                                  int64_t context_len, int64_t heads, int64_t kv_heads,           \
                                                  int64_t head_dim, int64_t block_size, float scale) {            \
        return prefill_attention_of<C>(query, key_cache, value_cache, block_table, out, query_len, context_len,   \
                                       heads, kv_heads, head_dim, block_size, scale);                             \
    }
#else
#define PAGEDSERVE_PREFILL_ATTENTION_F32(SUFFIX, C)                                                              \
    int64_t pagedserve_prefill_attention_##SUFFIX(const float*, const C*, const C*, const int32_t*, float*,       \
                                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {  \
        return 0;                                                                                                 \
    }
#endif
PAGEDSERVE_PREFILL_ATTENTION_F32(f32, float)
PAGEDSERVE_PREFILL_ATTENTION_F32(f32_bf16, uint16_t)
PAGEDSERVE_PREFILL_ATTENTION_F32(f32_fp8, pagedserve::Fp8E4M3)  // --kv-cache-dtype fp8 under a float32 model
#undef PAGEDSERVE_PREFILL_ATTENTION_F32
}
