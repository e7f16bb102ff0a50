"""Tensor parallelism on a Ray cluster (--distributed-executor-backend ray): rank 0 stays in the engine's process,
ranks 1 .. N-1 run as Ray actors wherever the cluster places them, each running the mp workers' body
(`tp_workers._worker_main`: check in, join the group, build the shard, run every step).

    engine process (Ray driver, rank 0)             Ray actor (rank r, any node)
      placement group: one bundle per rank,           holds bundle r's CPUs (threads) or GPU
        bundle 0 on this node (rank 0's share)
      rendezvous store at this node's IP  <-------   checks in, joins the gloo (CPU) / NCCL (CUDA) group
      steps over a gloo broadcast  ------------->    runs each step on its shard
      watches each actor's `run` (ray.wait)          `run` returns when rank 0 closes the broadcast

The actors may sit on other hosts, so the step messages go over gloo (`gloo_broadcast.py`), not shared memory,
and so does the CPU all-reduce. An actor that dies (killed, its node lost) ends its `run` with an error: before
the group exists rank 0's rendezvous notices it, afterwards the watcher thread (`WorkerDiedError`, the engine
fails as with a dead process). `stop` ends the actors and removes the placement group.

`ray` is imported here only inside functions: the server's import time does not pay for it."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional

import torch

from engine.distributed.cpu_binding import RankCpus, process_cpus
from engine.distributed.gloo_broadcast import GlooBroadcast
from engine.distributed.launched_ranks import WorkerDiedError, join_as_rank_zero
from engine.distributed.rendezvous import host
from engine.engine_config import EngineConfig
from engine.tp_workers import TensorParallelWorkers, _Restore, _worker_main, check_parallel_model

logger = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id: bundle 0 asks for the driver's node (rank 0 runs there)."""


class RayClusterError(RuntimeError):
    """No Ray cluster to join, or one that cannot hold the ranks: the message says what is missing."""


class RankActor:
    """One rank 1 .. N-1 as a Ray actor (made remote by `start_ray_workers`, so defining it needs no Ray)."""

    def where(self) -> tuple[str, int]:
        """Its node's id and its pid (for the start-up log, and for tests that check the placement)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def run(self, config: EngineConfig, rank: int, init_method: str, threads: int) -> None:
        """The worker's whole life: returns when rank 0 closes the broadcast. The checkpoint is resolved on this
        node (a local path must exist here too; a hub id is fetched into this node's cache), as a headless node's
        ranks do."""
        from engine.loading.loader import load_hf_config, prepare_checkpoint

        model = config.model
        checkpoint = prepare_checkpoint(model.model, revision=model.revision, download_dir=model.download_dir)
        hf_config = load_hf_config(
            checkpoint.path, trust_remote_code=model.trust_remote_code, overrides=model.hf_overrides
        )
        share = RankCpus(None, threads, "its Ray bundle's CPUs; Ray assigns no cores to pin")
        cuda_index = 0 if model.resolve_device().type == "cuda" else None  # (Ray shows it only its own GPU)
        _worker_main(config, checkpoint, hf_config, rank, init_method, None, [], os.getppid(), share, False, cuda_index)


class RayRanks:
    """Ranks 1 .. N-1 as Ray actors in a placement group (`LaunchedRanks`)."""

    def __init__(self, placement_group: Any, disconnect: bool):
        self.placement_group = placement_group
        self.actors: dict[int, Any] = {}  # by rank
        self.nodes: dict[int, tuple[str, int]] = {}  # by rank: node id, pid
        self._runs: dict[Any, int] = {}  # each actor's `run` (an ObjectRef) -> its rank; all of them, for `end`
        self._running: dict[Any, int] = {}  # the same, less those already reported ended
        self._disconnect = disconnect  # this engine connected the process to Ray: `end` disconnects it

    def launch(self, config: EngineConfig, init_method: str, bundle: dict[str, float]) -> None:
        """Start an actor for each rank 1 .. N-1 in its bundle, and learn where each landed."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class: Any = ray.remote(RankActor)  # (its methods gain `.remote`, which mypy cannot see)
        threads = max(1, int(bundle.get("CPU", 1)))
        wheres = {}
        for rank in range(1, config.parallel.world_size):  # all start at once; `where` answers when up
            actor = actor_class.options(
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                max_restarts=0,  # a rank that comes back has lost its shard and its place in the group
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank),
            ).remote()
            self.actors[rank] = actor
            wheres[rank] = actor.where.remote()
            run = actor.run.remote(config, rank, init_method, threads)
            self._runs[run] = self._running[run] = rank
        for rank, where in wheres.items():
            try:
                self.nodes[rank] = ray.get(where, timeout=config.parallel.distributed_timeout)
            except (ray.exceptions.RayError, TimeoutError) as error:  # (GetTimeoutError is a TimeoutError)
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise WorkerDiedError(f"pagedserve-tp{rank}", None, f"(a Ray actor) did not start: {first[:300]}")

    def describe(self) -> str:
        return "Ray actors " + ", ".join(
            f"rank {rank} on node {node[:8]} (pid {pid})" for rank, (node, pid) in sorted(self.nodes.items())
        )

    def wait_ended(self, timeout_s: float) -> Optional[WorkerDiedError]:
        import ray

        if not self._running:
            time.sleep(timeout_s)
            return None
        ready, _ = ray.wait(list(self._running), num_returns=1, timeout=timeout_s)
        for run in ready:
            rank = self._running.pop(run)
            node = self.nodes.get(rank, ("unknown", 0))[0][:8]
            return WorkerDiedError(f"pagedserve-tp{rank}", None, f"(a Ray actor on node {node}) {self._why(run)}")
        return None

    def end(self, wait_s: float) -> None:
        """Wait for the actors' `run` to return (rank 0 closed the broadcast), then end the actors (their
        processes with them) and the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if self._runs and wait_s > 0:
                ray.wait(list(self._runs), num_returns=len(self._runs), timeout=wait_s)
            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
            remove_placement_group(self.placement_group)
        finally:
            if self._disconnect:
                ray.shutdown()

    @staticmethod
    def _why(run: Any) -> str:
        """How an actor's `run` ended, in a line."""
        import ray

        try:
            ray.get(run, timeout=0)
        except ray.exceptions.RayActorError as error:  # killed, its process or node gone
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            return f"died: {first[:300]}"
        except ray.exceptions.RayTaskError as error:  # its code raised (e.g. a checkpoint missing on that node)
            return f"failed: {error.cause!r}"[:500]
        return "returned before rank 0 closed the broadcast"


