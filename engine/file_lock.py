"""An advisory lock between processes (and threads) that build the same cached file: the GGUF conversion, the
native kernels. Each builder also publishes by an atomic rename, so where the lock is missing (no fcntl) two
builders only do the work twice."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Held while the block runs (flock on `lock_path`, created if absent and left in place: removing it would
    let a later builder lock a new file while a waiter holds the old one)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
