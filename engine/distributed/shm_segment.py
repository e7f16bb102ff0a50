"""Named shared-memory segments between the processes of one host: the owner creates (and later unlinks) one,
the other processes attach to it by name."""

from __future__ import annotations

import os
import secrets
from multiprocessing import resource_tracker, shared_memory
from unittest import mock


def create_segment(prefix: str, size: int) -> shared_memory.SharedMemory:
    """A new segment named `prefix` + this process's pid + a random tag (tests find theirs in /dev/shm by it)."""
    name = f"{prefix}{os.getpid()}_{secrets.token_hex(6)}"
    return shared_memory.SharedMemory(name=name, create=True, size=size)


def segment_buffer(segment: shared_memory.SharedMemory) -> memoryview:
    buf = segment.buf
    assert buf is not None, "the segment is closed"
    return buf


def _no_register(name: str, rtype: str) -> None:
    pass


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open the owner's segment without enrolling it in this process's resource tracker. The tracker would
    unlink it when this process exits and report it leaked (Python 3.13 has `track=False` for this); and a
    spawned process shares its parent's tracker, so unregistering after the fact would drop the owner's entry."""
    with mock.patch.object(resource_tracker, "register", _no_register):
        return shared_memory.SharedMemory(name=name)
