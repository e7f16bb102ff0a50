"""The ranks rank 0 launched, however they run: the seam between how tensor-parallel ranks start (worker
processes of this host: engine/tp_workers.py; Ray actors: engine/ray_workers.py) and how rank 0 waits for them,
watches them and ends them."""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.rendezvous import wait_for_ranks
from engine.distributed.shm_all_reduce import AllReduceHandle


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank ended while the engine needed it (its process exited, its Ray actor died)."""

    def __init__(self, name: str, exitcode: Optional[int], how: Optional[str] = None):
        rank = name.removeprefix("pagedserve-tp")
        how = how if how is not None else f"exited with code {exitcode}"
        super().__init__(f"tensor-parallel worker rank {rank} ({name}) {how}")


class LaunchedRanks(Protocol):
    """Ranks rank 0 started (some or all of 1 .. N-1)."""

    def describe(self) -> str:
        """Where they run, for the start-up log."""
        ...

    def wait_ended(self, timeout_s: float) -> Optional[WorkerDiedError]:
        """Wait up to `timeout_s` for one of them to end: why it did (each rank reported once), None if none did."""
        ...

    def end(self, wait_s: float) -> None:
        """Give them up to `wait_s` to leave (after rank 0 closed the broadcast), then kill any left."""
        ...


def join_as_rank_zero(
    store: dist.TCPStore,
    tp_size: int,
    num_stages: int,
    ranks: LaunchedRanks,
    device: torch.device,
    timeout_s: float,
    shm: Sequence[Optional[AllReduceHandle]] = (),
) -> ParallelGroup:
    """Wait for every other rank's check-in at `store` while watching the launched ones (one that ends before it
    joined fails the start at once, not after `timeout_s`), then join the group as rank 0 (its stage's
    tensor-parallel group back; `shm`: each stage's shared-memory all-reduce)."""
    world_size = tp_size * num_stages

    def check_launched(seconds: float) -> None:
        died = ranks.wait_ended(seconds)
        if died is not None:
            raise died

    wait_for_ranks(store, world_size, timeout_s, check_launched)
    return ParallelGroup.join_stage(0, tp_size, num_stages, store, device, timeout_s, shm)
