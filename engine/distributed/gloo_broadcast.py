"""Rank 0's step messages to ranks on other hosts: a pickle broadcast over a gloo group of their own.

Used when the ranks span hosts (--nnodes > 1), where the shared-memory ring (shm_broadcast.py) cannot reach. The
group is separate from the model's collectives and waits without a deadline: an idle server sends nothing, and
a peer that dies closes its connections, which fails the waits at once."""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=365)
"""The step group's wait: an idle server may send nothing for as long as it runs."""


class BroadcastClosedByRankZero(EOFError):
    """Rank 0 closed the broadcast (the engine shuts down)."""


_CLOSED = "__pagedserve_broadcast_closed__"


class GlooBroadcast:
    """Every rank builds one, in the same order after joining the process group (it makes a group of its own)."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.closed = False

    def enqueue(self, obj: Any) -> None:
        """Rank 0: send `obj` to every other rank (returns once they all have it)."""
        dist.broadcast_object_list([obj], src=0, group=self.group)

    def dequeue(self) -> Any:
        """Another rank: the next object rank 0 sends; BroadcastClosedByRankZero once it closed."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if box[0] == _CLOSED:
            raise BroadcastClosedByRankZero()
        return box[0]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.enqueue(_CLOSED)
