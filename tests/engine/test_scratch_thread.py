"""engine/runner/scratch_thread.py: work on a thread that exits, taking its OpenMP worker threads with it."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.runner.scratch_thread import run_on_scratch_thread


def _threads() -> set[str]:
    """This process's thread ids: sets, not a count, so that another test's thread ending meanwhile (a
    pytest worker runs other files' tests in this process) is not taken for this one's."""
    return set(os.listdir("/proc/self/task"))


def test_returns_the_result_from_another_thread():
    caller = threading.get_ident()
    assert run_on_scratch_thread(lambda: threading.get_ident()) != caller
    assert run_on_scratch_thread(lambda: 41 + 1) == 42


def test_raises_what_the_work_raised():
    def fail():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        run_on_scratch_thread(fail)


@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or torch.get_num_threads() < 2,
    reason="needs Linux /proc and an OpenMP pool of at least 2 threads",
)
def test_its_openmp_workers_leave_with_it():
    before = _threads()

    def parallel_work():
        x = torch.randn(2048, 2048)
        (x @ x).sum()  # a parallel region: the scratch thread gets a pool of OpenMP workers
        return _threads()

    started = run_on_scratch_thread(parallel_work) - before
    assert len(started) >= 2  # the scratch thread and at least one pooled worker
    deadline = time.monotonic() + 5.0
    while started & _threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not started & _threads()
