"""The engine's OpenMP team size, adapted to what other processes leave of its CPUs.

An OpenMP team splits each operator evenly over its threads and waits for the slowest at the end; when another
process holds one of the team's CPUs, the thread there gets a fraction of it and every parallel region waits for
it. Measured on 2 cores with one busy neighbour process (docs/performance.md): a decode step on 2 threads took
4-6x its quiet time whatever the spin-wait, on 1 thread 1.7x. So between steps, about once a second, the engine
reads how much CPU time the rest of the machine took on its CPUs and runs on the CPUs left:

    others = (busy time of the mask's CPUs - this process's CPU time) / interval       (/proc/stat, /proc/self/stat)
    team   = CPUs in the mask - ceil(others - SPARE), within 1 .. the thread budget

Only when the thread count came from the machine (not `--cpu-threads` or OMP_NUM_THREADS, which fix it), with
one process (tensor-parallel ranks keep their shares) and outside batch-invariant mode (whose kernels keep one
order per thread count). Reading the two files costs ~0.1 ms a second.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
SPARE = 0.35
"""CPUs of other processes' time tolerated before the team gives up a CPU: background noise (a few percent) keeps
the full team; a neighbour that takes half a CPU from a full team (its fair share) costs it one thread."""


class CpuTicks(NamedTuple):
    busy: int  # ticks the mask's CPUs were not idle (any process, steal included)
    total: int  # ticks of the mask's CPUs
    own: int  # ticks this process ran (user + system)


def parse_cpu_ticks(proc_stat: str, self_stat: str, cpus: frozenset[int]) -> CpuTicks:
    """Tick counts from /proc/stat's "cpuN user nice system idle iowait irq softirq steal ..." lines of the CPUs
    in `cpus` and /proc/self/stat's utime and stime (fields 14 and 15, after the parenthesised command name)."""
    busy = total = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(value) for value in rest.split()[:8]]
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)  # minus idle and iowait
    fields = self_stat.rpartition(")")[2].split()
    own = int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0  # utime, stime (fields 14, 15)
    return CpuTicks(busy, total, own)


def others_cpus(before: CpuTicks, after: CpuTicks, num_cpus: int) -> Optional[float]:
    """CPUs' worth of time other processes took on the mask's CPUs between the two readings; None when no time
    passed."""
    total = after.total - before.total
    if total <= 0 or num_cpus <= 0:
        return None
    interval = total / num_cpus  # ticks per CPU
    return max(0, (after.busy - before.busy) - (after.own - before.own)) / interval


def team_size(others: float, num_cpus: int, budget: int) -> int:
    """The team that runs on the CPUs other processes leave (within 1 .. budget)."""
    return max(1, min(budget, num_cpus - math.ceil(others - SPARE)))


class ThreadGovernor:
    """Called by the engine thread after each step; changes that thread's team size (`set_threads`, e.g.
    torch.set_num_threads) when the CPUs left to it change. Logs each change."""

    def __init__(
        self,
        budget: int,
        set_threads: Callable[[int], None],
        cpus: Optional[frozenset[int]] = None,
        read: Callable[[Path], str] = lambda path: path.read_text(),
        clock: Callable[[], float] = time.monotonic,
    ):
        self.budget = budget
        self.threads = budget
        self._set_threads = set_threads
        self._cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._read = read
        self._clock = clock
        self._last: Optional[tuple[float, CpuTicks]] = None

    def after_step(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < CHECK_INTERVAL_S:
            return
        try:
            ticks = parse_cpu_ticks(self._read(Path("/proc/stat")), self._read(Path("/proc/self/stat")), self._cpus)
        except (OSError, ValueError):  # (no procfs: the team stays as it is)
            return
        last, self._last = self._last, (now, ticks)
        if last is None:
            return
        others = others_cpus(last[1], ticks, len(self._cpus))
        if others is None:
            return
        wanted = team_size(others, len(self._cpus), self.budget)
        if wanted != self.threads:
            logger.info(
                "CPU threads: %d -> %d (other processes took %.2f of the %d CPUs)",
                self.threads,
                wanted,
                others,
                len(self._cpus),
            )
            self.threads = wanted
            self._set_threads(wanted)
