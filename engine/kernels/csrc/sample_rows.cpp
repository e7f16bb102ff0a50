// Sampled rows on CPU: one token per row of float32 logits under that row's temperature, min_p, top_k and top_p,
// drawn by inverse CDF with the row's uniform, in one call (engine/sampling/sampler.py's `_sample_full` and
// `_sample_candidates`, whose dozen torch operations per step cost more than the draw, and whose top-p rows
// without top-k sorted the whole vocabulary once their nucleus outgrew 2,048 candidates).
//
// Per row, as sampler.py computes it:
//   weights     w = exp(z), z = (x - max) / temperature; 0 where z < log(min_p), where x is -inf, and below
//               e^-87 (the exponential's clamp: torch's gives a denormal or 0 there)
//   +inf        a row whose largest logit is +inf (a penalty can make one) takes its first +inf, as torch's
//               fallback does
//   full rows   (no top-k, no top-p): the draw over the whole vocabulary in index order
//   top-k rows  the k largest logits, best first (ties: lower index first, where torch's topk may order them
//               otherwise: another of the tied tokens, the same distribution), their z from the best; top-p among
//               them: a column is kept while the mass before it is below top_p x their mass; the draw in that
//               order
//   top-p rows without top-k: the nucleus over the whole row (columns by weight, largest first, kept while the
//               mass before them is below top_p x the row's mass). Where it ends among the 128 best columns
//               (sampler.py's first candidates) the draw runs over them best first, as sampler.py's; a longer one
//               is found by a histogram of the weights' bits instead of a sort, and drawn among in column order
//               (the same distribution as sampler.py's sorted order, another column for a given uniform)
//   the draw    the first column whose running sum (accumulated in double, as torch's CPU cumsum does, rounded
//               to float) exceeds u x the total; a row without positive weight takes its first largest weight
// Rows are independent (a row's token depends on its own logits, parameters and uniform alone) and run in
// parallel over the calling team. Also the rows' raw logprobs (`pagedserve_row_logprobs`: a prompt's logprobs,
// the log-softmax torch computes, its target's logprob and rank and the best k, without a [rows, vocab] tensor
// of them). Built and loaded by engine/kernels/cpu.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "exp16.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// w[i] = exp((x[i] - max) / temperature), 0 where that is -inf, NaN, below log_min_p or below -87 (exp16 and
// fast_exp clamp there: e^-87 would stand for every smaller weight).
void row_weights(const float* x, int64_t n, float max, float temperature, float log_min_p, float* w) {
    log_min_p = std::max(log_min_p, -87.0f);
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 top = _mm512_set1_ps(max), t = _mm512_set1_ps(temperature), least = _mm512_set1_ps(log_min_p);
    const __m512 minus_infinity = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) {
        const __m512 z = _mm512_div_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), top), t);
        const __mmask16 keep =
            _mm512_cmp_ps_mask(z, minus_infinity, _CMP_GT_OQ) & _mm512_cmp_ps_mask(z, least, _CMP_GE_OQ);
        _mm512_storeu_ps(w + i, _mm512_maskz_mov_ps(keep, pagedserve::exp16(z)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 top = _mm256_set1_ps(max), t = _mm256_set1_ps(temperature), least = _mm256_set1_ps(log_min_p);
    const __m256 minus_infinity = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) {
        const __m256 z = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), top), t);
        const __m256 keep =
            _mm256_and_ps(_mm256_cmp_ps(z, minus_infinity, _CMP_GT_OQ), _mm256_cmp_ps(z, least, _CMP_GE_OQ));
        _mm256_storeu_ps(w + i, _mm256_and_ps(keep, pagedserve::exp8(z)));
    }
#endif
    for (; i < n; ++i) {
        const float z = (x[i] - max) / temperature;
        w[i] = z > -INFINITY && z >= log_min_p ? pagedserve::fast_exp(z) : 0.0f;
    }
}

// The largest value (of a row without NaN: a NaN row's token is garbage, and its request fails, in the caller).
float row_max(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
#if defined(__AVX512F__)
    __m512 v = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
    m = _mm512_reduce_max_ps(v);
#elif defined(__AVX2__)
    __m256 v = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (float lane : lanes) m = std::max(m, lane);
#endif
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

// The first index of the largest weight (a row whose draw found no positive weight).
int64_t first_largest(const float* w, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i)
        if (w[i] > w[best]) best = i;
    return best;
}

constexpr int64_t kChunk = 256;  // weights per partial sum: the draw skips whole chunks to the one it lands in

// Sum of w[0, n) in double, 8 running sums (an order torch's cumsum does not use: rounded to float, the same but
// for a rare last bit).
double chunk_sum(const float* w, int64_t n) {
    double s[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; ++k) s[k] += w[i + k];
    double total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; i < n; ++i) total += w[i];
    return total;
}

