// Causal attention of a prompt chunk over its sequence's paged K/V cache (the cached prefix and the chunk's own
// keys, written to the cache before the call), on AVX512-BF16: a flash-attention forward whose products run on
// vdpbf16ps (bf16 pairs, float32 sums), where torch's CPU flash kernel takes float32 products on CPUs without AMX.
//
// Layouts (row-major, contiguous):
//   query        [query_len, heads, head_dim] bf16; query i sits at position offset + i, offset = context_len -
//                query_len, and sees keys [0, offset + i]
//   key_cache    [num_blocks, block_size, kv_heads, head_dim] bf16 (value_cache alike), the sequence's tokens
//                at block_table[t / block_size], row t % block_size; or fp8 e4m3 (--kv-cache-dtype fp8, the
//                `_fp8` entry point), widened exactly to bf16 as each key tile is packed (fp8.h)
//   out          [query_len, heads, head_dim] bf16
//
// Work items: (kv head, tile of kQTile query positions), taken in prefill_items.h's order; the next key tile's
// rows are prefetched while a tile is packed and scored. An item's rows are its positions x the kv head's GQA group of
// query heads; per tile of kKTile keys:
//   K packed so that a vector holds one dim pair of 16 keys (Kt[p] lane j: key j's dims 2p, 2p+1; a 16 x 16
//                transpose of 32-bit pairs): a row's 16 scores are D/2 vdpbf16ps of Kt[p] with the row's dim
//                pair p broadcast, no horizontal sums
//   V packed in key pairs (Vp[kp] lane j: keys 2kp, 2kp+1 at one dim, vpunpck*wd order): P.V is D/32 x 16
//                vdpbf16ps per row with the row's probability pair kp broadcast
//   the online softmax per row in float32 (running max m, moved only when a score exceeds it; the sums of the
//   unrounded probabilities kept per lane); the probabilities are rounded to bf16 for P.V (as flash attention
//   on GPUs does), so their exponential is exp16_bf16's, good to ~6e-5; the accumulators are float32.
// Rows run in blocks of kRows (their accumulators in registers). Built and loaded by engine/kernels/cpu.py;
// engine/attention/cpu_backend.py calls it for bf16 chunks without windows, soft-caps or sinks.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "exp16.h"
#include "fp8.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "prefill_items.h"

