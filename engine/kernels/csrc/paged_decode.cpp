// Paged decode attention for CPUs: one query token per sequence, attending to
// every cached token of its sequence, with K/V read in place from the block
// cache (no gather into a padded copy, no mask).
//
// Layouts (row-major, contiguous):
//   query        [num_seqs, num_heads, head_dim]
//   key_cache    [num_blocks, block_size, num_kv_heads, head_dim]   (value_cache alike): the query's dtype, or
//                float8 e4m3 (--kv-cache-dtype fp8, the `_fp8` entry points) widened exactly to the query's
//                dtype as each row is read (AVX512BW builds with VBMI by byte-table lookups, without it by
//                arithmetic; the portable loops through to_float)
//   block_tables [num_seqs, table_width] int32
//   context_lens [num_seqs] int32, each >= 1
//   out          [num_seqs, num_heads, head_dim]
//   window       > 0: a sliding window, the query (at position len - 1) sees the last `window` tokens only
//                (positions >= len - window, as HF's `kv_idx > q_idx - sliding_window`); 0: every token
//   softcap      > 0: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2); 0: none
//   sinks        [num_heads] float32: a logit per query head that joins the softmax's denominator and has no
//                value (GPT-OSS); null: none. With the running max m and sum l of a head, out = acc / l becomes
//                acc * e^(m - M) / (l * e^(m - M) + e^(sink - M)), M = max(m, sink): no exponent overflows.
//
// AVX-512 builds (head_dim 64, 128 or 256; float32 or bfloat16), paged_decode_simd:
//   work items    (sequence, kv head, pass): a pass takes up to 4 query heads of the kv head's GQA group
//                 (larger groups take several passes), spread over the threads dynamically, so a single
//                 sequence (the latency-critical case) still uses every thread. With fewer than 2 items
//                 per thread, long sequences are split into parts of 256+ tokens, merged at the end
//                 (`split` = 0 turns this off: how a row's sums are grouped then depends on the row alone,
//                 as batch-invariant mode needs, not on its neighbours or the thread count).
//   chunks of 16  keys of the sequence (they may span blocks or end part-way, the rest masked out): per
//                 query head, 16 dot products (bf16: vdpbf16ps, exact products and float32 sums; without
//                 AVX512_BF16 both widened to float32; float32: FMA; each K row read once for the pass's
//                 heads) summed by a transpose-and-add tree into one vector of 16 scores; the online
//                 softmax on that vector (a 16-lane exponential: exp16_bf16 where P is rounded to bf16
//                 below, else exp16; the running max and sums rescaled only when a score exceeds the
//                 max, the sums kept per lane); then P.V into the float32
//                 accumulators of the pass's heads, held in registers: with AVX512_BF16, two keys' V rows
//                 interleaved and multiplied by their pair of probabilities (rounded to bf16, as the prefill
//                 kernel and torch's flash kernel round P) in one vdpbf16ps (VPairs); otherwise each V row
//                 widened once (bf16: even / odd elements by shift / mask) and FMA'd. The accumulators
//                 keep that order until the output is stored.
//   prefetch      the next chunk's K and V rows into L2: the blocks are scattered, and demand misses one
//                 chunk at a time left the kernel waiting on DRAM (16 sequences x 150 tokens, the caches
//                 of 30 layers in turn: 160 -> 90 us).
// Other head_dims, and builds without AVX-512 (AVX2, plain x86-64), take the portable loops below: each
// sequence one work item (with fewer than 2 sequences per thread, and `split`, long ones cut into parts of
// whole blocks, merged at the end as above), each token's K/V row (all kv heads) converted to float once and
// scored against every query head with `omp simd` dot products; AVX2 builds with head_dim 64, 128 or 256 take
// chunks of whole blocks (128+ tokens) instead, token by token in address order (attend_chunk_avx2).
//
// Measured (bf16, SmolLM2-135M: 9 query heads, 3 kv heads, head_dim 64, blocks of 16; 2 threads of an
// AVX512-BF16 EPYC shared with other work, best of 3 runs; the caches of 30 layers in turn, as in a
// decode step; through the Python op, whose own cost is ~11 us; before = the portable loops):
//   16 sequences x 150 tokens   234 -> 86 us       64 x 150   929 -> 365 us
//   1 x 200                      34.5 -> 17.1 us    1 x 2000   360 -> 74 us
// Threads come from the OpenMP runtime torch has already loaded (same soname, so one thread pool).
// Built and loaded by engine/kernels/cpu.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common.h"
#include "exp16.h"
#include "fp8.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedserve::fast_exp;
using pagedserve::store;
using pagedserve::to_float;

// The factor that normalizes a head's accumulated sums: 1 / l without a sink, else with its sink in the
// denominator (see the header).
inline float normalizer(float running_max, float running_sum, const float* sink) {
    // every score -inf: NaN, as torch's softmax gives (the sums hold e^-87 weights, exp16's floor, not 0s)
    if (sink == nullptr) return running_max == -INFINITY ? NAN : 1.0f / running_sum;
    const float top = std::max(running_max, *sink);
    const float factor = std::exp(running_max - top);
    return factor / (running_sum * factor + std::exp(*sink - top));
}

constexpr int64_t kParallelMinWork = 1024;  // cached tokens x query heads: below, one thread (AVX-512
                                            // path: the team and one thread tie at 1 x 100 x 9 heads)

// Loads `count` bf16/fp8/f32 values as floats into `dst`; float rows are used in place instead.
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

constexpr int64_t kPortableSplitTokens = 256;  // the least tokens per part when the portable loops split
// ... and when fewer sequences than threads leave a thread without one: a short part costs its stream start and
// merge, an idle thread all of its share (docs/performance.md, "Short contexts on every thread")
constexpr int64_t kIdleSplitTokens = 64;
constexpr int64_t kPortablePartsPerThread = 2;  // fewer sequences than this per thread split the long ones

// The largest of x[0..n), n >= 1 (a serial chain of scalar maxes was a third of the softmax's time on AVX2).
inline float max_of(const float* x, int64_t n) {
    int64_t i = 0;
    float top = x[0];
#if defined(__AVX2__) || defined(__AVX512F__)
    if (n >= 8) {
        __m256 tops = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(x + i));
        const __m128 four = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
        const __m128 two = _mm_max_ps(four, _mm_movehl_ps(four, four));
        top = _mm_cvtss_f32(_mm_max_ss(two, _mm_movehdup_ps(two)));
    }
#endif
    for (; i < n; ++i) top = std::max(top, x[i]);
    return top;
}