// Inverse-CDF draw over w[0, n) in order (sampler.py's `_draw`); `sums` gets the chunks' partial sums.
int64_t draw(const float* w, int64_t n, float u, std::vector<double>& sums) {
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    sums.resize(static_cast<size_t>(chunks));
    double total = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
        sums[c] = chunk_sum(w + c * kChunk, std::min(kChunk, n - c * kChunk));
        total += sums[c];
    }
    const float total_f = static_cast<float>(total);
    if (!(total_f > 0.0f)) return first_largest(w, n);  // no positive weight (or a NaN)
    const float target = std::min(u * total_f, std::nextafter(total_f, 0.0f));
    double prefix = 0.0;
    int64_t c = 0;
    while (c < chunks - 1 && static_cast<float>(prefix + sums[c]) <= target) prefix += sums[c++];
    for (int64_t i = c * kChunk; i < n; ++i) {
        prefix += w[i];
        if (static_cast<float>(prefix) > target) return i;  // w[i] > 0: the running sum just grew
    }
    return w[n - 1] > 0.0f ? n - 1 : first_largest(w, n);  // rounding: searchsorted's clamp, then the fallback
}

// The k largest logits' columns, best first (ties: lower index first; -inf and NaN logits left out: they weigh
// nothing). One pass keeps the columns above a running threshold: when more than a few k have gathered, the best
// k stay and the threshold rises to the k-th, so that most columns cost one compare.
void top_columns(const float* x, int64_t n, int64_t k, std::vector<int32_t>& out) {
    const size_t keep = static_cast<size_t>(k), room = std::max<size_t>(4 * keep, 256);
    auto better = [x](int32_t a, int32_t b) { return x[a] != x[b] ? x[a] > x[b] : a < b; };
    out.clear();
    float threshold = -INFINITY;  // a later column equal to the k-th kept loses to it: its index is higher
    auto shrink = [&]() {
        std::nth_element(out.begin(), out.begin() + static_cast<int64_t>(keep) - 1, out.end(), better);
        threshold = x[out[keep - 1]];  // the k-th best
        out.resize(keep);
    };
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        uint32_t above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(threshold), _CMP_GT_OQ);
        for (; above != 0; above &= above - 1) out.push_back(static_cast<int32_t>(i + __builtin_ctz(above)));
        if (out.size() >= room) shrink();
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        uint32_t above = static_cast<uint32_t>(
            _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(threshold), _CMP_GT_OQ)));
        for (; above != 0; above &= above - 1) out.push_back(static_cast<int32_t>(i + __builtin_ctz(above)));
        if (out.size() >= room) shrink();
    }
#endif
    for (; i < n; ++i) {
        if (x[i] > threshold) out.push_back(static_cast<int32_t>(i));
        if (out.size() >= room) shrink();
    }
    if (out.size() > keep) {
        std::nth_element(out.begin(), out.begin() + static_cast<int64_t>(keep) - 1, out.end(), better);
        out.resize(keep);
    }
    std::sort(out.begin(), out.end(), better);
}

// sampler.py's top-p mask over weights best first: kept[j] = w[j] while the mass before column j is below
// `limit`, else 0 (kept may be w). Returns the running total (in double, rounded to float).
float keep_nucleus(const float* w, int64_t m, float limit, float* kept) {
    double running = 0.0;
    for (int64_t j = 0; j < m; ++j) {
        const float weight = w[j];
        running += weight;
        kept[j] = static_cast<float>(running) - weight >= limit ? 0.0f : weight;
    }
    return static_cast<float>(running);
}

inline uint32_t float_bits(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    return bits;
}

struct Scratch {
    std::vector<float> w;        // the row's weights, or its candidates'
    std::vector<float> values;   // the candidates' logits, or their weights
    std::vector<double> sums;    // the draw's chunk sums
    std::vector<int32_t> columns, edge;  // the candidates; the nucleus's last bucket
};

// A row with top-k (and maybe top-p): sampler.py's candidate arithmetic over its k best logits, in their order.
int64_t sample_top_k(const float* x, int64_t n, float temperature, float log_min_p, int64_t k, float top_p, float u,
                     Scratch& s) {
    top_columns(x, n, k, s.columns);
    const int64_t m = static_cast<int64_t>(s.columns.size());
    if (m == 0) return 0;  // no finite logit: garbage (the caller fails the row)
    s.values.resize(static_cast<size_t>(m));
    s.w.resize(static_cast<size_t>(m));
    for (int64_t j = 0; j < m; ++j) s.values[j] = x[s.columns[j]];
    row_weights(s.values.data(), m, s.values[0], temperature, log_min_p, s.w.data());
    if (top_p < 1.0f) {  // the nucleus of the candidates' own mass
        double mass = 0.0;
        for (int64_t j = 0; j < m; ++j) mass += s.w[j];
        keep_nucleus(s.w.data(), m, top_p * static_cast<float>(mass), s.w.data());
    }
    return s.columns[draw(s.w.data(), m, u, s.sums)];
}

