// Work items [0, n) of a product shared by the threads of an OpenMP team, each thread streaming one contiguous run.
//
// A guided or dynamic schedule hands out chunks from one shared counter: every chunk is an atomic on a cache line
// the threads pass back and forth, and a thread's chunks jump over the others', restarting the prefetchers' stream.
// A static split has neither cost, but a thread that another process preempts holds the whole team back (behind a
// server on 2 cores, the event loop shares a core with one of the threads). Here each thread
// owns a contiguous share and takes its items front to back, a few at a time, with an atomic on a line of its own;
// a thread whose share is done takes items from the back of the others' shares, so a late or preempted thread's
// items still go to the one that runs.
//
// Each share's cursor is one word: an epoch (which call of `run` it belongs to), the front and the back. A thread
// that finds a cursor of an earlier call sets it to this call's share first, whether it owns it or not: the first
// thread there does it, and a thread that has not arrived yet cannot hold the others back. Every thread counts its
// calls, so the threads agree on the epoch when each of them makes every call, as an orphaned `omp for` requires;
// thread 0 brings the counts of the slots its team leaves unused along, so a later, larger team agrees too.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace pagedserve {

class TeamSplit {
  public:
    // The threads of a team started here, now.
    static int64_t team_size() {
#if defined(_OPENMP)
        return omp_get_max_threads();
#else
        return 1;
#endif
    }

    // Before a team uses it, from outside the team: room for `threads` threads (by default as many as a team started
    // here would have), every cursor and count cleared.
    void reset(int64_t threads = team_size()) {
        if (threads > capacity_) {
            slots_ = std::make_unique<Slot[]>(threads);
            capacity_ = threads;
        }
        for (int64_t t = 0; t < capacity_; ++t) {
            slots_[t].cursor.store(0, std::memory_order_relaxed);
            slots_[t].calls = 0;
        }
    }

    // Calls body(begin, end) on runs of items of [0, n), `step` items at most, until every item is done, then waits
    // for the team (a barrier). Call it from every thread of a team, each making the same calls in the same order,
    // or from outside one, after `reset` (a team larger than it was told takes a guided loop).
    template <typename Body>
    void run(int64_t n, int64_t step, Body&& body) {
        step = std::max<int64_t>(step, 1);
        int64_t threads = 1, me = 0;
#if defined(_OPENMP)
        threads = omp_get_num_threads();
        me = omp_get_thread_num();
#endif
        // one thread, a team larger than `reset` was told, or more items than a cursor counts: every thread of the
        // team takes this branch alike (and the epochs stay in step)
        if (threads == 1 || threads > capacity_ || n >= kMaxItems) {
#pragma omp for schedule(guided, 1)
            for (int64_t i = 0; i < n; ++i) body(i, i + 1);
            return;
        }
        const uint64_t epoch = (++slots_[me].calls % kEpochs) + 1;  // 0: a cleared cursor
        if (me == 0)  // slots no thread of this team uses: their counts kept with the team's, their cursors cleared
            for (int64_t t = threads; t < capacity_; ++t) {
                slots_[t].calls = slots_[0].calls;
                slots_[t].cursor.store(0, std::memory_order_relaxed);
            }
        auto take = [&](int64_t share, bool front, int64_t* begin, int64_t* end) -> bool {
            std::atomic<uint64_t>& cursor = slots_[share].cursor;
            uint64_t word = cursor.load(std::memory_order_acquire);
            for (;;) {
                if (word >> 48 != epoch) {  // a cursor of an earlier call: this call's share, as its owner would set it
                    const uint64_t fresh = pack(epoch, share * n / threads, (share + 1) * n / threads);
                    if (cursor.compare_exchange_weak(word, fresh, std::memory_order_acq_rel)) word = fresh;
                    continue;
                }
                const int64_t first = static_cast<int64_t>((word >> 24) & (kMaxItems - 1));
                const int64_t last = static_cast<int64_t>(word & (kMaxItems - 1));
                if (first >= last) return false;
                *begin = front ? first : std::max(first, last - step);
                *end = front ? std::min(last, first + step) : last;
                const uint64_t next = front ? pack(epoch, *end, last) : pack(epoch, first, *begin);
                if (cursor.compare_exchange_weak(word, next, std::memory_order_acq_rel)) return true;
            }
        };
        int64_t begin, end;
        while (take(me, true, &begin, &end)) body(begin, end);
        for (int64_t other = 1; other < threads; ++other) {
            const int64_t share = (me + other) % threads;
            while (take(share, false, &begin, &end)) body(begin, end);
        }
#pragma omp barrier
    }

  private:
    static constexpr int64_t kMaxItems = int64_t{1} << 24;  // front and back: 24 bits each
    static constexpr uint64_t kEpochs = (uint64_t{1} << 16) - 1;

    static uint64_t pack(uint64_t epoch, int64_t front, int64_t back) {
        return epoch << 48 | static_cast<uint64_t>(front) << 24 | static_cast<uint64_t>(back);
    }

    struct alignas(64) Slot {  // a line per thread: its share's cursor, and its count of calls
        std::atomic<uint64_t> cursor{0};
        uint64_t calls = 0;
    };
    std::unique_ptr<Slot[]> slots_;
    int64_t capacity_ = 0;
};

}  // namespace pagedserve