// The online softmax over one block's scores s[h][j0..n) (in place, into probabilities): the running max and sum
// of each head move on, and what was accumulated is rescaled when the maximum grows.
inline void online_softmax(float* s, int64_t j0, int64_t n, int64_t num_heads, int64_t head_dim, int64_t block_size,
                           float* acc, float* running_max, float* running_sum) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float* sh = s + h * block_size;
        const float block_max = max_of(sh + j0, n - j0);
        const float new_max = std::max(running_max[h], block_max);
        const float shift = new_max == -INFINITY ? 0.0f : new_max;  // every score so far -inf: not -inf - -inf
        const float correction = fast_exp(running_max[h] - shift);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = j0; j < n; ++j) {
            sh[j] = fast_exp(sh[j] - shift);
            sum += sh[j];
        }
        running_sum[h] = running_sum[h] * correction + sum;
        running_max[h] = new_max;
        if (correction != 1.0f) {
            float* a = acc + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
constexpr bool kAvx2Block = true;

// Eight vectors of partial sums -> one vector of their eight totals.
inline __m256 totals8(const __m256* v) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    // ab: the sums of v0..v3's lanes 0-3, then of their lanes 4-7; cd: v4..v7's
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float total(__m256 v) {
    const __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 y = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(y, _mm_movehdup_ps(y)));
}

constexpr int64_t kAvx2ChunkTokens = 128;  // tokens scored before one softmax update and their P.V

// The cache blocks of one chunk: enough whole blocks for kAvx2ChunkTokens (a larger block alone). An fp8 cache's
// rows are widened into a buffer first: a block at a time, so the buffer stays a block's.
template <typename C>
inline int64_t avx2_chunk_blocks(int64_t block_size) {
    constexpr bool in_place = std::is_same_v<C, float> || std::is_same_v<C, uint16_t>;
    return in_place ? std::max<int64_t>(1, kAvx2ChunkTokens / block_size) : 1;
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bf16: the upper halves of float32s
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Token i's products with the NH query heads q[0..NH) (HD apart) of one kv head, whose K row is `k`: a vector of
// eight partial sums per head into v[h * 8] (the heads' vectors of eight tokens, 8 apart).
template <int HD, int NH, typename E>
inline void products_of_token(const float* q, const E* k, __m256* v) {
    __m256 sums[NH];
    for (int h = 0; h < NH; ++h) sums[h] = _mm256_setzero_ps();
    for (int d = 0; d < HD; d += 8) {
        const __m256 kv = load8(k + d);
        for (int h = 0; h < NH; ++h) sums[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * HD + d), kv, sums[h]);
    }
    for (int h = 0; h < NH; ++h) v[h * 8] = sums[h];
}

// P.V of a chunk's m tokens for the NH heads of one kv head, from the cache (L2 after the scoring fetched it):
// acc[h] += sum_t p[h * stride + t] * V_t, DV vectors of each head's sums held in registers through every token
// (NH * DV <= 8: three heads of four vectors each spilled, and ran a bf16 cache 1.1x slower).
template <int HD, int NH, int DV, typename E>
inline void weigh_chunk(const float* p, int64_t stride, const E* const* v_rows, int64_t offset, int64_t m,
                        float* acc) {
    static_assert(HD % (8 * DV) == 0, "whole passes over a head");
    for (int d0 = 0; d0 < HD; d0 += 8 * DV) {
        __m256 sums[NH][DV];
        for (int h = 0; h < NH; ++h)
            for (int j = 0; j < DV; ++j) sums[h][j] = _mm256_loadu_ps(acc + h * HD + d0 + 8 * j);
        for (int64_t t = 0; t < m; ++t) {
            const E* row = v_rows[t] + offset + d0;
            __m256 vals[DV];
            for (int j = 0; j < DV; ++j) vals[j] = load8(row + 8 * j);
            for (int h = 0; h < NH; ++h) {
                const __m256 w = _mm256_set1_ps(p[h * stride + t]);
                for (int j = 0; j < DV; ++j) sums[h][j] = _mm256_fmadd_ps(w, vals[j], sums[h][j]);
            }
        }
        for (int h = 0; h < NH; ++h)
            for (int j = 0; j < DV; ++j) _mm256_storeu_ps(acc + h * HD + d0 + 8 * j, sums[h][j]);
    }
}

// A kv head's `group` query heads, in passes of up to four.
template <typename F4, typename F3, typename F2, typename F1>
inline void in_passes(int64_t group, F4&& four, F3&& three, F2&& two, F1&& one) {
    int64_t h = 0;
    for (; h + 4 <= group; h += 4) four(h);
    switch (group - h) {
        case 3: three(h); break;
        case 2: two(h); break;
        case 1: one(h); break;
        default: break;
    }
}

// A chunk's tokens [0, m) on AVX2, token i's K and V rows (all kv heads) at k_rows[i] and v_rows[i] (float or
// bf16, read in place). Memory is read token by token in address order, the only order the hardware prefetcher
// streams from DRAM here: reading eight tokens' rows head by head, or two rows side by side, was 1.2-1.6x slower
// from DRAM at the same speed from L3 (docs/performance.md, "The AVX2 decode step"). So each token's K row is
// scored as it comes (per head a vector of eight partial sums, reduced eight tokens at a time by one tree of
// horizontal adds), and its V row is prefetched beside it for P.V to find in L2 after the chunk's one
// online-softmax update (not one per block); P.V then runs kv head by kv head with a few of each head's sums in
// registers through every token. Prefetching rows ahead of the current token (K or V, 1-16 tokens) slowed it.
// s: the heads' scores, `stride` apart; vecs: num_heads * 8 vectors of scratch.
template <int HD, typename E>
void attend_chunk_avx2(const float* q, const E* const* k_rows, const E* const* v_rows, int64_t m,
                       int64_t num_heads, int64_t num_kv_heads, int64_t stride, float softcap, float* acc,
                       float* running_max, float* running_sum, float* s, __m256* vecs) {
    static_assert(HD % 64 == 0, "P.V takes 64 values at a time");
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_bytes = num_kv_heads * HD * static_cast<int64_t>(sizeof(E));
    for (int64_t i0 = 0; i0 < m; i0 += 8) {
        const int64_t count = std::min<int64_t>(8, m - i0);
        for (int64_t t = 0; t < count; ++t) {
            // the V row fetched beside the K row, in address order, for P.V to find in L2: a prefetch, not a
            // load, so that no instruction waits on it (loads held retirement there, 1.05-1.1x slower)
            const char* v_row = reinterpret_cast<const char*>(v_rows[i0 + t]);
            for (int64_t at = 0; at < row_bytes; at += 64) _mm_prefetch(v_row + at, _MM_HINT_T0);
            for (int64_t g = 0; g < num_kv_heads; ++g) {
                const E* k = k_rows[i0 + t] + g * HD;
                const float* qg = q + g * group * HD;
                __m256* v = vecs + g * group * 8 + t;
                in_passes(
                    group, [&](int64_t h) { products_of_token<HD, 4>(qg + h * HD, k, v + h * 8); },
                    [&](int64_t h) { products_of_token<HD, 3>(qg + h * HD, k, v + h * 8); },
                    [&](int64_t h) { products_of_token<HD, 2>(qg + h * HD, k, v + h * 8); },
                    [&](int64_t h) { products_of_token<HD, 1>(qg + h * HD, k, v + h * 8); });
            }
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            if (count == 8) {
                _mm256_storeu_ps(s + h * stride + i0, totals8(vecs + h * 8));
            } else {
                for (int64_t t = 0; t < count; ++t) s[h * stride + i0 + t] = total(vecs[h * 8 + t]);
            }
        }
    }
    if (softcap > 0.0f)
        for (int64_t h = 0; h < num_heads; ++h)
            for (int64_t t = 0; t < m; ++t) s[h * stride + t] = softcap * std::tanh(s[h * stride + t] / softcap);
    online_softmax(s, 0, m, num_heads, HD, stride, acc, running_max, running_sum);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
        const float* p = s + g * group * stride;
        float* a = acc + g * group * HD;
        in_passes(
            group, [&](int64_t h) { weigh_chunk<HD, 4, 2>(p + h * stride, stride, v_rows, g * HD, m, a + h * HD); },
            [&](int64_t h) { weigh_chunk<HD, 3, 2>(p + h * stride, stride, v_rows, g * HD, m, a + h * HD); },
            [&](int64_t h) { weigh_chunk<HD, 2, 4>(p + h * stride, stride, v_rows, g * HD, m, a + h * HD); },
            [&](int64_t h) { weigh_chunk<HD, 1, 8>(p + h * stride, stride, v_rows, g * HD, m, a + h * HD); });
    }
}
#else
constexpr bool kAvx2Block = false;
template <typename C>
inline int64_t avx2_chunk_blocks(int64_t) {
    return 1;
}
#endif

