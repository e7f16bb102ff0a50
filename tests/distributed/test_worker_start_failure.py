"""A tensor-parallel worker that dies before the group is made (SIGKILLed while it still imports, here) fails the
engine's start within seconds with an error naming its rank, not after --distributed-timeout (60 s): rank 0 waits
for the ranks' check-ins in short polls, watching its spawned processes between them."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from engine import LLM
from engine.distributed.launched_ranks import WorkerDiedError

pytestmark = pytest.mark.timeout(60)

KILL_AFTER_S = 0.5
"""When the worker dies after it appeared: rank 0 waits for its check-in by then, while it still imports torch
(seconds on a CPU runner)."""


def spawned_workers() -> list[int]:
    """This process's children started by multiprocessing's spawn (the workers; not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == os.getpid() and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


def test_a_worker_killed_before_the_rendezvous_fails_the_start_fast(tiny_model_dir):
    killed: list[float] = []

    def kill_the_worker_once_spawned() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            for pid in spawned_workers():
                time.sleep(KILL_AFTER_S)
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_worker_once_spawned)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pagedserve-tp1\) exited with code -9"):
            LLM(str(tiny_model_dir), dtype="float32", device="cpu", tensor_parallel_size=2)  # timeout: 60 s
    finally:
        killer.join()
    assert killed
    assert time.monotonic() - killed[0] < 5  # the poll is 0.1 s; the rest is the engine's clean-up
    assert not spawned_workers()
