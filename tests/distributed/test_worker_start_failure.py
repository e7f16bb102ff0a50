"""A tensor-parallel worker that dies before the group is made (SIGKILLed as soon as it exists, here) fails the
engine's start within seconds with an error naming its rank, not after --distributed-timeout (60 s): rank 0 waits
for the ranks' check-ins in short polls, watching its launched processes between them."""

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


def launched_workers() -> list[int]:
    """The workers: the children of this process's fork server (multiprocessing's, a child of this process)."""
    children: dict[int, list[tuple[int, bytes]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        children.setdefault(ppid, []).append((int(entry.name), cmdline))
    servers = [pid for pid, cmdline in children.get(os.getpid(), []) if b"forkserver" in cmdline]
    return [pid for server in servers for pid, _ in children.get(server, [])]


def test_a_worker_killed_before_the_rendezvous_fails_the_start_fast(tiny_model_dir):
    killed: list[float] = []

    def kill_the_worker_once_launched() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            for pid in launched_workers():  # (a fork checks in some tens of milliseconds after it exists)
                os.kill(pid, signal.SIGKILL)
                killed.append(time.monotonic())
            time.sleep(0.001)

    killer = threading.Thread(target=kill_the_worker_once_launched)
    killer.start()
    try:
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pagedserve-tp1\) exited with code -9"):
            LLM(str(tiny_model_dir), dtype="float32", device="cpu", tensor_parallel_size=2)  # timeout: 60 s
    finally:
        killer.join()
    assert killed
    assert time.monotonic() - killed[0] < 5  # the poll is 0.1 s; the rest is the engine's clean-up
    assert not launched_workers()