// One pass over tokens [begin, end) of a sequence's blocks with an online softmax (running max m, running
// sum l per head): K and V of each block are read once, scores live in a block-sized buffer (AVX2: a chunk's).
// (Measured: 1.6x faster than scoring all tokens first, then softmax, then a second pass for V; prefetching
// the next block explicitly made no measurable difference to these loops, and slowed the AVX2 chunks.)
// Leaves the unnormalized sums in acc.
// HD > 0: head_dim known at compile time (the inner loops unroll fully); HD == 0: any head_dim. C: the cache's
// element type (T's, or Fp8E4M3 under a float or bf16 query).
template <typename C, int HD>
void attend_range(const float* q, const C* key_cache, const C* value_cache, const int32_t* table, int64_t begin,
                  int64_t end, int64_t num_heads, const int64_t* kv_of, int64_t runtime_head_dim, int64_t token_size,
                  int64_t block_size, float softcap, float* acc, float* running_max, float* running_sum,
                  float* row, float* s, float* block_rows) {
    const int64_t head_dim = HD > 0 ? HD : runtime_head_dim;
    const int64_t block_stride = block_size * token_size;
    std::fill(acc, acc + num_heads * head_dim, 0.0f);
    std::fill(running_max, running_max + num_heads, -INFINITY);
    std::fill(running_sum, running_sum + num_heads, 0.0f);
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if constexpr (HD > 0 && HD % 64 == 0) {  // chunks of whole blocks (attend_chunk_avx2)
        constexpr bool in_place = std::is_same_v<C, float> || std::is_same_v<C, uint16_t>;
        using E = std::conditional_t<in_place, C, float>;  // the rows as the chunk kernel reads them
        const int64_t chunk_blocks = avx2_chunk_blocks<C>(block_size);
        const int64_t stride = chunk_blocks * block_size;  // the most tokens of a chunk: s's row stride
        std::vector<const E*> k_rows(stride), v_rows(stride);
        std::vector<__m256> vecs(num_heads * 8);
        for (int64_t b = begin / block_size; b * block_size < end; b += chunk_blocks) {
            int64_t m = 0;  // the chunk's tokens so far
            for (int64_t c = b; c < b + chunk_blocks && c * block_size < end; ++c) {
                const C* keys = key_cache + table[c] * block_stride;
                const C* values = value_cache + table[c] * block_stride;
                const int64_t n = std::min(block_size, end - c * block_size);
                const int64_t j0 = std::max<int64_t>(0, begin - c * block_size);  // tokens of the block in view
                if constexpr (in_place) {
                    for (int64_t j = j0; j < n; ++j, ++m) {
                        k_rows[m] = keys + j * token_size;
                        v_rows[m] = values + j * token_size;
                    }
                } else {  // a chunk of one block: its rows widened into block_rows
                    const int64_t count = (n - j0) * token_size;
                    as_floats(keys + j0 * token_size, block_rows, count);
                    as_floats(values + j0 * token_size, block_rows + block_stride, count);
                    for (int64_t j = 0; j < n - j0; ++j, ++m) {
                        k_rows[m] = block_rows + j * token_size;
                        v_rows[m] = block_rows + block_stride + j * token_size;
                    }
                }
            }
            attend_chunk_avx2<HD, E>(q, k_rows.data(), v_rows.data(), m, num_heads, token_size / HD, stride,
                                     softcap, acc, running_max, running_sum, s, vecs.data());
        }
        return;
    }
#endif
    for (int64_t b = begin / block_size; b * block_size < end; ++b) {
        const C* keys = key_cache + table[b] * block_stride;
        const C* values = value_cache + table[b] * block_stride;
        const int64_t n = std::min(block_size, end - b * block_size);
        const int64_t j0 = std::max<int64_t>(0, begin - b * block_size);  // tokens of the block in view

        // s[h][j] = q[h] . K[j][kv_head(h)]
        for (int64_t j = j0; j < n; ++j) {
            const float* k = as_floats(keys + j * token_size, row, token_size);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float* qh = q + h * head_dim;
                const float* kh = k + kv_of[h] * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kh[d];
                s[h * block_size + j] = softcap > 0.0f ? softcap * std::tanh(dot / softcap) : dot;
            }
        }

        online_softmax(s, j0, n, num_heads, head_dim, block_size, acc, running_max, running_sum);

        // acc[h] += sum_j p[h][j] V[j][kv_head(h)]
        for (int64_t j = j0; j < n; ++j) {
            const float* v = as_floats(values + j * token_size, row, token_size);
            for (int64_t h = 0; h < num_heads; ++h) {
                const float p = s[h * block_size + j];
                const float* vh = v + kv_of[h] * head_dim;
                float* a = acc + h * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) a[d] += p * vh[d];
            }
        }
    }
}

