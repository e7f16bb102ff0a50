"""The engine's OpenMP team size, adapted to what other processes leave of its CPUs.

An OpenMP team splits each operator evenly over its threads and waits for the slowest at the end; when another
process holds one of the team's CPUs, the thread there gets a fraction of it and every parallel region waits for
it. Measured on 2 cores with one busy neighbour process (docs/performance.md): a decode step on 2 threads took
3-6x its quiet time whatever the spin-wait, on 1 thread 1.7x. So between steps, about once a second, the engine
looks at the last second:

    waited  CPUs' worth of time this process's threads were runnable but not running   (/proc/self/task/*/schedstat)
    idle    CPUs' worth of time the affinity mask's CPUs were idle                      (/proc/stat)

    waited > SPARE, 2 s in a row   the team gives up ceil(waited - SPARE) threads (at least 1 left)
    idle > 1 - SPARE               it takes back floor(idle + SPARE) threads (at most the budget)
    PROBE_S after giving up        it tries one more; kept unless its threads wait (then the next try waits twice
                                   as long)

Waiting, not other processes' CPU time, says the team is held up: a process that only runs on CPUs the team leaves
idle costs it nothing. Only when the thread count came from the machine (not `--cpu-threads` or OMP_NUM_THREADS,
which fix it), with one process (tensor-parallel ranks keep their shares) and outside batch-invariant mode. The
reads cost ~0.1 ms a second.
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
IDLE_GAP_S = 3.0
PROBE_S = 10.0
"""After giving up threads, the team tries one more this long after (other processes may fill the CPUs it left
idle with work that yields to it, so idling alone cannot tell that they are free again); each failed try doubles
the wait, up to PROBE_MAX_S: on a machine that stays busy, a second of the larger team every few minutes."""
PROBE_MAX_S = 160.0
SPARE = 0.4
"""CPUs' worth of waiting tolerated before the team gives up a thread (a few percent: the server's own threads
taking turns; a neighbour taking its fair half of one of the team's CPUs: 0.55-0.8 measured), and of idling kept
before it takes one back."""
STRAINED_CHECKS = 2
"""Consecutive seconds of waiting before the team gives up threads: a burst (start-up, another process's short
job) is not a neighbour."""


class CpuSample(NamedTuple):
    idle: int  # ticks the mask's CPUs were idle (idle + iowait)
    total: int  # ticks of the mask's CPUs
    waited_ns: int  # this process's threads' time runnable but not running


def parse_idle_ticks(proc_stat: str, cpus: frozenset[int]) -> tuple[int, int]:
    """(idle, total) ticks of the CPUs in `cpus`, from /proc/stat's "cpuN user nice system idle iowait ..." lines."""
    idle = total = 0
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        ticks = [int(value) for value in rest.split()[:8]]
        total += sum(ticks)
        idle += ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return idle, total


def parse_wait_ns(schedstats: list[str]) -> int:
    """The summed second fields ("run_ns wait_ns timeslices") of the threads' /proc/self/task/*/schedstat."""
    return sum(int(fields[1]) for fields in (text.split() for text in schedstats) if len(fields) > 1)


def next_team(threads: int, budget: int, waited_cpus: float, idle_cpus: float) -> int:
    """The team after a second in which the threads waited `waited_cpus` and the CPUs idled `idle_cpus`."""
    if waited_cpus > SPARE:
        return max(1, threads - math.ceil(waited_cpus - SPARE))
    if idle_cpus > 1 - SPARE:
        return min(budget, threads + math.floor(idle_cpus + SPARE))
    return threads


class ThreadGovernor:
    """Called by the engine thread after each step; changes that thread's team size (`set_threads`, e.g.
    torch.set_num_threads) when its threads wait for CPUs or CPUs idle (see above). Logs each change."""

    def __init__(
        self,
        budget: int,
        set_threads: Callable[[int], None],
        cpus: Optional[frozenset[int]] = None,
        read: Callable[[Path], str] = lambda path: path.read_text(),
        clock: Callable[[], float] = time.monotonic,
        list_dir: Callable[[Path], list[Path]] = lambda path: list(path.iterdir()),
    ):
        self.budget = budget
        self.threads = budget
        self._set_threads = set_threads
        self._cpus = cpus if cpus is not None else frozenset(os.sched_getaffinity(0))
        self._read = read
        self._clock = clock
        self._list = list_dir
        self._last: Optional[tuple[float, CpuSample]] = None
        self._backoff_s = PROBE_S
        self._next_probe = 0.0
        self._probing = False
        self._strained = 0

    def after_step(self) -> None:
        now = self._clock()
        if self._last is not None and now - self._last[0] < CHECK_INTERVAL_S:
            return
        try:
            sample = self._sample()
        except (OSError, ValueError):  # (no procfs: the team stays as it is)
            return
        last, self._last = self._last, (now, sample)
        seconds = now - last[0] if last is not None else 0.0
        if last is None or sample.total <= last[1].total or seconds > IDLE_GAP_S:
            return  # (after a pause without steps, the CPUs' idling says nothing of the team: a fresh start)
        waited = (sample.waited_ns - last[1].waited_ns) / 1e9 / seconds
        idle = len(self._cpus) * (sample.idle - last[1].idle) / (sample.total - last[1].total)
        wanted = next_team(self.threads, self.budget, waited, idle)
        self._strained = self._strained + 1 if wanted < self.threads else 0
        if wanted < self.threads and self._strained < STRAINED_CHECKS and not self._probing:
            wanted = self.threads  # (a try that fails gives its thread back at once)
        probing = False
        if wanted < self.threads:
            if self._probing:  # the try failed: wait longer before the next
                self._backoff_s = min(2 * self._backoff_s, PROBE_MAX_S)
            self._next_probe = now + self._backoff_s
        elif wanted == self.threads < self.budget and now >= self._next_probe:
            wanted, probing = self.threads + 1, True
        elif self._probing:  # the try held
            self._backoff_s = PROBE_S
            self._next_probe = now + PROBE_S
        self._probing = probing
        if wanted != self.threads:
            logger.info(
                "CPU threads: %d -> %d (%s; threads waited %.2f CPUs, CPUs idle %.2f, over the last %.1f s)",
                self.threads,
                wanted,
                "trying one more" if probing else "adapted",
                waited,
                idle,
                seconds,
            )
            self.threads = wanted
            self._set_threads(wanted)

    def _sample(self) -> CpuSample:
        idle, total = parse_idle_ticks(self._read(Path("/proc/stat")), self._cpus)
        tasks = Path("/proc/self/task")
        stats = []
        for task in self._list(tasks):
            try:
                stats.append(self._read(task / "schedstat"))
            except OSError:  # a thread that ended meanwhile
                pass
        return CpuSample(idle, total, parse_wait_ns(stats))
