"""A background thread that writes block files, so that the step loop never waits for the disk."""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from scheduler.kv_tier_file import BlockFileKey, write_block_file

logger = logging.getLogger(__name__)


class BlockWriter:
    """Writes `(key, payload)` in the order queued; a payload copied from a CUDA cache carries the event after
    which its host copy is complete. A failed write is logged and skipped: the block is missing from the
    tier, which the scheduler's index finds out when it next looks for it."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.written_bytes = 0
        self.failed_writes = 0
        self._queue: queue.Queue[Optional[tuple[list[BlockFileKey], torch.Tensor, Optional[torch.cuda.Event]]]] = (
            queue.Queue()
        )
        self._thread: Optional[threading.Thread] = None

    def put(self, keys: list[BlockFileKey], payloads: torch.Tensor, ready: Optional[torch.cuda.Event]) -> None:
        """Queue the files of `keys`, whose payloads are the rows of `payloads` [len(keys), bytes] (host)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
            self._thread.start()
        self._queue.put((keys, payloads, ready))

    def flush(self) -> None:
        """Wait until every queued file is written."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                keys, payloads, ready = item
                if ready is not None:
                    ready.synchronize()
                rows: np.ndarray = payloads.numpy()
                for key, row in zip(keys, rows):
                    try:
                        self.written_bytes += write_block_file(self.directory, key, memoryview(row))
                    except OSError as error:
                        self.failed_writes += 1
                        logger.warning("KV disk tier: cannot write block %s: %s", key.block_hash.hex()[:16], error)
            finally:
                self._queue.task_done()
