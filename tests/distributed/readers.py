"""Reader processes for the broadcast tests: spawned, so module-level and light to import."""

from __future__ import annotations

from multiprocessing.queues import Queue

from engine.distributed.shm_broadcast import BroadcastClosed, BroadcastHandle


def collect(handle: BroadcastHandle, index: int, results: Queue, timeout: float) -> None:
    """Dequeue until the writer closes; report (index, the messages, how it ended)."""
    received: list[object] = []
    with handle.open(index) as reader:
        try:
            while True:
                received.append(reader.dequeue(timeout=timeout))
        except BroadcastClosed:
            ending = "closed"
        except TimeoutError:
            ending = "timeout"
    results.put((index, received, ending))
