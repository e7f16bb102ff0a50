"""Rank processes for the all-reduce tests: spawned, so module-level and light to import."""

from __future__ import annotations

import os
import time
from multiprocessing.queues import Queue
from typing import Optional

import torch

from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.shm_all_reduce import AllReduceHandle

SIZES = [(1,), (2048,), (16, 2048), (3, 1000), (257, 2048)]  # the last is larger than the tests' buffers
DTYPES = [torch.float32, torch.bfloat16]


def partial(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input: the same on every run, different on every rank."""
    generator = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randn(shape, generator=generator).to(dtype)


def reduce_all(rank: int, world: int, port: int, handle: AllReduceHandle, results: Queue) -> None:
    """Every (size, dtype) through the shared-memory all-reduce and all-gather and through gloo's; report all."""
    device = torch.device("cpu")
    group = ParallelGroup.join(rank, world, f"tcp://127.0.0.1:{port}", device, 30, handle)
    gloo = ParallelGroup(rank, world)  # the same process group, without the shared memory
    report = {}
    try:
        for shape in SIZES:
            for dtype in DTYPES:
                shm = group.all_reduce(partial(rank, shape, dtype))
                strided = partial(rank, shape[::-1], dtype).t()  # not contiguous: reduced through a copy
                report[(shape, str(dtype), "strided")] = group.all_reduce(strided).clone()
                report[(shape, str(dtype), "shm")] = shm
                report[(shape, str(dtype), "gloo")] = gloo.all_reduce(partial(rank, shape, dtype))
                report[(shape, str(dtype), "shm gather")] = group.all_gather(partial(rank, shape, dtype))
                report[(shape, str(dtype), "gloo gather")] = gloo.all_gather(partial(rank, shape, dtype))
    finally:
        group.leave()
    # As float32 arrays (bf16 widens exactly): a tensor in a queue is shared by a file descriptor that dies
    # with this process.
    results.put((rank, {key: tensor.float().numpy() for key, tensor in report.items()}))


def reduce_until(
    rank: int, handle: AllReduceHandle, results: Queue, die_after: Optional[int], calls: int = 1000
) -> None:
    """Reduce [16, 2048] float32 `calls` times; rank `die_after`'s call count ends the process (os._exit) when
    given; report how the loop ended and how long the failing call took."""
    comm = handle.open(rank)
    tensor = torch.ones(16, 2048)
    for call in range(calls):
        if die_after is not None and call == die_after:
            os._exit(3)
        start = time.monotonic()
        try:
            comm.all_reduce(tensor.fill_(1.0))
        except Exception as error:
            results.put((rank, type(error).__name__, str(error), time.monotonic() - start, call))
            comm.close()
            return
    results.put((rank, "done", "", 0.0, calls))
    comm.close()