// The portable loops: a work item is a sequence, or with few sequences for the threads (and `split`) a part of
// a long one, whole blocks of at least kPortableSplitTokens (kIdleSplitTokens with fewer sequences than
// threads): before, one long sequence ran on one thread while the others waited (docs/performance.md, "The AVX2
// machine"). A part keeps its running max, sum and unnormalized sums; the parts are merged once all are done, in
// another order than one pass sums, so `split` is off in batch-invariant mode.
template <typename T, typename C, int HD>
void paged_decode(const T* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                  const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                  int64_t runtime_head_dim, int64_t block_size, int64_t table_width, float scale, bool split,
                  int64_t window, float softcap, const float* sinks) {
    const int64_t head_dim = HD > 0 ? HD : runtime_head_dim;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_size = num_kv_heads * head_dim;  // one token's K (or V) over all kv heads
    const int64_t query_size = num_heads * head_dim;
    const int64_t partial_size = num_heads * (2 + head_dim);  // per part: the heads' max, sum, then sums
    int64_t parts = 1;
#if defined(_OPENMP)
    const int64_t threads = omp_get_max_threads();
    if (split && threads > 1 && num_seqs > 0 && num_seqs < kPortablePartsPerThread * threads) {
        int64_t longest = 0;
        for (int64_t seq = 0; seq < num_seqs; ++seq) longest = std::max<int64_t>(longest, context_lens[seq]);
        if (window > 0) longest = std::min(longest, window);
        const int64_t least = num_seqs < threads ? kIdleSplitTokens : kPortableSplitTokens;
        const int64_t most = longest / std::max(least, block_size);  // parts of the longest, each `least` or more
        parts = std::max<int64_t>(1, std::min((kPortablePartsPerThread * threads + num_seqs - 1) / num_seqs, most));
        if (parts > 1 && num_seqs * parts % threads != 0) {  // a whole number of items per thread: more parts
            int64_t up = parts, down = parts;                   // while they stay long enough, else fewer (if
            while (num_seqs * up % threads != 0) ++up;          // any fewer split at all)
            while (down > 1 && num_seqs * down % threads != 0) --down;
            parts = up <= most ? up : down > 1 ? down : parts;
        }
    }
#endif
    std::vector<float> partials(parts > 1 ? num_seqs * parts * partial_size : 0);

#pragma omp parallel if (num_seqs > 1 || parts > 1)  // one sequence, unsplit: no team to wake
    {
        std::vector<float> q(query_size), acc(query_size), row(token_size);
        std::vector<float> running_max(num_heads), running_sum(num_heads);
        std::vector<float> scores(num_heads * avx2_chunk_blocks<C>(block_size) * block_size);
        // a block's K and V rows made float (AVX2 path, an fp8 cache; float and bf16 rows are read in place)
        constexpr bool widened = kAvx2Block && !std::is_same_v<C, float> && !std::is_same_v<C, uint16_t>;
        std::vector<float> block_rows(widened ? 2 * block_size * token_size : 0);
        std::vector<int64_t> kv_of(num_heads);  // each query head's kv head (no division in the loops)
        for (int64_t h = 0; h < num_heads; ++h) kv_of[h] = h / group;

#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < num_seqs * parts; ++index) {
            const int64_t seq = index / parts, part = index % parts;
            const int64_t len = context_lens[seq];
            const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the first visible token
            // the part's whole blocks of the visible ones (a short sequence's may be empty)
            const int64_t first_block = first / block_size, blocks = (len + block_size - 1) / block_size - first_block;
            const int64_t begin = std::max(first, (first_block + blocks * part / parts) * block_size);
            const int64_t end = std::min(len, (first_block + blocks * (part + 1) / parts) * block_size);
            const T* q_src = query + seq * query_size;
            for (int64_t i = 0; i < query_size; ++i) q[i] = to_float(q_src[i]) * scale;
            attend_range<C, HD>(q.data(), key_cache, value_cache, block_tables + seq * table_width, begin, end,
                                num_heads, kv_of.data(), head_dim, token_size, block_size, softcap, acc.data(),
                                running_max.data(), running_sum.data(), row.data(), scores.data(), block_rows.data());
            if (parts > 1) {
                float* dst = partials.data() + index * partial_size;
                std::copy(running_max.begin(), running_max.end(), dst);
                std::copy(running_sum.begin(), running_sum.end(), dst + num_heads);
                std::copy(acc.begin(), acc.end(), dst + 2 * num_heads);
                continue;
            }
            T* dst = out + seq * query_size;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float inv = normalizer(running_max[h], running_sum[h], sinks ? sinks + h : nullptr);
                for (int64_t d = 0; d < head_dim; ++d) store(dst + h * head_dim + d, acc[h * head_dim + d] * inv);
            }
        }
        if (parts > 1) {
#pragma omp for schedule(static)
            for (int64_t index = 0; index < num_seqs * num_heads; ++index) {
                const int64_t seq = index / num_heads, h = index % num_heads;
                auto part_of = [&](int64_t part) { return partials.data() + (seq * parts + part) * partial_size; };
                float max = -INFINITY;  // an empty part: -inf, sum 0
                for (int64_t part = 0; part < parts; ++part) max = std::max(max, part_of(part)[h]);
                if (sinks != nullptr) max = std::max(max, sinks[h]);  // the sink: a part of no value
                float* a = acc.data();
                std::fill(a, a + head_dim, 0.0f);
                float sum = 0.0f;
                for (int64_t part = 0; part < parts; ++part) {
                    const float* p = part_of(part);
                    if (p[num_heads + h] == 0.0f) continue;
                    const float weight = fast_exp(p[h] - max);
                    sum += weight * p[num_heads + h];
                    const float* sums = p + 2 * num_heads + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * sums[d];
                }
                if (sinks != nullptr) sum += std::exp(sinks[h] - max);
                T* dst = out + seq * query_size + h * head_dim;
                const float inv = 1.0f / sum;
                for (int64_t d = 0; d < head_dim; ++d) store(dst + d, a[d] * inv);
            }
        }
    }
}

#if defined(__AVX512F__)
// ------------------------------------------------------------------------------------- AVX-512 path

constexpr int kChunk = 16;    // keys scored together: one vector of 16 scores per head
constexpr int kMaxPass = 4;   // query heads of a GQA group per pass over their kv head's K/V
constexpr int kPrefetchChunks = 1;  // K/V prefetched this many chunks ahead (2 measured no better)
constexpr int kMaxAccs = 16;  // float32 accumulator vectors held in registers by the P.V loop
constexpr int64_t kMinSplitTokens = 256;  // tokens per part when few items split their sequences
constexpr int64_t kSplitItemsPerThread = 2;  // fewer items per thread split long sequences; each item costs a
                                             // stream start (4 per thread: 1 x 4,149 tokens 2% slower)
constexpr int64_t kPartialHeader = 16;     // floats before a part's sums: running max, running sum
constexpr int64_t kPartialSize = kPartialHeader + 256;  // floats per head of a part (head_dim <= 256)

using pagedserve::exp16;
using pagedserve::exp16_bf16;

