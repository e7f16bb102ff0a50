"""Tensor parallelism's worker processes: ranks 1 .. N-1, each holding a shard of the model, started by rank 0
(the engine's process), fed every step message through a shared-memory broadcast, and watched.

    engine process (rank 0)                      worker process (rank r)
      scheduler -> step message                    waits for the next PeerStep
      runner.execute: send PeerStep ------------>  takes the last step's tokens, runs the same step
      forward over its shard  <-- all-reduce -->   forward over its shard
      samples (its LM head is whole)               samples nothing

A worker that dies or hangs fails the engine within seconds instead of hanging it: a step's collectives
raise (the shared-memory all-reduce sees a dead peer's pid gone, gloo its connections closed; a stuck one
passes --distributed-timeout), and a watcher thread reports a worker's exit while the engine is idle
(`on_failure`) and aborts an all-reduce in progress. Each rank runs pinned to its share of the CPUs
(engine/distributed/cpu_binding.py). A worker leaves when rank 0 closes the
broadcast, and on its own when its parent process is gone (SIGKILL of the server included).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

import torch

from engine.distributed.cpu_binding import RankCpus, cgroup_cpu_quota, pin_process, plan_rank_cpus, process_cpus
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.shm_all_reduce import ShmAllReduce, ShmAllReduceOwner
from engine.distributed.shm_broadcast import BroadcastClosed, ShmBroadcastQueue
from engine.engine_config import EngineConfig
from engine.errors import SettingsConflictError
from engine.loading.loader import Checkpoint, rope_settings
from engine.models.llama_arch import LlamaArch
from engine.models.registry import family_of
from engine.models.tensor_parallel import check_shardable
from engine.runner.model_runner import ModelRunner
from engine.runner.peer_step import PeerStep
from engine.attention.kv_cache import KVCache
from engine.shard_builder import build_shard, capture_graphs, shard_kv_blocks

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
"""How often an idle worker checks that its parent (rank 0) is still alive."""
STOP_WAIT_S = 10.0
"""How long `stop` waits for the workers to leave before killing them."""


def check_tensor_parallel(config: EngineConfig, hf_config: Any) -> None:
    """SettingsConflictError for what tensor parallelism does not serve (yet), before any process starts."""
    size = config.parallel.tensor_parallel_size
    family = family_of(hf_config)
    if family.implementation != "llama":
        raise SettingsConflictError(
            f"--tensor-parallel-size {size}: {family.architecture} is not served with tensor parallelism yet "
            "(the Llama family is: Llama, Mistral, Qwen2, Qwen3)"
        )
    check_shardable(LlamaArch.from_hf_config(hf_config, rope_settings(hf_config)), size)
    if config.speculative_config is not None:
        raise SettingsConflictError(
            f"--tensor-parallel-size {size} with --speculative-config: not served yet (the step-cost model times "
            "forward passes on rank 0 alone); use one or the other"
        )


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1 .. N-1: the processes, the broadcast that feeds them, the group it joined."""

    def __init__(
        self,
        processes: list[Any],
        queue: ShmBroadcastQueue,
        group: ParallelGroup,
        all_reduce: Optional[ShmAllReduceOwner],
        restore: "_Restore",
    ):
        self.processes = processes
        self._restore = restore
        self.queue = queue
        self.group = group
        self._all_reduce = all_reduce
        self._stopping = threading.Event()
        self._on_failure: list[Callable[[BaseException], None]] = []
        self.failure: Optional[BaseException] = None
        self._watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, config: EngineConfig, checkpoint: Checkpoint, hf_config: Any) -> "TensorParallelWorkers":
        """Start ranks 1 .. N-1 (spawned: a fresh interpreter, no forked threads) and join their group as rank 0;
        they load their shards while this process loads its own."""
        check_tensor_parallel(config, hf_config)
        world = config.parallel.tensor_parallel_size
        timeout = config.parallel.distributed_timeout
        plan = plan_rank_cpus(process_cpus(), world, cgroup_cpu_quota())
        restore = _Restore(torch.get_num_threads(), process_cpus())
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        device = config.model.resolve_device()
        queue = ShmBroadcastQueue.create(world - 1, enqueue_timeout_s=timeout)
        # On CPU the ranks' all-reduce goes through shared memory (gloo's loopback TCP costs ~10x more per call).
        all_reduce = ShmAllReduce.create(world, timeout_s=timeout) if device.type == "cpu" else None
        shm_handle = all_reduce.handle if all_reduce is not None else None
        context = mp.get_context("spawn")
        processes = []
        try:
            for rank in range(1, world):
                process = context.Process(
                    target=_worker_main,
                    args=(config, checkpoint, hf_config, rank, world, init_method)
                    + (queue.handle, shm_handle, os.getpid(), plan[rank]),
                    name=f"pagedserve-tp{rank}",
                    daemon=True,  # (also ended by the interpreter's exit)
                )
                process.start()
                processes.append(process)
            _bind(plan[0], 0)  # after spawning: the workers start from this process's mask, not rank 0's share
            group = ParallelGroup.join(0, world, init_method, device, timeout, shm_handle)
        except BaseException:
            _end(processes)
            queue.close()
            if all_reduce is not None:
                all_reduce.close()
            restore()
            raise
        logger.info(
            "tensor parallelism: %d ranks (rank 0 here, pids %s), all-reduce over %s",
            world,
            ", ".join(str(p.pid) for p in processes),
            "shared memory" if all_reduce is not None else "NCCL",
        )
        return cls(processes, queue, group, all_reduce, restore)

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (from the watcher's thread) when a worker exits while the engine runs."""
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def send(self, step: PeerStep) -> None:
        if self.failure is not None:
            raise self.failure
        self.queue.enqueue(step)

    def stop(self) -> None:
        """Close the broadcast (the workers leave), wait for them, kill any left; leave the group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.queue.close()
        finally:
            _end(self.processes, STOP_WAIT_S)
            self.group.leave()
            if self._all_reduce is not None:
                self._all_reduce.close()
            self._restore()

    def _watch(self) -> None:
        sentinels = {process.sentinel: process for process in self.processes}
        while sentinels and not self._stopping.is_set():
            for sentinel in wait(list(sentinels), timeout=PARENT_CHECK_S):
                process = sentinels.pop(sentinel)
                if self._stopping.is_set():
                    return
                process.join(0)
                self.failure = WorkerDiedError(process.name, process.exitcode)
                if self._all_reduce is not None:
                    self._all_reduce.abort()  # rank 0 may be waiting in an all-reduce for the dead worker
                logger.error("%s", self.failure)
                for callback in self._on_failure:
                    callback(self.failure)
                return


class _Restore:
    """What rank 0 changed in its process (threads, CPU affinity), given back by `stop` (a process may build
    another engine afterwards)."""

    def __init__(self, threads: int, cpus: set[int]):
        self.threads = threads
        self.cpus = cpus

    def __call__(self) -> None:
        torch.set_num_threads(self.threads)
        pin_process(self.cpus)


def _bind(share: RankCpus, rank: int) -> None:
    """Pin this process to the rank's CPUs and set its threads; logged, with the reason when not pinned."""
    if share.cpus is not None:
        pin_process(share.cpus)
    torch.set_num_threads(share.threads)
    logger.info("%s", share.describe(rank))


class WorkerDiedError(RuntimeError):
    def __init__(self, name: str, exitcode: Optional[int]):
        rank = name.removeprefix("pagedserve-tp")
        super().__init__(f"tensor-parallel worker rank {rank} ({name}) exited with code {exitcode}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _end(processes: list[Any], wait_s: float = 0.0) -> None:
    for process in processes:
        process.join(wait_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


def _worker_main(
    config: EngineConfig,
    checkpoint: Checkpoint,
    hf_config: Any,
    rank: int,
    world: int,
    init_method: str,
    queue_handle: Any,
    all_reduce_handle: Any,
    parent_pid: int,
    share: RankCpus,
) -> None:
    """Rank `rank`: load its shard, then run every step rank 0 sends until it closes the broadcast."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    _bind(share, rank)
    device = config.model.resolve_device()
    group = ParallelGroup.join(rank, world, init_method, device, config.parallel.distributed_timeout, all_reduce_handle)
    torch.manual_seed(config.model.seed)
    shard = build_shard(config, checkpoint, hf_config, group)
    num_blocks = shard_kv_blocks(config, shard, group)
    runner = ModelRunner(
        shard.model, KVCache(shard.spec, num_blocks, device), shard.backend, device, shard.limits, samples=False
    )
    if shard.buckets:
        capture_graphs(runner, shard.buckets)
    reader = queue_handle.open(rank - 1)
    try:
        while True:
            try:
                step = reader.dequeue(timeout=PARENT_CHECK_S)
            except TimeoutError:
                if os.getppid() != parent_pid:
                    logger.error("rank 0 (pid %d) is gone: leaving", parent_pid)
                    return
                continue
            except BroadcastClosed:  # rank 0 shuts the engine down
                return
            runner.take_sampled(step.sampled_token_ids)
            runner.execute(step.scheduler_output)
    finally:
        reader.close()
        runner.shutdown()
        group.leave()
