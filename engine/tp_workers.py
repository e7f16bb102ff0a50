"""Tensor parallelism's worker processes: ranks 1 .. N-1, each holding a shard of the model, started by rank 0
(the engine's process), fed every step message through a shared-memory broadcast, and watched.

    engine process (rank 0)                      worker process (rank r)
      scheduler -> step message                    waits for the next PeerStep
      runner.execute: send PeerStep ------------>  takes the last step's tokens, runs the same step
      forward over its shard  <-- all-reduce -->   forward over its shard
      its vocabulary's logits <-- all-gather -->   its vocabulary's logits, for the same rows
      samples from the whole rows                  samples nothing

A worker that dies or hangs fails the engine within seconds instead of hanging it: a step's collectives
raise (a dead peer closes its connections; a stuck one passes --distributed-timeout), and a watcher thread
reports a worker's exit while the engine is idle (`on_failure`); one that dies before the group is made fails the
start at once (rank 0 watches the launched ranks while it waits for their check-ins: distributed/rendezvous.py).
A worker leaves when rank 0 closes the broadcast, and on its own when its parent process is gone (SIGKILL of the
server included).

How ranks start is a seam (distributed/launched_ranks.py): worker processes of this host (`ForkedRanks`, forks of
multiprocessing's fork server: distributed/worker_processes.py), Ray actors in engine/ray_workers.py
(--distributed-executor-backend ray); both run `_worker_main`.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import os
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Optional, Union

import torch

from engine.cpu_threads import machine_cpu_threads
from engine.distributed.cpu_binding import RankCpus, pin_process, plan_rank_cpus, process_cpus
from engine.distributed.launched_ranks import LaunchedRanks, WorkerDiedError, join_as_rank_zero
from engine.distributed.parallel_group import ParallelGroup
from engine.distributed.rendezvous import check_in, host
from engine.distributed.shm_all_reduce import ShmAllReduce, ShmAllReduceOwner
from engine.distributed.gloo_broadcast import BroadcastClosedByRankZero, GlooBroadcast
from engine.distributed.shm_broadcast import BroadcastClosed, ShmBroadcastQueue
from engine.distributed.worker_processes import run_in_environment, worker_context
from engine.engine_config import EngineConfig
from engine.kv_tier_setup import open_disk_tier, open_memory_tier
from engine.loading.loader import Checkpoint
from engine.lora_setup import attach_lora_stack
from engine.distributed.pipeline_link import PipelineLink
from engine.distributed.pipeline_stage import PipelineStage
from engine.models.registry import check_pipeline_model, check_tensor_parallel_model
from engine.runner.model_runner import ModelRunner
from engine.runner.peer_step import FinishStep, PeerStep
from engine.runner.pipeline_runner import LaunchedStep, PipelineRunner
from engine.runner.step_timing import STEP_COST_MAX_ROWS, measure_step_cost
from engine.attention.kv_cache import KVCache
from engine.shard_builder import Shard, build_shard, capture_graphs, shard_kv_blocks

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
"""How often an idle worker checks that its parent (rank 0) is still alive."""
STOP_WAIT_S = 10.0
"""How long `stop` waits for the workers to leave before killing them."""
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
StepChannel = Union[ShmBroadcastQueue, GlooBroadcast]
"""How rank 0's step messages reach the other ranks: the shared-memory ring on one host, a gloo broadcast across
hosts."""


class ForkedRanks:
    """Worker processes of this host, watched through their sentinels."""

    def __init__(self, processes: list[Any]):
        self.processes = processes
        self._running = {process.sentinel: process for process in processes}

    def describe(self) -> str:
        return "pids " + (", ".join(str(p.pid) for p in self.processes) or "none")

    def wait_ended(self, timeout_s: float) -> Optional[WorkerDiedError]:
        if not self._running:  # (another host's ranks only: nothing here to watch)
            time.sleep(timeout_s)
            return None
        for sentinel in wait(list(self._running), timeout=timeout_s):
            process = self._running.pop(sentinel)
            process.join(1.0)  # (its sentinel fires as it exits, a moment before it can be reaped with its code)
            return WorkerDiedError(process.name, process.exitcode)
        return None

    def end(self, wait_s: float) -> None:
        _end(self.processes, wait_s)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1 .. N-1: the ranks it launched, the broadcast that feeds them, the group it
    joined."""

    def __init__(
        self,
        ranks: LaunchedRanks,
        queue: "StepChannel",
        group: ParallelGroup,
        all_reduces: list[ShmAllReduceOwner],
        restore: "_Restore",
    ):
        self.ranks = ranks
        self._restore = restore
        self.queue = queue
        self.group = group  # rank 0's stage's tensor-parallel group
        self._all_reduces = all_reduces  # each stage's, on one host's CPUs
        self._stopping = threading.Event()
        self._on_failure: list[Callable[[BaseException], None]] = []
        self.failure: Optional[BaseException] = None
        self._watcher = threading.Thread(target=self._watch, name="pagedserve-tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(cls, config: EngineConfig, checkpoint: Checkpoint, hf_config: Any) -> "TensorParallelWorkers":
        """Start this host's ranks 1 .. N/nnodes - 1 (forks of the fork server: distributed/worker_processes.py) and
        join the group of all ranks as rank 0; they load their shards while this process loads its own. With several
        hosts the others' ranks come from their `pagedserve serve --headless` (`run_headless_node`)."""
        check_parallel_model(config, hf_config)
        parallel = config.parallel
        world, local = parallel.world_size, parallel.ranks_per_node
        tp_size, num_stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        timeout = parallel.distributed_timeout
        plan = plan_rank_cpus(process_cpus(), local, engine_threads(config))
        restore = _Restore(torch.get_num_threads(), process_cpus())
        store = host(parallel.master_addr, parallel.master_port or 0, world, timeout)
        init_method = f"tcp://{parallel.master_addr}:{store.port}"
        device = config.model.resolve_device()
        one_host = parallel.nnodes == 1
        queue = ShmBroadcastQueue.create(world - 1, enqueue_timeout_s=timeout) if one_host else None
        # On one host's CPUs each stage's all-reduce goes through shared memory (gloo's loopback TCP costs ~10x
        # more per call); across hosts, gloo; on CUDA, NCCL.
        all_reduces = (
            [ShmAllReduce.create(tp_size, timeout_s=timeout) for _ in range(num_stages)]
            if device.type == "cpu" and one_host and tp_size > 1
            else []
        )
        shm_handles = [owner.handle for owner in all_reduces]
        ranks = ForkedRanks([])
        try:
            handle = None if queue is None else queue.handle
            ranks = ForkedRanks(
                _spawn(config, checkpoint, hf_config, range(1, local), init_method, handle, shm_handles, plan)
            )
            _bind(plan[0], 0)  # after spawning: the workers start from this process's mask, not rank 0's share
            group = join_as_rank_zero(store, tp_size, num_stages, ranks, device, timeout, shm_handles)
            channel: StepChannel = queue if queue is not None else GlooBroadcast()
        except BaseException:
            ranks.end(0)
            if queue is not None:
                queue.close()
            for owner in all_reduces:
                owner.close()
            restore()
            raise
        logger.info(
            "%d ranks (tensor parallel %d x pipeline stages %d) over %d node(s) (rank 0 here, %s), all-reduce over %s",
            world,
            tp_size,
            num_stages,
            parallel.nnodes,
            ranks.describe(),
            "shared memory" if all_reduces else "gloo" if device.type == "cpu" else "NCCL",
        )
        return cls(ranks, channel, group, all_reduces, restore)

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback` (from the watcher's thread) when a worker exits while the engine runs."""
        self._on_failure.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def send(self, step: "PeerStep | FinishStep") -> None:
        if self.failure is not None:
            raise self.failure
        self.queue.enqueue(step)

    def fail(self, error: BaseException) -> None:
        """A step failed on rank 0 after the workers took it (they may wait in a collective rank 0 never joins):
        no later step runs, and a worker waiting in the shared-memory all-reduce is woken to fail."""
        if self.failure is None:
            self.failure = RanksOutOfStepError(f"a parallel step failed on rank 0: {error!r}")
            self._abort_all_reduces()

    def stop(self) -> None:
        """Close the broadcast (the workers leave), wait for them, kill any left; leave the group."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.queue.close()
        except Exception as error:  # noqa: BLE001 - a rank already gone cannot be told; the rest still leave
            logger.warning("closing the step broadcast: %s", error)
        finally:
            self.ranks.end(STOP_WAIT_S)
            self.group.leave()
            for owner in self._all_reduces:
                owner.close()
            self._restore()

    def _abort_all_reduces(self) -> None:
        for owner in self._all_reduces:
            owner.abort()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            died = self.ranks.wait_ended(PARENT_CHECK_S)
            if died is None:
                continue
            if self._stopping.is_set():
                return
            self.failure = died
            self._abort_all_reduces()  # rank 0 may be waiting in an all-reduce for the dead worker
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


def engine_threads(config: EngineConfig) -> int:
    """The threads this host's ranks share: the setting (the CLI resolves it at start-up), else the machine's."""
    return config.cpu_threads or machine_cpu_threads(None, os.environ).count


def _bind(share: RankCpus, rank: int) -> None:
    """Pin this process to the rank's CPUs and set its threads; logged, with the reason when not pinned."""
    if share.cpus is not None:
        pin_process(share.cpus)
    torch.set_num_threads(share.threads)
    logger.info("%s", share.describe(rank))


class RanksOutOfStepError(RuntimeError):
    """The ranks no longer run the same collectives: the engine must be rebuilt."""


def _end(processes: list[Any], wait_s: float = 0.0) -> None:
    for process in processes:
        process.join(wait_s)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


def _spawn(
    config: EngineConfig,
    checkpoint: Checkpoint,
    hf_config: Any,
    ranks: range,
    init_method: str,
    queue_handle: Any,
    all_reduce_handles: list[Any],
    plan: list[RankCpus],
    die_with_parent: bool = False,
) -> list[Any]:
    """Start a worker process for each of `ranks`: their step broadcast (the shared-memory ring's handle, or None
    for the gloo one), each stage's all-reduce's shared memory (none: gloo or NCCL), each one's CPUs (`plan`, by
    the rank's place on this host)."""
    context = worker_context([type(hf_config).__module__])
    processes = []
    per_node = config.parallel.ranks_per_node
    for rank in ranks:
        process = context.Process(  # type: ignore[attr-defined]
            target=run_in_environment,
            args=(dict(os.environ), _worker_main if die_with_parent else _served_worker_main)
            + (config, checkpoint, hf_config, rank, init_method, queue_handle, all_reduce_handles)
            + (os.getpid(), plan[rank % per_node], die_with_parent),
            name=f"pagedserve-tp{rank}",
            daemon=True,  # (also ended by the interpreter's exit)
        )
        process.start()
        processes.append(process)
    return processes


def run_headless_node(config: EngineConfig) -> int:
    """`pagedserve serve --headless --node-rank R`: start this host's share of the ranks and wait for them. 0 when
    rank 0 closed the broadcast (node 0 shut down); 1 when a rank failed (the others are ended)."""
    from engine.loading.loader import load_hf_config, prepare_checkpoint

    parallel = config.parallel
    model = config.model
    checkpoint = prepare_checkpoint(model.model, revision=model.revision, download_dir=model.download_dir)
    hf_config = load_hf_config(checkpoint.path, trust_remote_code=model.trust_remote_code, overrides=model.hf_overrides)
    check_parallel_model(config, hf_config)
    local = parallel.ranks_per_node
    first = parallel.node_rank * local
    plan = plan_rank_cpus(process_cpus(), local, engine_threads(config))
    init_method = f"tcp://{parallel.master_addr}:{parallel.master_port}"
    ranks = range(first, first + local)
    processes = _spawn(config, checkpoint, hf_config, ranks, init_method, None, [], plan, die_with_parent=True)
    logger.info(
        "node %d of %d: ranks %d .. %d (pids %s), rendezvous at %s",
        parallel.node_rank,
        parallel.nnodes,
        first,
        first + local - 1,
        ", ".join(str(p.pid) for p in processes),
        init_method,
    )
    sentinels = {process.sentinel: process for process in processes}
    status = 0
    try:
        while sentinels:
            for sentinel in wait(list(sentinels)):
                process = sentinels.pop(sentinel)
                process.join()
                if process.exitcode != 0 and status == 0:
                    status = 1
                    logger.error("%s", WorkerDiedError(process.name, process.exitcode))
                    _end([p for p in processes if p.is_alive()])
    finally:
        _end(processes, STOP_WAIT_S)
    return status


def _served_worker_main(*args: Any) -> None:
    """`_worker_main` for a rank of the serving process's own host, deaf to SIGINT: a terminal's Ctrl-C reaches its
    whole process group, and a worker that died of it would fail every request in flight at once, where rank 0
    drains them (then closes the broadcast, which ends the worker). A second Ctrl-C, which exits rank 0 at once,
    ends it too: a worker leaves within a second when its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_main(*args)


def _worker_main(
    config: EngineConfig,
    checkpoint: Checkpoint,
    hf_config: Any,
    rank: int,
    init_method: str,
    queue_handle: Any,
    all_reduce_handles: list[Any],
    parent_pid: int,
    share: RankCpus,
    die_with_parent: bool,
    cuda_index: Optional[int] = None,
) -> None:
    """Rank `rank`: load its shard, then run every step rank 0 sends until it closes the broadcast. `cuda_index`:
    its device among those visible (None: its place on this host; a Ray actor sees only its own GPU)."""
    started = time.monotonic()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [tp rank {rank}] %(name)s: %(message)s")
    launcher = os.getppid()  # the fork server this process was forked by (it leaves when rank 0's process ends)
    if die_with_parent:  # (a headless node's ranks wait in a collective, where they cannot look for their parent)
        _die_with_parent()
        if _parent_gone(parent_pid, launcher):
            return
    _bind(share, rank)
    device = config.model.resolve_device()
    parallel = config.parallel
    if device.type == "cuda":  # one device per rank of this host (tensors made on "cuda" land on it)
        torch.cuda.set_device(rank % parallel.ranks_per_node if cuda_index is None else cuda_index)
    tp_size, num_stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    timeout = parallel.distributed_timeout
    store = check_in(init_method, rank, parallel.world_size, timeout)
    group = ParallelGroup.join_stage(rank, tp_size, num_stages, store, device, timeout, all_reduce_handles)
    gloo = GlooBroadcast() if queue_handle is None else None  # (made by every rank in the same order)
    joined = time.monotonic()
    torch.manual_seed(config.model.seed)
    stage = PipelineStage.of_rank(rank, tp_size, num_stages, hf_config.num_hidden_layers)
    shard = build_shard(config, checkpoint, hf_config, group, stage)
    if config.lora.enable_lora:  # (its slots: the step messages name the adapters each rank reads its part of)
        attach_lora_stack(config, shard.model, hf_config)
    loaded = time.monotonic()
    num_blocks = shard_kv_blocks(config, shard, group)
    kv_tier = open_disk_tier(config, checkpoint, hf_config, shard, rank)
    kv_cache = KVCache(shard.spec, num_blocks, device)
    memory_tier = open_memory_tier(config, hf_config, kv_cache, rank)
    runner = make_runner(shard, kv_cache, stage, samples=False, kv_tier=kv_tier, memory_tier=memory_tier)
    cached = time.monotonic()
    if shard.buckets:
        capture_graphs(runner, shard.buckets)
    speculative = config.speculative_config
    if speculative is not None and speculative.step_cost_model:  # rank 0 times the same steps: run them alongside
        rows = min(shard.limits.max_query_rows, STEP_COST_MAX_ROWS)
        measure_step_cost(shard.model, shard.backend, shard.spec, device, rows, lockstep=True)
    logger.info(
        "rank %d ready in %.1f s: rendezvous %.1f s, weights %.1f s, KV cache %.1f s, graphs and timings %.1f s",
        rank,
        time.monotonic() - started,
        joined - started,
        loaded - joined,
        cached - loaded,
        time.monotonic() - cached,
    )
    reader = None if queue_handle is None else queue_handle.open(rank - 1)
    launched: deque[LaunchedStep] = deque()  # stage 0's steps whose logits are still to gather
    try:
        while True:
            try:
                if gloo is not None:
                    step = gloo.dequeue()
                else:
                    assert reader is not None  # (one broadcast or the other)
                    step = reader.dequeue(timeout=PARENT_CHECK_S)
            except TimeoutError:
                if _parent_gone(parent_pid, launcher):
                    logger.error("rank 0 (pid %d) is gone: leaving", parent_pid)
                    return
                continue
            except (BroadcastClosed, BroadcastClosedByRankZero):  # rank 0 shuts the engine down
                return
            if isinstance(step, FinishStep):  # (sent only when stage 0 has tensor-parallel peers)
                if isinstance(runner, PipelineRunner) and stage.is_first:
                    oldest = launched.popleft()
                    assert oldest.step_id == step.step_id, f"finishing step {step.step_id}, launched {oldest}"
                    runner.finish(oldest)
                continue
            runner.take_sampled(step.sampled_token_ids)
            if isinstance(runner, PipelineRunner) and stage.is_first:
                launch = runner.launch(step.scheduler_output)
                if launch.batch is not None:  # (a step without a forward pass is never finished)
                    launched.append(launch)
            else:
                runner.execute(step.scheduler_output)
    finally:
        if reader is not None:
            reader.close()
        runner.shutdown()
        group.leave()


def check_parallel_model(config: EngineConfig, hf_config: Any) -> None:
    """SettingsConflictError unless the model splits as the tensor and pipeline sizes ask."""
    parallel = config.parallel
    if parallel.tensor_parallel_size > 1:
        check_tensor_parallel_model(hf_config, parallel.tensor_parallel_size)
    if parallel.pipeline_parallel_size > 1:
        check_pipeline_model(hf_config, parallel.pipeline_parallel_size)


def make_runner(shard: Shard, kv_cache: KVCache, stage: PipelineStage, **kwargs: Any) -> ModelRunner:
    """A rank's runner over its shard: a pipeline stage's when the model is split into stages."""
    args = (shard.model, kv_cache, shard.backend, shard.device, shard.limits)
    if not stage.is_split:
        return ModelRunner(*args, vision=shard.vision, **kwargs)
    link = PipelineLink(stage, shard.model.arch.hidden_size, shard.dtype, shard.device)
    return PipelineRunner(*args, pipeline=link, **kwargs)


def _parent_gone(parent_pid: int, launcher: int) -> bool:
    """Rank 0's process (`parent_pid`) has ended, or the process that started this one (`launcher`: the fork
    server, which leaves as soon as rank 0's process ends, or rank 0 itself) has."""
    if os.getppid() != launcher:
        return True
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # (alive, another user's: not this engine's, but not a reason to leave)
        return False
    return False


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the thread that forked it ends (the fork server's, which ends as soon as
    the headless node's process does)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        logger.warning("cannot ask to die with the parent process (not Linux?)")