namespace {

using pagedserve::fast_exp;

constexpr int64_t kQTile = 32;  // query positions per work item
constexpr int kKTile = 32;      // keys per step: two vectors of 16 scores per row
constexpr int kRows = 4;        // rows whose scores (and P.V accumulators) are held in registers together

using pagedserve::exp16_bf16;

inline __m512 bf16_pairs(__m512i x) { return _mm512_castsi512_ps(x); }

// Where P.V's accumulator lane j of a 32-dim chunk's first (second) vector lands: vpunpcklwd (vpunpckhwd) take
// words 0-3 (4-7) of each 128-bit lane.
inline int64_t low_dim(int j) { return 8 * (j / 4) + j % 4; }
inline int64_t high_dim(int j) { return 8 * (j / 4) + 4 + j % 4; }

// A thread's buffers for one work item.
template <int D>
struct Scratch {
    alignas(64) uint32_t kt[2][D / 2][16];        // the key tile's dim pairs, per 16 keys
    alignas(64) uint32_t vp[kKTile / 2][D / 16][16];  // the key tile's values in key pairs
    std::vector<float> o;                          // [rows][D] P.V sums, in the unpack order
    std::vector<float> m, l;                       // [rows] running max, [rows][16] running sums per lane
    explicit Scratch(int64_t rows) : o(rows * D), m(rows), l(rows * 16) {}
};

// The scores of kRows rows (NR used) against the tile's 32 keys, scaled and masked (a key past the row's last
// visible one, or past the tile's n keys, scores -inf), then the online softmax: P (bf16 pairs) out, m, l and
// the rows' accumulators rescaled.
template <int D, int NR>
void scores_and_softmax(const uint16_t* const* q, const int64_t* limit, int64_t t0, int n, float scale,
                        const Scratch<D>& s, float* m, float* l, float* o, uint32_t (*probs)[16]) {
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; ++p) {
        const __m512i k0 = _mm512_load_si512(s.kt[0][p]), k1 = _mm512_load_si512(s.kt[1][p]);
        for (int r = 0; r < NR; ++r) {
            uint32_t pair;
            std::memcpy(&pair, q[r] + 2 * p, sizeof pair);
            const __m512i qp = _mm512_set1_epi32(static_cast<int32_t>(pair));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)k0, (__m512bh)qp);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)k1, (__m512bh)qp);
        }
    }
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int r = 0; r < NR; ++r) {
        // key t0 + 16 h + lane is visible when <= limit[r] and inside the tile
        const int64_t last = std::min<int64_t>(limit[r], t0 + n - 1) - t0;  // >= 0: callers skip rows with none
        __m512 scores[2];
        __mmask16 visible[2] = {0xffff, 0xffff};
        if (last == kKTile - 1) {  // every key of the tile: no mask
            for (int h = 0; h < 2; ++h) scores[h] = _mm512_mul_ps(acc[r][h], _mm512_set1_ps(scale));
        } else {
            for (int h = 0; h < 2; ++h) {
                visible[h] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16 * h)),
                                                     _mm512_set1_epi32(static_cast<int32_t>(last)));
                scores[h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), visible[h],
                                               _mm512_mul_ps(acc[r][h], _mm512_set1_ps(scale)));
            }
        }
        // the maximum (and the sums with it) moves only when a score exceeds it: the first tiles, mostly
        const __m512 both = _mm512_max_ps(scores[0], scores[1]);
        float new_max = m[r], correction = 1.0f;
        if (_mm512_cmp_ps_mask(both, _mm512_set1_ps(new_max), _CMP_GT_OQ)) {
            new_max = _mm512_reduce_max_ps(both);
            correction = fast_exp(m[r] - new_max);  // m = -inf at the first tile: ~0, nothing to rescale yet
        }
        __m512 p[2];
        const __m512 shift = _mm512_set1_ps(new_max == -INFINITY ? 0.0f : new_max);  // not -inf - -inf
        for (int h = 0; h < 2; ++h)
            p[h] = _mm512_maskz_mov_ps(visible[h], exp16_bf16(_mm512_sub_ps(scores[h], shift)));
        // the sums per lane, added up at the end
        const __m512 sums = _mm512_fmadd_ps(_mm512_loadu_ps(l + 16 * r), _mm512_set1_ps(correction),
                                            _mm512_add_ps(p[0], p[1]));
        _mm512_storeu_ps(l + 16 * r, sums);
        m[r] = new_max;
        if (correction != 1.0f) {
            float* row = o + r * D;
            for (int d = 0; d < D; d += 16)
                _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_loadu_ps(row + d), _mm512_set1_ps(correction)));
        }
        // bf16 element j = key j: b (keys 0-15) fills the low half, a (16-31) the high one
        _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    }
}

// o[r] += P[r] V over the tile's key pairs [0, pairs), 32 dims (two vectors) at a time.
template <int D, int NR>
void probs_times_values(const Scratch<D>& s, const uint32_t (*probs)[16], int pairs, float* o) {
    for (int v0 = 0; v0 < D / 16; v0 += 4) {
        const int vecs = std::min(4, D / 16 - v0);
        __m512 acc[NR][4];
        for (int r = 0; r < NR; ++r)
            for (int v = 0; v < vecs; ++v) acc[r][v] = _mm512_loadu_ps(o + r * D + 16 * (v0 + v));
        for (int kp = 0; kp < pairs; ++kp) {
            for (int r = 0; r < NR; ++r) {
                const __m512i pp = _mm512_set1_epi32(static_cast<int32_t>(probs[r][kp]));
                for (int v = 0; v < vecs; ++v)
                    acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)_mm512_load_si512(s.vp[kp][v0 + v]),
                                                 (__m512bh)pp);
            }
        }
        for (int r = 0; r < NR; ++r)
            for (int v = 0; v < vecs; ++v) _mm512_storeu_ps(o + r * D + 16 * (v0 + v), acc[r][v]);
    }
}