// softcap * tanh(x / softcap) on 16 lanes, tanh(y) = 1 - 2 / (exp(2y) + 1): exp16's clamp keeps it in [-1, 1].
inline __m512 softcap16(__m512 x, float softcap) {
    const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / softcap)));
    const __m512 tanh = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                      _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(tanh, _mm512_set1_ps(softcap));
}

// Slot s of a chunk's 16 dot products holds key kSlotKey[s], so that score16 returns key l's score in lane l.
constexpr int kSlotKey[kChunk] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Partial sums (16 lanes) of q . k over HD elements, float32 accumulation.
template <int HD>
inline __m512 row_dot(const float* k, const float* q) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(k), _mm512_loadu_ps(q));
    for (int u = 16; u < HD; u += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(k + u), _mm512_loadu_ps(q + u), acc);
    return acc;
}

// acc + the products of 32 bf16 pairs (k and q words), float32 sums.
inline __m512 dot_words(__m512 acc, __m512i kv, __m512i qv) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)kv, (__m512bh)qv);  // exact products, float32 sums
#else
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(kv, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(qv, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(kv, high)),
                           _mm512_castsi512_ps(_mm512_and_si512(qv, high)), acc);
#endif
}

template <int HD>
inline __m512 row_dot(const uint16_t* k, const uint16_t* q) {
    __m512 acc = _mm512_setzero_ps();
    for (int u = 0; u < HD; u += 32) acc = dot_words(acc, _mm512_loadu_si512(k + u), _mm512_loadu_si512(q + u));
    return acc;
}

using pagedserve::Fp8E4M3;
using pagedserve::fp8::kFp8Simd;

// A K row as score16's dot products read it: a float or bf16 row from memory, once per head of the pass (the
// loads after the first hit L1); an fp8 row widened once, for every head.
template <typename T, typename C, int HD>
struct KRow {
    const C* row;
    explicit KRow(const C* k) : row(k) {}
    __m512 dot(const T* q) const { return row_dot<HD>(row, q); }
};

#if defined(__AVX512BW__)
template <int HD>
struct KRow<uint16_t, Fp8E4M3, HD> {
    __m512i words[HD / 32];
    explicit KRow(const Fp8E4M3* k) {
#if defined(__AVX512VBMI__)
        for (int u = 0; u < HD / 64; ++u)
            pagedserve::fp8::bf16_from_fp8_codes(_mm512_loadu_si512(k + 64 * u), words[2 * u], words[2 * u + 1]);
#else
        for (int u = 0; u < HD / 32; ++u) words[u] = pagedserve::fp8::bf16_from_fp8(k + 32 * u);
#endif
    }
    __m512 dot(const uint16_t* q) const {
        __m512 acc = _mm512_setzero_ps();
        for (int u = 0; u < HD / 32; ++u) acc = dot_words(acc, words[u], _mm512_loadu_si512(q + 32 * u));
        return acc;
    }
};

template <int HD>
struct KRow<float, Fp8E4M3, HD> {
    __m512 values[HD / 16];
    explicit KRow(const Fp8E4M3* k) {
#if defined(__AVX512VBMI__)
        for (int u = 0; u < HD / 64; ++u)
            pagedserve::fp8::f32_from_fp8_codes(_mm512_loadu_si512(k + 64 * u), values + 4 * u);
#else
        for (int u = 0; u < HD / 16; ++u) values[u] = pagedserve::fp8::f32_from_fp8(k + 16 * u);
#endif
    }
    __m512 dot(const float* q) const {
        __m512 acc = _mm512_mul_ps(values[0], _mm512_loadu_ps(q));
        for (int u = 1; u < HD / 16; ++u) acc = _mm512_fmadd_ps(values[u], _mm512_loadu_ps(q + 16 * u), acc);
        return acc;
    }
};
#endif

// The 16 scores of a chunk (keys[s]: slot s's K row) for each of G query heads (contiguous at q): per slot, a
// vector of partial sums (dot), reduced to one vector of 16 scores by a transpose-and-add tree (15 steps of
// two shuffles and an add per head, instead of 16 horizontal reductions). Slots are taken four at a time, all
// G heads' dots of a K row together: each row is read once per chunk, the G x 4 partial sums stay in
// registers (scoring the whole chunk per head kept 16 sums live, spilled the K rows to the stack and read
// them back once per head), and each four is reduced by the tree's first two levels as soon as it is done.
template <typename T, typename C, int HD, int G>
inline void score16(const C* const* keys, const T* q, __m512* scores) {
    auto halves = [](__m512 x, __m512 y) {  // [x0+x2, x1+x3, y0+y2, y1+y3] (128-bit quarters)
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    };
    auto quarters = [](__m512 x, __m512 y) {  // one quarter per input of the two pairs
        return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
    };
    auto pairs = [](__m512 x, __m512 y) {  // within each quarter: two partials of x's key, two of y's
        return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
    };
    auto singles = [](__m512 x, __m512 y) {
        return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
    };
    __m512 fours[G][4];  // per head, slots 4f..4f+3 reduced to one vector
    for (int f = 0; f < 4; ++f) {
        __m512 part[G][4];
        for (int i = 0; i < 4; ++i) {
            const KRow<T, C, HD> k(keys[4 * f + i]);
            for (int h = 0; h < G; ++h) part[h][i] = k.dot(q + h * HD);
        }
        for (int h = 0; h < G; ++h)
            fours[h][f] = quarters(halves(part[h][0], part[h][1]), halves(part[h][2], part[h][3]));
    }
    for (int h = 0; h < G; ++h)  // lane 4c + i: slot 4i + c
        scores[h] = singles(pairs(fours[h][0], fours[h][1]), pairs(fours[h][2], fours[h][3]));
}

// V rows: 16 float32 lanes per step. A float row is read as is; 32 bf16 become two vectors, their even
// elements (shifted up) and their odd ones (masked), so a bf16 head's accumulators hold dims
// 0,2,..,30 then 1,3,..,31 per 32 dims, put back in order when the output is stored.
template <typename T>
struct VRow;

template <>
struct VRow<float> {
    static constexpr int kDims = 16, kVecs = 1;
    static void load(const float* v, __m512* out) { out[0] = _mm512_loadu_ps(v); }
#if defined(__AVX512BW__)
    static void load(const Fp8E4M3* v, __m512* out) { out[0] = pagedserve::fp8::f32_from_fp8(v); }
#endif
    static void store(float* dst, const float* acc, __m512 inv) {
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_load_ps(acc), inv));
    }
};

