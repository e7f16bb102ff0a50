"""Which CPUs each tensor-parallel rank runs on, and how many threads it uses: the CPUs this process may use (its
affinity mask) split into contiguous chunks, one per rank, so ranks do not take each other's cores (and, on a
multi-socket host, a rank's chunk tends to stay on one socket), with threads capped by the engine's thread count
(`--cpu-threads`, by default min(affinity mask, cgroup CPU quota): engine/cpu_threads.py) split among the ranks.

    mask {0..7}, 2 ranks         rank 0: CPUs 0-3, 4 threads    rank 1: CPUs 4-7, 4 threads
    mask {0..6}, 2 ranks         rank 0: CPUs 0-3 (the spare CPU: rank 0 also schedules and samples)
    mask {0..7}, 2 threads       pinned as above, 1 thread each (a quota of 2 CPUs: more threads only queue)
    mask {0}, 2 ranks            not pinned (fewer CPUs than ranks: pinning would stack ranks on one CPU)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True, slots=True)
class RankCpus:
    """One rank's share: `cpus` to pin to (None: not pinned, `reason` says why), and its thread count."""

    cpus: Optional[tuple[int, ...]]
    threads: int
    reason: str

    def describe(self, rank: int) -> str:
        where = f"CPUs {_ranges(self.cpus)}" if self.cpus is not None else "not pinned"
        return f"tp rank {rank}: {where}, {self.threads} thread(s) ({self.reason})"


def plan_rank_cpus(mask: set[int], world_size: int, threads: Optional[int]) -> list[RankCpus]:
    """Each rank's CPUs and threads, from the affinity mask and the engine's thread count (None: the mask's)."""
    cpus = sorted(mask)
    budget = None if threads is None else max(threads // world_size, 1)
    if len(cpus) < world_size:
        threads = 1
        reason = f"{len(cpus)} CPU(s) in the affinity mask for {world_size} ranks"
        return [RankCpus(None, threads, reason)] * world_size
    share = len(cpus) // world_size
    spare = len(cpus) - share * world_size
    plan = []
    start = 0
    for rank in range(world_size):
        size = share + (spare if rank == 0 else 0)
        chunk = tuple(cpus[start : start + size])
        start += size
        threads = len(chunk) if budget is None else min(len(chunk), budget)
        reason = "affinity mask split" if budget is None or budget >= len(chunk) else f"{threads} CPU threads"
        plan.append(RankCpus(chunk, threads, reason))
    return plan


def process_cpus() -> set[int]:
    return set(os.sched_getaffinity(0))


def pin_process(cpus: set[int] | tuple[int, ...]) -> None:
    """Pin every thread of this process to `cpus` (threads started later inherit it from their creator): the
    intra-op threads torch already started included, which pinning only the calling thread would miss."""
    tasks = Path("/proc/self/task")
    tids = [int(entry.name) for entry in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def _ranges(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'"""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
