"""Where the tensor-parallel ranks meet before they make their process group: rank 0's TCP store, at which every
other rank checks in first.

    rank 0 (engine)                              rank r (process or Ray actor)
      host(): the store listens                    starts (imports torch, ...)
      launches ranks 1 .. N-1                      check_in(): connects, sets arrived/r
      wait_for_ranks(): polls arrived/*,           ParallelGroup.join(store): waits for the others
        between polls asks whether a launched
        rank has ended (raises if so)
      ParallelGroup.join(store)  <-- gloo/NCCL -->

torch.distributed's own rendezvous cannot be interrupted: a rank that died before joining (a crash at import, a
SIGKILL, a Ray actor whose node went away) would keep rank 0 waiting for the whole --distributed-timeout. The
check-in keys let rank 0 wait in short polls and fail within a fraction of a second instead."""

from __future__ import annotations

import datetime
import time
from typing import Callable

import torch.distributed as dist

POLL_S = 0.1
"""How long rank 0 waits for check-ins between two looks at the ranks it launched."""
_ARRIVED = "pagedserve/arrived/{}"


def host(address: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0: the store, listening on `port` (0: a free one, read back from `.port`)."""
    return dist.TCPStore(
        address,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def check_in(init_method: str, rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank `rank` > 0: connect to rank 0's store at `init_method` ("tcp://host:port", retrying until `timeout_s`)
    and say it arrived."""
    address, _, port = init_method.removeprefix("tcp://").rpartition(":")
    store = dist.TCPStore(
        address.strip("[]"),
        int(port),
        world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    store.set(_ARRIVED.format(rank), str(rank))
    return store


def wait_for_ranks(
    store: dist.TCPStore, world_size: int, timeout_s: float, check_launched: Callable[[float], None]
) -> None:
    """Rank 0: return once ranks 1 .. world_size - 1 all checked in. Between polls `check_launched(seconds)`
    waits up to that long for a rank rank 0 launched to end and raises if one did; TimeoutError naming the ranks
    still missing after `timeout_s` (e.g. another host's that never started)."""
    keys = [_ARRIVED.format(rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(keys, 1) if not store.check([key])]
            raise TimeoutError(
                f"tensor-parallel rank(s) {', '.join(map(str, missing))} did not join within {timeout_s:g} s "
                f"(--distributed-timeout; rendezvous on port {store.port})"
            )
        check_launched(POLL_S)