template <>
struct VRow<uint16_t> {
    static constexpr int kDims = 32, kVecs = 2;
    static void load(const uint16_t* v, __m512* out) { widen(_mm512_loadu_si512(v), out); }
#if defined(__AVX512BW__)
    static void load(const Fp8E4M3* v, __m512* out) { widen(pagedserve::fp8::bf16_words(v), out); }
#endif
    static void widen(__m512i raw, __m512* out) {
        out[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        out[1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
    }
    static __m512i round_bf16(__m512 x) {  // as pagedserve::store: nearest even, NaN stays NaN (quiet)
        const __m512i bits = _mm512_castps_si512(x);
        const __m512i rounded = _mm512_add_epi32(
            _mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
            _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
        const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        return _mm512_mask_or_epi32(rounded, nan, bits, _mm512_set1_epi32(0x400000));
    }
    static void store(uint16_t* dst, const float* acc, __m512 inv) {  // even dims low, odd dims high
        const __m512i even = round_bf16(_mm512_mul_ps(_mm512_load_ps(acc), inv));
        const __m512i odd = round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + 16), inv));
        const __m512i packed = _mm512_or_si512(_mm512_srli_epi32(even, 16),
                                               _mm512_and_si512(odd, _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u))));
        _mm512_storeu_si512(dst, packed);
    }
};

#if defined(__AVX512BF16__)
// bf16 V rows taken two keys at a time for P.V on vdpbf16ps: the rows of keys j and j + 1 interleaved
// word by word (unpacklo / unpackhi within each 128-bit quarter), so one dword holds a dim's two values
// and the pair (p_j, p_j+1), rounded to bf16, multiplies both in one instruction: half the instructions
// of widening each row to float32. Per 32 dims, the first accumulator holds dims 8q + 0..3 of quarter q,
// the second dims 8q + 4..7; `store` packs them back in order.
struct VPairs {
    static constexpr int kDims = 32, kVecs = 2;
    static void load(const uint16_t* a, const uint16_t* b, __m512i* out) {
        const __m512i x = _mm512_loadu_si512(a), y = _mm512_loadu_si512(b);
        out[0] = _mm512_unpacklo_epi16(x, y);
        out[1] = _mm512_unpackhi_epi16(x, y);
    }
    static void load(const Fp8E4M3* a, const Fp8E4M3* b, __m512i* out) {
        pagedserve::fp8::bf16_pairs(a, b, out[0], out[1]);
    }
    static void store(uint16_t* dst, const float* acc, __m512 inv) {
        const __m512i low = VRow<uint16_t>::round_bf16(_mm512_mul_ps(_mm512_load_ps(acc), inv));
        const __m512i high = VRow<uint16_t>::round_bf16(_mm512_mul_ps(_mm512_load_ps(acc + 16), inv));
        // per quarter: the four rounded words of `low`, then those of `high` (no value saturates: each is
        // a 16-bit pattern shifted down)
        _mm512_storeu_si512(dst, _mm512_packus_epi32(_mm512_srli_epi32(low, 16), _mm512_srli_epi32(high, 16)));
    }
};
template <typename T>
constexpr bool kPairedV = std::is_same<T, uint16_t>::value;
#else
template <typename T>
constexpr bool kPairedV = false;
#endif

// The accumulators' layout of a V row's dims: widened rows (VRow) or key pairs (VPairs).
template <typename T, bool Paired = kPairedV<T>>
struct Accumulated {
    using type = VRow<T>;
};
#if defined(__AVX512BF16__)
template <>
struct Accumulated<uint16_t, true> {
    using type = VPairs;
};
#endif

// One pass: G query heads (contiguous at q, out) over one kv head's tokens, chunk by chunk: the 16
// keys' scores for each head (K rows read from L1 once per head after the first), the online softmax
// on those vectors, then P.V with each V row widened once for the G heads.
template <typename T, typename C, int HD, int G>
void attend_pass(const T* q, const C* key_cache, const C* value_cache, const int32_t* table, int64_t begin,
                 int64_t len, int64_t head_offset, int64_t token_size, int64_t block_size, float scale,
                 float softcap, const float* sinks, T* out, float* partial, int64_t prefetch_bytes) {
    using V = typename Accumulated<T>::type;
    static_assert(HD % 32 == 0, "whole bf16 vectors");
    // dims per P.V step: G x (dims / 16) accumulators stay in registers
    constexpr int kStepDims = std::min(HD, (kMaxAccs * 16 / G) / 32 * 32);
    static_assert(HD % kStepDims == 0, "whole P.V steps");
    constexpr int kStepVecs = kStepDims / V::kDims;

    alignas(64) float acc[G][HD];
    alignas(64) float probs[G][kChunk];
    alignas(32) int32_t pairs[G][kChunk / 2];  // VPairs: (p_2i, p_2i+1) rounded to bf16, one dword per key pair
    float running_max[G], correction[G];
    __m512 running_sum[G];
    for (int h = 0; h < G; ++h) {
        std::fill(acc[h], acc[h] + HD, 0.0f);
        running_max[h] = -INFINITY;
        running_sum[h] = _mm512_setzero_ps();
    }
    const int64_t block_stride = block_size * token_size;
    const __m512 scale_v = _mm512_set1_ps(scale);
    // Element offsets of the kv head's rows of tokens [t0, t0 + n) in the caches: a base and a stride when the
    // tokens lie in one block (every chunk, when blocks are whole chunks), else token by token.
    auto chunk_rows = [&](int64_t t0, int n, int64_t* rows) {
        int64_t block = t0 / block_size, offset = t0 - block * block_size;
        if (offset + n <= block_size) {
            const int64_t base = table[block] * block_stride + offset * token_size + head_offset;
            for (int j = 0; j < n; ++j) rows[j] = base + j * token_size;
            return;
        }
        for (int j = 0; j < n; ++j) {
            rows[j] = table[block] * block_stride + offset * token_size + head_offset;
            if (++offset == block_size) offset = 0, ++block;
        }
    };
    // K and V rows are prefetched into L2 kPrefetchChunks chunks ahead of their use (demand misses on the
    // scattered blocks, a chunk at a time, left the kernel waiting on DRAM); the cursor runs ahead. (A
    // function whose only effects are prefetches is dropped by GCC: this one moves its cursor.)
    int64_t ahead = begin, ahead_block = begin / block_size, ahead_offset = begin - ahead_block * block_size;
    auto prefetch_to = [&](int64_t end) {
        for (end = std::min(end, len); ahead < end; ++ahead) {
            const int64_t r = table[ahead_block] * block_stride + ahead_offset * token_size + head_offset;
            for (int64_t byte = 0; byte < prefetch_bytes; byte += 64) {
                _mm_prefetch(reinterpret_cast<const char*>(key_cache + r) + byte, _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(value_cache + r) + byte, _MM_HINT_T1);
            }
            if (++ahead_offset == block_size) ahead_offset = 0, ++ahead_block;
        }
    };
    prefetch_to(begin + kPrefetchChunks * kChunk);

    for (int64_t t0 = begin; t0 < len; t0 += kChunk) {
        const int n = static_cast<int>(std::min<int64_t>(kChunk, len - t0));
        const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
        int64_t rows[kChunk];  // element offset of each token's kv head row in the caches
        chunk_rows(t0, n, rows);
        for (int j = n; j < kChunk; ++j) rows[j] = rows[0];  // scored, then masked out
        prefetch_to(t0 + (kPrefetchChunks + 1) * kChunk);
        const C* keys[kChunk];
        for (int s = 0; s < kChunk; ++s) keys[s] = key_cache + rows[kSlotKey[s]];

        bool rescale = false;
        __m512 sums[G];
        score16<T, C, HD, G>(keys, q, sums);
        for (int h = 0; h < G; ++h) {
            __m512 scaled = _mm512_mul_ps(sums[h], scale_v);
            if (softcap > 0.0f) scaled = softcap16(scaled, softcap);
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, scaled);
            // the maximum and the sums are rescaled only when a score exceeds the running maximum (the
            // first chunks, mostly); the sums are kept per lane, added up at the end
            float new_max = running_max[h];
            correction[h] = 1.0f;
            if (_mm512_cmp_ps_mask(scores, _mm512_set1_ps(new_max), _CMP_GT_OQ)) {
                new_max = _mm512_reduce_max_ps(scores);
                correction[h] = fast_exp(running_max[h] - new_max);
                rescale = true;
            }
            // (a maximum still -inf shifts by 0, as flash-attn's Check_inf: -inf - -inf would be NaN)
            const __m512 shifted = _mm512_sub_ps(scores, _mm512_set1_ps(new_max == -INFINITY ? 0.0f : new_max));
            // P rounded to bf16 for P.V (VPairs) takes the 9-instruction exponential, good to ~6e-5 as the prefill
            // kernel's is; otherwise the full one
            const __m512 p = _mm512_maskz_mov_ps(valid, kPairedV<T> ? exp16_bf16(shifted) : exp16(shifted));
            running_sum[h] = _mm512_fmadd_ps(running_sum[h], _mm512_set1_ps(correction[h]), p);
            running_max[h] = new_max;
            _mm512_store_ps(probs[h], p);
#if defined(__AVX512BF16__)
            if constexpr (kPairedV<T>)
                _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[h]), (__m256i)_mm512_cvtneps_pbh(p));
