"""A tensor-parallel group: this process's rank among the processes that hold one model's shards, and the
collectives its forward pass needs (the layers' all-reduce, the vocab-parallel logits' all-gather): on CPU through
shared memory between the ranks of the host (`shm_all_reduce.py`) when rank 0 made one, else torch.distributed's
gloo; NCCL on CUDA."""

from __future__ import annotations

import datetime
import importlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from engine.distributed.shm_all_reduce import AllReduceHandle, ShmAllReduce

logger = logging.getLogger(__name__)

# A torch module whose functions take `group.WORLD` as a default argument, read when the module is imported:
# imported after the group exists (loading an HF config through transformers does), it keeps the group alive past
# destroy_process_group. The group's gloo worker threads then run into the interpreter's exit, and one still
# releasing a finished collective's tensors there aborts the process ("terminate called without an active
# exception"). Imported before the group is made, it holds None. (torch's ZeRO optimizer and FSDP grad scaler
# bind it the same way, but only training code imports them, and they cost most of a second each.)
BINDS_THE_DEFAULT_GROUP = ("torch.distributed.nn.functional",)


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """Rank `rank` of `world_size` processes, each holding a 1/world_size shard of every layer.

    The one process group of a process is torch.distributed's default group (a process serves one engine's
    shard); `single()` is the group of a process that holds the whole model, whose collectives do nothing.
    """

    rank: int = 0
    world_size: int = 1
    shm: Optional[ShmAllReduce] = field(default=None, compare=False, repr=False)
    # With pipeline parallelism a stage's ranks are a subgroup of all the ranks (None: the default group, all).
    group: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def single(cls) -> "ParallelGroup":
        return cls(0, 1)

    @classmethod
    def join(
        cls,
        rank: int,
        world_size: int,
        rendezvous: Union[str, dist.Store],
        device: torch.device,
        timeout_s: float,
        shm: Optional[AllReduceHandle] = None,
    ) -> "ParallelGroup":
        """Join the group (blocks until all `world_size` ranks have) at `rendezvous`, an init method
        ("tcp://host:port") or the store the ranks checked in at (`rendezvous.py`): gloo on CPU, NCCL on CUDA; `shm`
        (the ranks' shared-memory all-reduce, made by rank 0) carries `all_reduce` instead of gloo. A collective
        that waits longer than `timeout_s` for a peer raises instead of hanging (a dead or stuck rank)."""
        return cls.join_stage(rank, world_size, 1, rendezvous, device, timeout_s, [shm])

    @classmethod
    def join_stage(
        cls,
        rank: int,
        tp_size: int,
        num_stages: int,
        rendezvous: Union[str, dist.Store],
        device: torch.device,
        timeout_s: float,
        shm: Sequence[Optional[AllReduceHandle]] = (),
    ) -> "ParallelGroup":
        """Join all `tp_size * num_stages` ranks (stage-major: engine/distributed/pipeline_stage.py) and return
        this rank's stage's tensor-parallel group; `shm[s]` is stage s's shared-memory all-reduce (or None)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        for module in BINDS_THE_DEFAULT_GROUP:
            try:
                importlib.import_module(module)
            except ImportError:  # (a torch without it: nothing there to bind the group)
                pass
        init_method, store = (rendezvous, None) if isinstance(rendezvous, str) else (None, rendezvous)
        dist.init_process_group(
            backend,
            init_method=init_method,
            store=store,
            rank=rank,
            world_size=tp_size * num_stages,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        stage, tp_rank = divmod(rank, tp_size)
        group = None
        if num_stages > 1 and tp_size > 1:  # every rank makes every stage's subgroup, in the same order
            groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) for s in range(num_stages)]
            group = groups[stage]
        handle = shm[stage] if stage < len(shm) else None
        opened = handle.open(tp_rank) if handle is not None and device.type == "cpu" else None
        return cls(tp_rank, tp_size, opened, group)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `tensor` (each rank's partial product), in place; `tensor` itself back."""
        if self.shm is not None:
            return self.shm.all_reduce(tensor)
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (the same shape on every rank) stacked in rank order: [world_size, *shape]."""
        if self.shm is not None:
            return self.shm.all_gather(tensor)
        if self.world_size == 1:
            return tensor.unsqueeze(0)
        tensor = tensor.contiguous()
        out = torch.empty((self.world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        if tensor.is_cuda:
            dist.all_gather_into_tensor(out, tensor, group=self.group)
        else:  # gloo has no all_gather_into_tensor: the list form, into the rows of `out`
            dist.all_gather(list(out.unbind(0)), tensor, group=self.group)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` over all ranks of every stage (a size all must agree on: KV
        blocks, whose ids every rank's cache shares)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def leave(self) -> bool:
        """Tear the process group down (at shutdown; a process joins at most one group in its life here). False
        when something outside torch.distributed still holds the default group, whose threads then outlive it
        (a stage's subgroup in `group` ends with this object)."""
        if self.shm is not None:
            self.shm.close()
        if not dist.is_initialized():
            return True
        world = weakref.ref(dist.group.WORLD)
        dist.destroy_process_group()
        if world() is None:
            return True
        # (a module that bound group.WORLD after it was made, or the traceback of a failed collective being handled)
        logger.warning("the default process group is still referenced after destroy_process_group: its threads live on")
        return False
