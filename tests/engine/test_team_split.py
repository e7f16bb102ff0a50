"""How the CPU products share their items over a team (csrc/team_split.h): every item runs exactly once in every
call, others take a thread's share only from its back, and a late thread's items go to the threads that are there."""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import pytest


def _trace(cpu_kernels, n: int, step: int, calls: int, teams: Sequence[int], late: int = -1, late_us: int = 0):
    """(runner, counts) [len(teams) * calls, n]: which thread ran each item of each call, and how many times."""
    lib = ctypes.CDLL(str(cpu_kernels.path))
    trace = lib.pagedserve_team_split_trace
    trace.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
    trace.restype = None
    sizes = np.asarray(teams, dtype=np.int64)
    runner = np.full((len(teams) * calls, max(n, 1)), -1, dtype=np.int32)
    counts = np.zeros((len(teams) * calls, max(n, 1)), dtype=np.int32)
    trace(n, step, calls, sizes.ctypes.data, len(teams), late, late_us, runner.ctypes.data, counts.ctypes.data)
    return runner[:, :n], counts[:, :n]


def _owner(item: int, n: int, threads: int) -> int:
    return next(t for t in range(threads) if t * n // threads <= item < (t + 1) * n // threads)


@pytest.mark.parametrize(
    "n, step, threads",
    [(1, 1, 2), (5, 2, 4), (36, 2, 2), (60, 2, 3), (191, 4, 2), (1000, 1, 4), (7, 16, 2), (9, 0, 2)],
)
def test_every_item_runs_once_in_every_call(cpu_kernels, n, step, threads):
    runner, counts = _trace(cpu_kernels, n, step, calls=50, teams=[threads])
    assert (counts == 1).all()
    assert set(np.unique(runner)) <= set(range(threads))


def test_no_items(cpu_kernels):
    runner, counts = _trace(cpu_kernels, 0, 2, calls=10, teams=[2])
    assert counts.size == 0


def test_one_thread_runs_everything(cpu_kernels):
    runner, counts = _trace(cpu_kernels, 100, 3, calls=5, teams=[1])
    assert (counts == 1).all() and (runner == 0).all()


def test_teams_of_different_sizes_share_one_split(cpu_kernels):
    # a thread a smaller team leaves out must still agree with the others on which call is which
    runner, counts = _trace(cpu_kernels, 97, 2, calls=20, teams=[3, 2, 3, 1, 4, 2, 4])
    assert (counts == 1).all()


def test_the_call_count_wraps(cpu_kernels):
    # a cursor keeps 16 bits of its call's number: past 65,535 calls it starts again, never at a cleared cursor's 0
    runner, counts = _trace(cpu_kernels, 3, 1, calls=70_000, teams=[2])
    assert (counts == 1).all()


def test_a_late_thread_s_items_go_to_the_others(cpu_kernels):
    n, calls = 64, 10
    # thread 1 sleeps 5 ms before every call: thread 0 does its own share, then takes thread 1's from the back
    runner, counts = _trace(cpu_kernels, n, 1, calls=calls, teams=[2], late=1, late_us=5000)
    assert (counts == 1).all()
    late_share = [i for i in range(n) if _owner(i, n, 2) == 1]
    taken = sum(int(runner[c, i] == 0) for c in range(calls) for i in late_share)
    assert taken >= calls * len(late_share) // 4


def test_others_take_a_share_only_from_its_back(cpu_kernels):
    n, threads = 400, 3
    runner, counts = _trace(cpu_kernels, n, 4, calls=30, teams=[threads])
    assert (counts == 1).all()
    for row in runner:
        for share in range(threads):
            owned = row[share * n // threads : (share + 1) * n // threads]
            taken = np.flatnonzero(owned != share)
            if taken.size:
                assert (owned[taken[0] :] != share).all()