def start_ray_workers(config: EngineConfig, hf_config: Any) -> TensorParallelWorkers:
    """Join the Ray cluster, place one bundle per rank (failing with what is missing when the cluster cannot hold
    them within --distributed-timeout), start ranks 1 .. N-1 as actors and join the group as rank 0."""
    import ray

    parallel = config.parallel
    world, timeout = parallel.world_size, parallel.distributed_timeout
    check_parallel_model(config, hf_config)
    device = config.model.resolve_device()
    bundle = {"CPU": float(parallel.ray_cpus_per_rank)}
    if device.type == "cuda":
        bundle["GPU"] = 1.0
    disconnect = _connect()
    restore = _Restore(torch.get_num_threads(), process_cpus())
    ranks: Optional[RayRanks] = None
    try:
        placement = _place(world, bundle, timeout)
        ranks = RayRanks(placement, disconnect)
        address = ray.util.get_node_ip_address()  # where the actors reach this node
        store = host(address, parallel.master_port or 0, world, timeout)
        init_method = f"tcp://{address}:{store.port}"
        torch.set_num_threads(max(1, int(bundle["CPU"])))  # rank 0's bundle, as the actors' (restored by stop)
        ranks.launch(config, init_method, bundle)
        tp_size, num_stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        group = join_as_rank_zero(store, tp_size, num_stages, ranks, device, timeout)
        channel = GlooBroadcast()
    except BaseException:
        if ranks is not None:
            ranks.end(0)  # (the actors, the placement group, the connection)
        elif disconnect:  # (`_place` removed its group)
            ray.shutdown()
        restore()
        raise
    logger.info(
        "%d ranks (tensor parallel %d x pipeline stages %d) on a Ray cluster (rank 0 here, %s), bundles of %s, "
        "all-reduce over %s",
        world,
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        ranks.describe(),
        bundle,
        "gloo" if device.type == "cpu" else "NCCL",
    )
    return TensorParallelWorkers(ranks, channel, group, [], restore)


def _connect() -> bool:
    """Connect this process to the cluster (RAY_ADDRESS, else the one `ray start` left on this node, as vLLM
    does), unless it already is: True when it connected here (and so disconnects at stop)."""
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except ConnectionError as error:
        raise RayClusterError(
            f"--distributed-executor-backend ray: no Ray cluster at {address!r} ({error}); start one with "
            "`ray start --head` (and `ray start --address HEAD:6379` on the other hosts), or set RAY_ADDRESS"
        ) from error
    return True


def _place(world: int, bundle: dict[str, float], timeout_s: float) -> Any:
    """A placement group of `world` bundles, bundle 0 on this node, ready within `timeout_s` or removed and
    reported with what the cluster lacks."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    here = ray.get_runtime_context().get_node_id()
    group = placement_group(
        [dict(bundle) for _ in range(world)],
        strategy="PACK",
        bundle_label_selector=[{NODE_ID_LABEL: here}] + [{} for _ in range(world - 1)],
    )
    if group.wait(timeout_seconds=timeout_s):
        return group
    remove_placement_group(group)
    raise RayClusterError(_missing(world, bundle, here, timeout_s))


def _missing(world: int, bundle: dict[str, float], here: str, timeout_s: float) -> str:
    """What the cluster lacks for `world` bundles of `bundle` with bundle 0 on node `here`."""
    import ray

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    totals = ray.cluster_resources()
    lacking = [
        f"{name} {amount * world:g} (the cluster has {totals.get(name, 0):g})"
        for name, amount in bundle.items()
        if amount * world > totals.get(name, 0)
    ]
    local: dict[str, float] = next((node["Resources"] for node in nodes if node["NodeID"] == here), {})
    short_here = [f"{name} {amount:g} (it has {local.get(name, 0):g})" for name, amount in bundle.items()
                  if amount > local.get(name, 0)]  # fmt: skip
    reasons = []
    if lacking:
        reasons.append("in all, it needs " + ", ".join(lacking))
    if short_here:
        reasons.append("rank 0's bundle needs this node (the driver's) to hold " + ", ".join(short_here))
    if not reasons:
        reasons.append(f"the resources exist but are taken (available now: {ray.available_resources()})")
    return (
        f"the Ray cluster cannot place {world} tensor-parallel ranks of {bundle} each within {timeout_s:g} s "
        f"(--distributed-timeout) over its {len(nodes)} node(s): "
        + "; ".join(reasons)
        + " (--ray-cpus-per-rank sets a CPU rank's share)"
    )