constexpr int64_t kNucleusCandidates = 128;  // sampler.py's TOP_P_CANDIDATES

// A top-p row without top-k: the torch way's first candidates, or its nucleus by the weights' bits (positive
// floats order as their bits do): a histogram of the top 12 bits' masses, the bucket the nucleus ends in by the
// next 12 bits, only the sub-bucket it ends in sorted; then the draw among the kept columns in index order.
int64_t sample_nucleus(const float* x, int64_t n, float largest, float temperature, float log_min_p, float top_p,
                       float u, Scratch& s) {
    // weights are at most 1 (z <= 0): their top 12 bits (sign, exponent, 3 mantissa bits) are at most 1016
    constexpr int kBits = 12, kBuckets = 1024, kCopies = 4;
    s.w.resize(static_cast<size_t>(n));
    float* w = s.w.data();
    row_weights(x, n, largest, temperature, log_min_p, w);
    // The torch way's first try: the kNucleusCandidates best columns, best first, against the whole row's mass.
    // Where the nucleus ends among them (the usual case), the draw runs over them in that order: its tokens.
    const float limit_f = top_p * static_cast<float>(chunk_sum(w, n));
    top_columns(x, n, std::min<int64_t>(kNucleusCandidates, n), s.columns);
    const int64_t m = static_cast<int64_t>(s.columns.size());
    s.values.resize(static_cast<size_t>(m));
    for (int64_t j = 0; j < m; ++j) s.values[j] = w[s.columns[j]];
    if (m > 0 && keep_nucleus(s.values.data(), m, limit_f, s.values.data()) >= limit_f)
        return s.columns[draw(s.values.data(), m, u, s.sums)];
    auto bucket_of = [](float v) { return std::min(static_cast<int>(float_bits(v) >> (32 - kBits)), kBuckets - 1); };
    // kCopies histograms, element i into copy i % kCopies: neighbours with one bucket do not wait on each other
    std::vector<double> copies(kCopies * kBuckets, 0.0);
    for (int64_t i = 0; i < n; ++i) copies[(i % kCopies) * kBuckets + bucket_of(w[i])] += w[i];
    std::vector<double> mass(kBuckets, 0.0);
    double total = 0.0;
    for (int b = 0; b < kBuckets; ++b) {
        for (int c = 0; c < kCopies; ++c) mass[b] += copies[c * kBuckets + b];
        total += mass[b];
    }
    if (!(total > 0.0)) return first_largest(w, n);
    const double limit = static_cast<double>(top_p * static_cast<float>(total));
    if (!(limit > 0.0)) return first_largest(w, n);  // a top_p below float's range: the best column alone
    double before = 0.0;  // the mass of the buckets above
    int bucket = kBuckets - 1;
    while (bucket > 0 && before + mass[bucket] < limit) before += mass[bucket--];
    s.edge.clear();
    for (int64_t i = 0; i < n; ++i)
        if (w[i] > 0.0f && bucket_of(w[i]) == bucket) s.edge.push_back(static_cast<int32_t>(i));
    // that bucket by the weights' next 12 bits (a flat row puts most of itself in one bucket): the sub-buckets
    // above the one the nucleus ends in are kept whole, only that one is sorted
    auto sub_of = [](float v) { return static_cast<int>((float_bits(v) >> (32 - 2 * kBits)) & ((1u << kBits) - 1)); };
    static_assert(kCopies * kBuckets >= (1 << kBits), "copies holds the sub-buckets");
    std::fill(copies.begin(), copies.end(), 0.0);  // the sub-buckets' masses, in copies' first 4096
    for (int32_t column : s.edge) copies[sub_of(w[column])] += w[column];
    int sub = (1 << kBits) - 1;
    while (sub > 0 && before + copies[sub] < limit) before += copies[sub--];
    s.edge.erase(std::remove_if(s.edge.begin(), s.edge.end(), [&](int32_t column) { return sub_of(w[column]) != sub; }),
                 s.edge.end());
    std::sort(s.edge.begin(), s.edge.end(), [w](int32_t a, int32_t b) { return w[a] != w[b] ? w[a] > w[b] : a < b; });
    // the last kept column of that sub-bucket: kept while the mass before it is below the limit
    float cut = 0.0f;  // weights above it are kept; equal to it, columns up to cut_column
    int32_t cut_column = -1;
    double kept = before;
    for (int32_t column : s.edge) {
        if (kept >= limit) break;
        kept += w[column];
        cut = w[column];
        cut_column = column;
    }
    if (cut_column < 0) {  // the limit is the whole mass (rounding): every positive weight
        cut = std::nextafter(0.0f, 1.0f);
        cut_column = static_cast<int32_t>(n);
    }
    for (int64_t i = 0; i < n; ++i)
        if (!(w[i] > cut || (w[i] == cut && i <= cut_column))) w[i] = 0.0f;
    return draw(w, n, u, s.sums);
}