#endif
        }

        for (int d0 = 0; d0 < HD; d0 += kStepDims) {
            __m512 a[G][kStepVecs * V::kVecs];
            for (int h = 0; h < G; ++h) {
                const __m512 c = _mm512_set1_ps(correction[h]);
                for (int i = 0; i < kStepVecs * V::kVecs; ++i) {
                    a[h][i] = _mm512_load_ps(acc[h] + d0 + 16 * i);
                    if (rescale) a[h][i] = _mm512_mul_ps(a[h][i], c);
                }
            }
#if defined(__AVX512BF16__)
            if constexpr (kPairedV<T>) {
                // an odd count's last pair takes rows[n] (rows[0]: read, weighted 0)
                for (int j = 0; j < n; j += 2) {
                    const C* v0 = value_cache + rows[j] + d0;
                    const C* v1 = value_cache + rows[j + 1] + d0;
                    __m512i row[kStepVecs * V::kVecs];
                    for (int i = 0; i < kStepVecs; ++i)
                        V::load(v0 + i * V::kDims, v1 + i * V::kDims, row + i * V::kVecs);
                    for (int h = 0; h < G; ++h) {
                        const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[h][j / 2]);
                        for (int i = 0; i < kStepVecs * V::kVecs; ++i)
                            a[h][i] = _mm512_dpbf16_ps(a[h][i], (__m512bh)row[i], p);
                    }
                }
            } else
#endif
            {
                for (int j = 0; j < n; ++j) {
                    const C* v = value_cache + rows[j] + d0;
                    __m512 row[kStepVecs * V::kVecs];
                    for (int i = 0; i < kStepVecs; ++i) VRow<T>::load(v + i * V::kDims, row + i * V::kVecs);
                    for (int h = 0; h < G; ++h) {
                        const __m512 p = _mm512_set1_ps(probs[h][j]);
                        for (int i = 0; i < kStepVecs * V::kVecs; ++i)
                            a[h][i] = _mm512_fmadd_ps(p, row[i], a[h][i]);
                    }
                }
            }
            for (int h = 0; h < G; ++h)
                for (int i = 0; i < kStepVecs * V::kVecs; ++i) _mm512_store_ps(acc[h] + d0 + 16 * i, a[h][i]);
        }
    }

    if (partial != nullptr) {  // part of a split sequence: the running max, sum and unnormalized sums
        for (int h = 0; h < G; ++h) {
            float* dst = partial + h * kPartialSize;
            dst[0] = running_max[h];
            dst[1] = _mm512_reduce_add_ps(running_sum[h]);
            std::copy(acc[h], acc[h] + HD, dst + kPartialHeader);
        }
        return;
    }
    for (int h = 0; h < G; ++h) {
        const float sum = _mm512_reduce_add_ps(running_sum[h]);
        const __m512 inv = _mm512_set1_ps(normalizer(running_max[h], sum, sinks ? sinks + h : nullptr));
        for (int d = 0; d < HD; d += V::kDims) V::store(out + h * HD + d, acc[h] + d, inv);
    }
}

// Work items: (sequence, kv head, pass of up to kMaxPass of its query heads), spread over the threads:
// finer than sequences, so a single sequence (the latency-critical case) still uses every thread. When
// there are fewer than kSplitItemsPerThread items per thread, long sequences are split into parts of at least
// kMinSplitTokens (whole chunks), each part's running max, sum and unnormalized sums kept, and merged
// once all are done (1 x 2000 tokens, 2 threads: ~78 -> ~70 us), as many parts as make the items a multiple of
// the threads (empty parts of a short sequence are skipped at the merge); the merge sums in another order
// than one pass does, so `split` is off in batch-invariant mode.
template <typename T, typename C, int HD>
void paged_decode_simd(const T* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
                       const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t block_size, int64_t table_width, float scale,
                       bool split, int64_t window, float softcap, const float* sinks) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t passes = (group + kMaxPass - 1) / kMaxPass;
    const int64_t token_size = num_kv_heads * HD;
    const int64_t items = num_seqs * num_kv_heads * passes;
    const int64_t row_bytes = HD * static_cast<int64_t>(sizeof(C));  // prefetched by a kv head's first pass
    int64_t work = 0, longest = 0;  // work: cached tokens x query heads
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
        work += context_lens[seq];
        longest = std::max<int64_t>(longest, context_lens[seq]);
    }
    work *= num_heads;
    const bool parallel = items > 1 && work >= kParallelMinWork;
    int64_t parts = 1;