// The 16 x 16 transpose of 32-bit elements: out[p] lane j = rows[j] lane p (unpacks of 32 and 64 bits within
// 128-bit lanes, then a 4 x 4 transpose of the lanes).
inline void transpose16(const __m512i* rows, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int g = 0; g < 4; ++g) {  // u[4g + k] lane L: rows 4g..4g+3 at element 4L + k
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int k = 0; k < 4; ++k) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
        out[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        out[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

// 32 dims of a cached K or V row as bf16 words: read (bf16), or widened (fp8).
inline __m512i row_words(const uint16_t* row) { return _mm512_loadu_si512(row); }
inline __m512i row_words(const pagedserve::Fp8E4M3* row) { return pagedserve::fp8::bf16_words(row); }

// Packs keys [t0, t0 + n) of kv head `kv` into s.kt and s.vp (keys past n as zeros).
template <typename C, int D>
void pack_tile(const C* key_cache, const C* value_cache, const int32_t* table, int64_t block_size,
               int64_t token_size, int64_t kv, int64_t t0, int n, Scratch<D>& s) {
    const C* keys[kKTile];
    const C* values[kKTile];
    for (int j = 0; j < kKTile; ++j) {
        const int64_t t = t0 + std::min(j, n - 1);  // past n: any row, zeroed below
        const int64_t at = (table[t / block_size] * block_size + t % block_size) * token_size + kv * D;
        keys[j] = key_cache + at;
        values[j] = value_cache + at;
    }
    for (int h = 0; h < 2; ++h)
        for (int c = 0; c < D / 32; ++c) {  // dim pairs 16c .. 16c + 15 of keys 16h .. 16h + 15
            __m512i rows[16], columns[16];
            for (int j = 0; j < 16; ++j)
                rows[j] = 16 * h + j < n ? row_words(keys[16 * h + j] + 32 * c) : _mm512_setzero_si512();
            transpose16(rows, columns);
            for (int p = 0; p < 16; ++p) _mm512_store_si512(s.kt[h][16 * c + p], columns[p]);
        }
    for (int kp = 0; kp < kKTile / 2; ++kp) {
        const bool first = 2 * kp < n, second = 2 * kp + 1 < n;
        for (int c = 0; c < D / 32; ++c) {
            const __m512i a = first ? row_words(values[2 * kp] + 32 * c) : _mm512_setzero_si512();
            const __m512i b = second ? row_words(values[2 * kp + 1] + 32 * c) : _mm512_setzero_si512();
            _mm512_store_si512(s.vp[kp][2 * c], _mm512_unpacklo_epi16(a, b));
            _mm512_store_si512(s.vp[kp][2 * c + 1], _mm512_unpackhi_epi16(a, b));
        }
    }
}

template <typename C, int D>
void attend_item(const uint16_t* query, const C* key_cache, const C* value_cache, const int32_t* table,
                 uint16_t* out, int64_t q0, int64_t q1, int64_t offset, int64_t heads, int64_t kv_heads, int64_t kv,
                 int64_t block_size, float scale, Scratch<D>& s) {
    const int64_t group = heads / kv_heads, rows = (q1 - q0) * group, token_size = kv_heads * D;
    // row r: position q0 + r / group, head kv * group + r % group
    std::fill(s.o.begin(), s.o.begin() + rows * D, 0.0f);
    std::fill(s.m.begin(), s.m.begin() + rows, -INFINITY);
    std::fill(s.l.begin(), s.l.begin() + rows * 16, 0.0f);
    auto query_row = [&](int64_t r) { return query + ((q0 + r / group) * heads + kv * group + r % group) * D; };
    auto limit_of = [&](int64_t r) { return offset + q0 + r / group; };  // the row's last visible key
    const int64_t keys = offset + q1;  // the last row sees keys [0, keys)
    alignas(64) uint32_t probs[kRows][16];
    for (int64_t t0 = 0; t0 < keys; t0 += kKTile) {
        const int n = static_cast<int>(std::min<int64_t>(kKTile, keys - t0));
        pack_tile<C, D>(key_cache, value_cache, table, block_size, token_size, kv, t0, n, s);
        pagedserve::prefill::prefetch_rows(key_cache, value_cache, table, block_size, token_size, kv * D, D,
                                           t0 + kKTile, std::min<int64_t>(keys, t0 + 2 * kKTile));  // the next tile
        // rows whose last visible key is before t0 see none of this tile: they are the first rows (positions
        // ascend with r), so the tile starts at the first row that sees it
        const int64_t first = std::max<int64_t>(0, (t0 - offset - q0) * group);
        for (int64_t r0 = first; r0 < rows; r0 += kRows) {
            const int nr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
            const uint16_t* q[kRows];
            int64_t limit[kRows];
            for (int r = 0; r < nr; ++r) q[r] = query_row(r0 + r), limit[r] = limit_of(r0 + r);
            // the block's last row sees the most keys: P.V over the pairs it sees (the others' probabilities
            // there are 0)
            const int pairs = static_cast<int>((std::min<int64_t>(limit[nr - 1], t0 + n - 1) - t0) / 2 + 1);
            float* o = s.o.data() + r0 * D;
            float* m = s.m.data() + r0;
            float* l = s.l.data() + r0 * 16;
#define PAGEDSERVE_ROWS(NR)                                                     \
    scores_and_softmax<D, NR>(q, limit, t0, n, scale, s, m, l, o, probs);      \
    probs_times_values<D, NR>(s, probs, pairs, o)
            switch (nr) {
                case 1: PAGEDSERVE_ROWS(1); break;
                case 2: PAGEDSERVE_ROWS(2); break;
                case 3: PAGEDSERVE_ROWS(3); break;
                default: PAGEDSERVE_ROWS(4); break;
            }
#undef PAGEDSERVE_ROWS
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(s.l.data() + 16 * r));
        const float inverse = s.m[r] == -INFINITY ? NAN : 1.0f / sum;  // every score -inf: NaN, as torch's
        const float* o = s.o.data() + r * D;
        uint16_t* dst = out + ((q0 + r / group) * heads + kv * group + r % group) * D;
        for (int c = 0; c < D / 32; ++c)
            for (int j = 0; j < 16; ++j) {
                pagedserve::store(dst + 32 * c + low_dim(j), o[32 * c + j] * inverse);
                pagedserve::store(dst + 32 * c + high_dim(j), o[32 * c + 16 + j] * inverse);
            }
    }
}

template <typename C, int D>
void prefill_attention(const uint16_t* query, const C* key_cache, const C* value_cache,
                       const int32_t* table, uint16_t* out, int64_t query_len, int64_t context_len, int64_t heads,
                       int64_t kv_heads, int64_t block_size, float scale) {
    const int64_t offset = context_len - query_len;
    pagedserve::prefill::for_each_item<Scratch<D>>(
        query_len, kv_heads, kQTile, kQTile * (heads / kv_heads),
        [&](int64_t q0, int64_t q1, int64_t kv, Scratch<D>& s) {
            attend_item<C, D>(query, key_cache, value_cache, table, out, q0, q1, offset, heads, kv_heads, kv,
                              block_size, scale, s);
        });
}

}  // namespace

extern "C" {
// 1 when this build has the kernel (AVX512-BF16), 0 otherwise (the caller keeps torch's attention).
int64_t pagedserve_prefill_attention_bf16_native() { return 1; }

// Returns 0 when head_dim is not one it is built for (64, 128), else computes `out` and returns 1.
#define PAGEDSERVE_PREFILL_ATTENTION(SUFFIX, C)                                                                 \
    int64_t pagedserve_prefill_attention_##SUFFIX(const uint16_t* query, const C* key_cache, const C* value_cache, \
                                                  const int32_t* block_table, uint16_t* out, int64_t query_len,   \
                                                  int64_t context_len, int64_t heads, int64_t kv_heads,           \
                                                  int64_t head_dim, int64_t block_size, float scale) {            \
        return pagedserve::prefill::with_head_dim(head_dim, [&](auto d) {                                      \
            prefill_attention<C, decltype(d)::value>(query, key_cache, value_cache, block_table, out, query_len,  \
                                                     context_len, heads, kv_heads, block_size, scale);          \
        });                                                                                                     \
    }
PAGEDSERVE_PREFILL_ATTENTION(bf16, uint16_t)
PAGEDSERVE_PREFILL_ATTENTION(bf16_fp8, pagedserve::Fp8E4M3)  // an fp8 cache (--kv-cache-dtype fp8)
#undef PAGEDSERVE_PREFILL_ATTENTION
}

#else  // no AVX512-BF16: torch's attention serves these chunks

extern "C" {
int64_t pagedserve_prefill_attention_bf16_native() { return 0; }

int64_t pagedserve_prefill_attention_bf16(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*,
                                          uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                          float) {
    return 0;
}

int64_t pagedserve_prefill_attention_bf16_fp8(const uint16_t*, const uint8_t*, const uint8_t*, const int32_t*,
                                              uint16_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                              float) {
    return 0;
}
}

#endif