// log sum exp(x - max) over a row, the sum in double lanes (a float sum of 150,000 terms drifts by ~1e-5).
float log_sum_exp(const float* x, int64_t n, float max) {
    int64_t i = 0;
    double sum = 0.0;
#if defined(__AVX512F__)
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    const __m512 top = _mm512_set1_ps(max);
    for (; i + 16 <= n; i += 16) {
        const __m512 e = pagedserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), top));
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    sum = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    const __m256 top = _mm256_set1_ps(max);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = pagedserve::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), top));
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    alignas(32) double parts[4];
    _mm256_store_pd(parts, _mm256_add_pd(low, high));
    for (double part : parts) sum += part;
#endif
    for (; i < n; ++i) sum += x[i] - max <= -87.0f ? 0.0f : pagedserve::fast_exp(x[i] - max);  // NaN: NaN, as above
    return static_cast<float>(std::log(sum));
}

// Columns whose raw logprob (x - max) - lse is above `than`.
int64_t count_above(const float* x, int64_t n, float max, float lse, float than) {
    int64_t i = 0, count = 0;
#if defined(__AVX512F__)
    const __m512 top = _mm512_set1_ps(max), shift = _mm512_set1_ps(lse), bound = _mm512_set1_ps(than);
    for (; i + 16 <= n; i += 16) {
        const __m512 raw = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), top), shift);
        count += __builtin_popcount(_mm512_cmp_ps_mask(raw, bound, _CMP_GT_OQ));
    }
#endif
    for (; i < n; ++i) count += (x[i] - max) - lse > than;
    return count;
}

}  // namespace

extern "C" {
// Row r of logits [rows, vocab] (float32, contiguous): logprob[r] = its target's raw logprob (x - max) - lse,
// rank[r] = 1 + the columns whose logprob is above it, and when k > 0 the k best (top_values[r * k + j],
// top_ids[r * k + j]) best first (ties: lower column first). Rows in parallel over the calling team.
void pagedserve_row_logprobs(const float* logits, int64_t rows, int64_t vocab, const int64_t* targets, int64_t k,
                             float* logprob, int64_t* rank, float* top_values, int64_t* top_ids) {
#pragma omp parallel if (rows > 1)
    {
        std::vector<int32_t> columns;
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; ++r) {
            const float* x = logits + r * vocab;
            const float max = row_max(x, vocab), lse = log_sum_exp(x, vocab, max);
            const float target = (x[targets[r]] - max) - lse;
            logprob[r] = target;
            rank[r] = 1 + count_above(x, vocab, max, lse, target);
            if (k > 0) {
                top_columns(x, vocab, std::min(k, vocab), columns);
                for (int64_t j = 0; j < k; ++j) {  // past the finite columns: the worst logprob, column 0
                    const bool held = j < static_cast<int64_t>(columns.size());
                    top_ids[r * k + j] = held ? columns[j] : 0;
                    top_values[r * k + j] = held ? (x[columns[j]] - max) - lse : -INFINITY;
                }
            }
        }
    }
}


// out[r] = the token of row r of logits [rows, vocab] (float32, contiguous): temperature[r] > 0; log_min_p[r]
// (-inf: no min_p); top_k[r] (>= vocab: none); top_p[r] (1: none); u[r] in [0, 1).
void pagedserve_sample_rows(const float* logits, int64_t rows, int64_t vocab, const float* temperature,
                            const float* log_min_p, const int64_t* top_k, const float* top_p, const float* u,
                            int64_t* out) {
#pragma omp parallel if (rows > 1)
    {
        Scratch s;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) {
            const float* x = logits + r * vocab;
            const float largest = row_max(x, vocab);
            if (largest == INFINITY) {  // z is NaN there, -inf elsewhere: torch's draw falls back to it
                out[r] = std::find(x, x + vocab, INFINITY) - x;
            } else if (top_k[r] < vocab) {
                out[r] = sample_top_k(x, vocab, temperature[r], log_min_p[r], std::max<int64_t>(top_k[r], 1),
                                      top_p[r], u[r], s);
            } else if (top_p[r] < 1.0f) {
                out[r] = sample_nucleus(x, vocab, largest, temperature[r], log_min_p[r], top_p[r], u[r], s);
            } else {
                s.w.resize(static_cast<size_t>(vocab));
                row_weights(x, vocab, largest, temperature[r], log_min_p[r], s.w.data());
                out[r] = draw(s.w.data(), vocab, u[r], s.sums);
            }
        }
    }
}
}
