// team_split.h's work sharing, exported for its tests (tests/engine/test_team_split.py): teams of given sizes, one
// after the other, run one TeamSplit over n items `calls` times each, one thread arriving late to every call, and
// each item's runs are counted.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include "team_split.h"

extern "C" {
// Team k (teams[k] threads) makes calls k * calls .. (k + 1) * calls - 1 on a split reset once, for the largest team.
// runner[c * n + i]: the thread that ran item i of call c; counts[c * n + i]: how many times it ran. Thread `late`
// (-1: none) sleeps `late_us` microseconds before each call.
void pagedserve_team_split_trace(int64_t n, int64_t step, int64_t calls, const int64_t* teams, int64_t num_teams,
                                 int64_t late, int64_t late_us, int32_t* runner, int32_t* counts) {
    pagedserve::TeamSplit split;
    split.reset(*std::max_element(teams, teams + num_teams));
    for (int64_t team = 0; team < num_teams; ++team) {
#pragma omp parallel num_threads(teams[team])
        for (int64_t call = team * calls; call < (team + 1) * calls; ++call) {
            int32_t me = 0;
#if defined(_OPENMP)
            me = omp_get_thread_num();
#endif
            if (me == late) std::this_thread::sleep_for(std::chrono::microseconds(late_us));
            split.run(n, step, [&](int64_t first, int64_t last) {
                for (int64_t i = first; i < last; ++i) {
                    __atomic_fetch_add(counts + call * n + i, 1, __ATOMIC_RELAXED);
                    __atomic_store_n(runner + call * n + i, me, __ATOMIC_RELAXED);
                }
            });
        }
    }
}
}
