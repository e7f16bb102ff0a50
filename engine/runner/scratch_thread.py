"""Torch work that should leave no OpenMP thread pool behind: run it on a thread that then exits.

libgomp (the OpenMP runtime behind torch's CPU operators and the native kernels) keeps a pool of worker
threads for every thread that ever started a parallel region, for that thread's lifetime. Once it manages
more threads than there are CPUs, it cuts its workers' spin-wait before sleeping from ~300,000 to ~100
iterations (its "throttled" spin count), and each of the engine thread's parallel regions (about a hundred
per decode step) then wakes sleeping workers, which nearly doubled a small model's decode step on 2 cores
(measured in docs/performance.md). So a server loads its model on a scratch thread, and the engine thread's pool is the
only one left.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def run_on_scratch_thread(function: Callable[[], T], name: str = "pagedserve-load") -> T:
    """`function()` on a new thread, joined; its result, or its exception re-raised here."""
    result: list = []
    error: list = []

    def run() -> None:
        try:
            result.append(function())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            error.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
