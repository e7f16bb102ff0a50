"""What the distributed tests share: the session's tiny Llama, free ports, and no shared memory left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.reliability.conftest import tiny_model_dir  # noqa: F401 - the session's tiny Llama (4 heads, 2 KV)

SHM = Path("/dev/shm")


def our_segments(prefix: str) -> set[str]:
    """This process's shared-memory segments named with `prefix` (the modules name theirs `<prefix><pid>_...`)."""
    return {p.name for p in SHM.glob(f"{prefix}{os.getpid()}_*")} if SHM.is_dir() else set()


@pytest.fixture(autouse=True)
def no_leaked_segments(request):
    """A test module that names a SEGMENT_PREFIX leaves none of its segments behind, whatever the test did."""
    prefix = getattr(request.module, "SEGMENT_PREFIX", None)
    if prefix is None:
        yield
        return
    before = our_segments(prefix)
    yield
    assert our_segments(prefix) - before == set()
