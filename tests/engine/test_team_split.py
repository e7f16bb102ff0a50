"""How the CPU products share their items over a team (csrc/team_split.h): every item runs exactly once in every
call, each thread's run is contiguous, and a late thread's items go to the threads that are there."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest


def _trace(cpu_kernels, n: int, step: int, calls: int, threads: int, late: int = -1, late_us: int = 0):
    lib = ctypes.CDLL(str(cpu_kernels.path))
    trace = lib.pagedserve_team_split_trace
    trace.argtypes = [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 2
    trace.restype = None
    runner = np.full((calls, n), -1, dtype=np.int32)
    counts = np.zeros((calls, n), dtype=np.int32)
    trace(n, step, calls, threads, late, late_us, runner.ctypes.data, counts.ctypes.data)
    return runner, counts


def _share(item: int, n: int, threads: int) -> int:
    return next(t for t in range(threads) if t * n // threads <= item < (t + 1) * n // threads)


@pytest.mark.parametrize(
    "n, step, threads", [(1, 1, 2), (5, 2, 4), (36, 2, 2), (60, 2, 3), (191, 4, 2), (1000, 1, 4), (7, 16, 2)]
)
def test_every_item_runs_once_in_every_call(cpu_kernels, n, step, threads):
    runner, counts = _trace(cpu_kernels, n, step, calls=50, threads=threads)
    assert (counts == 1).all()
    assert set(np.unique(runner)) <= set(range(threads))


def test_one_thread_runs_everything_in_order(cpu_kernels):
    runner, counts = _trace(cpu_kernels, 100, 3, calls=5, threads=1)
    assert (counts == 1).all() and (runner == 0).all()


def test_a_late_thread_s_items_go_to_the_others(cpu_kernels):
    n, threads, calls = 64, 2, 20
    # thread 1 sleeps 2 ms before every call: thread 0 does its own share, then takes thread 1's from the back
    runner, counts = _trace(cpu_kernels, n, 1, calls=calls, threads=threads, late=1, late_us=2000)
    assert (counts == 1).all()
    late_share = [i for i in range(n) if _share(i, n, threads) == 1]
    taken = sum(int(runner[c, i] == 0) for c in range(calls) for i in late_share)
    assert taken > calls * len(late_share) // 2  # most of the late thread's items, in most calls


def test_others_take_a_share_only_from_its_back(cpu_kernels):
    n, threads = 400, 2
    runner, counts = _trace(cpu_kernels, n, 4, calls=30, threads=threads)
    assert (counts == 1).all()
    # a thread only runs items of another share from its back: whatever it took there is a suffix of that share
    for row in runner:
        for share in range(threads):
            owned = row[share * n // threads : (share + 1) * n // threads]
            stolen = np.flatnonzero(owned != share)
            if stolen.size:
                assert (owned[stolen[0] :] != share).all()
