// A CPU step's logits processors in one call, in place on the float32 logits the sampler owns for the step
// (engine/sampling/sampler.py's `_apply_processors`, whose torch way costs a dozen small operations a step, more
// than the draw: docs/performance.md).
//
// In sampler.py's order, with its float32 arithmetic (the same logits, bit for bit):
//   additions   x[row, id] += value, in order: logit_bias, and -inf for the stop tokens min_tokens holds back
//   repetition  (HF, vLLM) each distinct id of a row's prompt and output once: x / r where x > 0, else x * r
//   presence, frequency
//               (OpenAI) each distinct output id, c times in the output: x -= frequency * c + presence (the
//               product rounded to float before the sum, as torch rounds it: never fused into one rounding)
// Which penalties a row takes is the caller's flag (sampler.py decides on the parameters as given: a presence
// penalty of -1e-300 is not 0 there, though its float is -0, and its +0 turns a -0 logit into +0).
// Ids outside [0, vocab) are skipped (sampler.py's callers never pass any: the vocabulary is checked up front).
// Penalized rows are independent and run in parallel when they hold enough ids; each thread keeps a mark per
// column and a count per column across calls, put back to zero as each row finishes.
// Built and loaded by engine/kernels/cpu.py.

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kParallelMinIds = 16384;  // ids over all penalized rows: below, the calling thread alone
constexpr int64_t kRepetition = 1;  // a penalized row's flags: its repetition penalty applies
constexpr int64_t kCounts = 2;      // its presence and frequency penalties apply

// The thread's columns of marks and counts, at least `vocab` of each, all zero between rows.
struct ColumnScratch {
    std::vector<uint8_t> seen;
    std::vector<int32_t> counts;
    void reserve(int64_t vocab) {
        if (static_cast<int64_t>(seen.size()) < vocab) seen.resize(vocab, 0);
        if (static_cast<int64_t>(counts.size()) < vocab) counts.resize(vocab, 0);
    }
};

ColumnScratch& thread_scratch(int64_t vocab) {
    static thread_local ColumnScratch scratch;
    scratch.reserve(vocab);
    return scratch;
}

inline bool in_vocab(int64_t id, int64_t vocab) { return id >= 0 && id < vocab; }

// Each distinct id of ids[0..n) not seen before in this row: divided or multiplied by `penalty`, then marked.
void repeat_penalty(float* x, int64_t vocab, const int64_t* ids, int64_t n, float penalty, uint8_t* seen) {
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        if (!in_vocab(id, vocab) || seen[id]) continue;
        seen[id] = 1;
        const float value = x[id];
        x[id] = value > 0.0f ? value / penalty : value * penalty;
    }
}

void unmark(const int64_t* ids, int64_t n, int64_t vocab, uint8_t* seen) {
    for (int64_t i = 0; i < n; ++i)
        if (in_vocab(ids[i], vocab)) seen[ids[i]] = 0;
}

void count_penalty(float* x, int64_t vocab, const int64_t* ids, int64_t n, float presence, float frequency,
                   int32_t* counts) {
    for (int64_t i = 0; i < n; ++i)
        if (in_vocab(ids[i], vocab)) ++counts[ids[i]];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t id = ids[i];
        if (!in_vocab(id, vocab) || counts[id] == 0) continue;
        // volatile: the product is rounded to float on its own, as torch's frequency * counts is, and not
        // contracted with the sum into one fused multiply-add
        volatile float product = frequency * static_cast<float>(counts[id]);
        counts[id] = 0;
        x[id] -= product + presence;
    }
}

}  // namespace

extern "C" {

// x [rows, vocab] float32, in place. Additions: num_adds (row, id) pairs in add_cells [num_adds, 2] and their
// values. Penalized rows, num_penalized of them, each row once: per row in `penalized` [num_penalized, 6] its row,
// the address and length of its prompt ids (int64), the address and length of its output ids (int64), and its
// flags (kRepetition, kCounts: which penalties it takes); in `penalties` [num_penalized, 3] its repetition,
// presence and frequency penalties.
void pagedserve_logit_processors(float* x, int64_t rows, int64_t vocab, int64_t num_adds, const int64_t* add_cells,
                                 const float* add_values, int64_t num_penalized, const int64_t* penalized,
                                 const float* penalties) {
    for (int64_t i = 0; i < num_adds; ++i) {
        const int64_t row = add_cells[2 * i], id = add_cells[2 * i + 1];
        if (row >= 0 && row < rows && in_vocab(id, vocab)) x[row * vocab + id] += add_values[i];
    }
    int64_t total_ids = 0;
    for (int64_t i = 0; i < num_penalized; ++i) total_ids += penalized[6 * i + 2] + penalized[6 * i + 4];
#pragma omp parallel for schedule(dynamic, 1) if (num_penalized > 1 && total_ids >= kParallelMinIds)
    for (int64_t i = 0; i < num_penalized; ++i) {
        const int64_t* entry = penalized + 6 * i;
        const int64_t row = entry[0];
        if (row < 0 || row >= rows) continue;
        const auto* prompt = reinterpret_cast<const int64_t*>(entry[1]);
        const auto* output = reinterpret_cast<const int64_t*>(entry[3]);
        const int64_t prompt_len = prompt != nullptr ? entry[2] : 0, output_len = output != nullptr ? entry[4] : 0;
        const float repetition = penalties[3 * i], presence = penalties[3 * i + 1], frequency = penalties[3 * i + 2];
        float* xr = x + row * vocab;
        ColumnScratch& scratch = thread_scratch(vocab);
        if (entry[5] & kRepetition) {
            repeat_penalty(xr, vocab, prompt, prompt_len, repetition, scratch.seen.data());
            repeat_penalty(xr, vocab, output, output_len, repetition, scratch.seen.data());
            unmark(prompt, prompt_len, vocab, scratch.seen.data());
            unmark(output, output_len, vocab, scratch.seen.data());
        }
        if (entry[5] & kCounts)
            count_penalty(xr, vocab, output, output_len, presence, frequency, scratch.counts.data());
    }
}
}