#if defined(_OPENMP)
    const int64_t threads = omp_get_max_threads();
    if (split && threads > 1 && items > 0 && items < kSplitItemsPerThread * threads)
        parts = std::max<int64_t>(
            1, std::min((kSplitItemsPerThread * threads + items - 1) / items, longest / kMinSplitTokens));
    // a whole number of items per thread: 3 kv heads in 3 parts on 2 threads left one thread idle through the
    // last of 9 equal items (docs/performance.md)
    if (parts > 1)
        while (items * parts % threads != 0) ++parts;
#endif
    // kept per calling thread, grown as needed: a vector made per call zeroes memory nothing reads
    thread_local std::vector<float> partials;
    if (parts > 1 && partials.size() < static_cast<size_t>(items * parts * kMaxPass * kPartialSize))
        partials.resize(items * parts * kMaxPass * kPartialSize);
    float* const partials_data = partials.data();  // (the team's other threads have vectors of their own)

#pragma omp parallel if (parallel || parts > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t index = 0; index < items * parts; ++index) {
            const int64_t item = index / parts, part = index % parts;
            const int64_t seq = item / (num_kv_heads * passes);
            const int64_t kv_head = item / passes % num_kv_heads;
            const int64_t pass = item % passes;
            const int64_t first = kv_head * group + pass * kMaxPass;  // first query head of the pass
            const int heads = static_cast<int>(std::min<int64_t>(kMaxPass, group - pass * kMaxPass));
            const int64_t at = (seq * num_heads + first) * HD;
            const int32_t* table = block_tables + seq * table_width;
            const int64_t len = context_lens[seq];
            const int64_t seen = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // the first visible token
            const int64_t span = len - seen, chunks = (span + kChunk - 1) / kChunk;
            const int64_t begin = seen + std::min(span, chunks * part / parts * kChunk);
            const int64_t end = seen + std::min(span, chunks * (part + 1) / parts * kChunk);
            float* partial = parts > 1 ? partials_data + index * kMaxPass * kPartialSize : nullptr;
#define PAGEDSERVE_PASS(G)                                                                                       \
    attend_pass<T, C, HD, G>(query + at, key_cache, value_cache, table, begin, end, kv_head * HD, token_size,      \
                          block_size, scale, softcap, sinks ? sinks + first : nullptr, out + at, partial,         \
                          pass == 0 ? row_bytes : 0)
            switch (heads) {
                case 1: PAGEDSERVE_PASS(1); break;
                case 2: PAGEDSERVE_PASS(2); break;
                case 3: PAGEDSERVE_PASS(3); break;
                default: PAGEDSERVE_PASS(4); break;
            }
#undef PAGEDSERVE_PASS
        }
        if (parts > 1) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; ++item) {
                const int64_t seq = item / (num_kv_heads * passes);
                const int64_t kv_head = item / passes % num_kv_heads;
                const int64_t pass = item % passes;
                const int64_t first = kv_head * group + pass * kMaxPass;
                const int heads = static_cast<int>(std::min<int64_t>(kMaxPass, group - pass * kMaxPass));
                T* dst = out + (seq * num_heads + first) * HD;
                for (int h = 0; h < heads; ++h) {
                    auto part_of = [&](int64_t part) {
                        return partials_data + ((item * parts + part) * kMaxPass + h) * kPartialSize;
                    };
                    float max = -INFINITY;  // empty parts: -inf, sum 0
                    for (int64_t part = 0; part < parts; ++part) max = std::max(max, part_of(part)[0]);
                    if (sinks != nullptr) max = std::max(max, sinks[first + h]);  // the sink: a part of no value
                    alignas(64) float acc[HD] = {};
                    float sum = 0.0f;
                    for (int64_t part = 0; part < parts; ++part) {
                        const float* p = part_of(part);
                        if (p[1] == 0.0f) continue;
                        const float weight = fast_exp(p[0] - max);
                        sum += weight * p[1];
                        for (int d = 0; d < HD; ++d) acc[d] += weight * p[kPartialHeader + d];
                    }
                    if (sinks != nullptr) sum += std::exp(sinks[first + h] - max);
                    const __m512 inv = _mm512_set1_ps(1.0f / sum);
                    using V = typename Accumulated<T>::type;
                    for (int d = 0; d < HD; d += V::kDims) V::store(dst + h * HD + d, acc + d, inv);
                }
            }
        }
    }
}
#endif  // __AVX512F__

template <typename T, typename C>
void dispatch(const T* query, const C* key_cache, const C* value_cache, const int32_t* block_tables,
              const int32_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, int64_t table_width, float scale, bool split, int64_t window,
              float softcap, const float* sinks) {
#define PAGEDSERVE_DECODE(HD)                                                                                   \
    paged_decode<T, C, HD>(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads,   \
                        num_kv_heads, head_dim, block_size, table_width, scale, split, window, softcap, sinks)
#if defined(__AVX512F__)
#define PAGEDSERVE_SIMD(HD)                                                                                     \
    paged_decode_simd<T, C, HD>(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads, \
                             num_kv_heads, block_size, table_width, scale, split, window, softcap, sinks)
    if constexpr (kFp8Simd || !std::is_same<C, pagedserve::Fp8E4M3>::value) {
        switch (head_dim) {
            case 64: PAGEDSERVE_SIMD(64); return;
            case 128: PAGEDSERVE_SIMD(128); return;
            case 256: PAGEDSERVE_SIMD(256); return;
            default: break;
        }
    }
#undef PAGEDSERVE_SIMD
#endif
    switch (head_dim) {
        case 64: PAGEDSERVE_DECODE(64); break;
        case 128: PAGEDSERVE_DECODE(128); break;
        case 256: PAGEDSERVE_DECODE(256); break;
        default: PAGEDSERVE_DECODE(0); break;
    }
#undef PAGEDSERVE_DECODE
}

}  // namespace

#define PAGEDSERVE_PAGED_DECODE(SUFFIX, T, C)                                                                  \
    void pagedserve_paged_decode_##SUFFIX(const T* query, const C* key_cache, const C* value_cache,             \
                                          const int32_t* block_tables, const int32_t* context_lens, T* out,     \
                                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,            \
                                          int64_t head_dim, int64_t block_size, int64_t table_width,            \
                                          float scale, int64_t split, int64_t window, float softcap,            \
                                          const float* sinks) {                                                 \
        dispatch(query, key_cache, value_cache, block_tables, context_lens, out, num_seqs, num_heads,          \
                 num_kv_heads, head_dim, block_size, table_width, scale, split != 0, window, softcap, sinks);  \
    }

extern "C" {
PAGEDSERVE_PAGED_DECODE(f32, float, float)
PAGEDSERVE_PAGED_DECODE(bf16, uint16_t, uint16_t)
PAGEDSERVE_PAGED_DECODE(f32_fp8, float, pagedserve::Fp8E4M3)  // an fp8 cache (--kv-cache-dtype fp8)
PAGEDSERVE_PAGED_DECODE(bf16_fp8, uint16_t, pagedserve::Fp8E4M3)
}
