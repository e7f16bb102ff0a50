"""PLACEHOLDER (replaced by the shared-memory ring on merge): one writer, N readers, every message to each."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
from typing import Any, Optional


class ShmBroadcastQueue:
    def __init__(self, queues, index: Optional[int] = None):
        self._queues = queues
        self._index = index

    @classmethod
    def create(cls, num_readers: int) -> "ShmBroadcastQueue":
        ctx = mp.get_context("spawn")
        return cls([ctx.Queue() for _ in range(num_readers)])

    @property
    def handle(self):
        return self._queues

    @classmethod
    def open(cls, handle, reader_index: int) -> "ShmBroadcastQueue":
        return cls(handle, reader_index)

    def enqueue(self, obj: Any) -> None:
        for q in self._queues:
            q.put(obj)

    def dequeue(self, timeout: Optional[float] = None) -> Any:
        assert self._index is not None
        try:
            return self._queues[self._index].get(timeout=timeout)
        except queue_module.Empty:
            raise TimeoutError from None

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
