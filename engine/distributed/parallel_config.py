"""How many processes hold the model, and how long one waits for another."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelConfig(BaseModel):
    """Tensor parallelism: `tensor_parallel_size` processes, each holding a shard of every layer (rank 0 in the
    engine's process, the others in worker processes; engine/tp_workers.py); pipeline parallelism:
    `pipeline_parallel_size` stages of consecutive layers, each that many ranks. On one host or spread evenly over
    `nnodes` hosts: node 0 serves, the others run `pagedserve serve --headless --node-rank R` and start their
    share of the ranks, all meeting at `master_addr:master_port` (rank 0's TCP store). With the ray backend the
    ranks are Ray actors placed by the cluster (engine/ray_workers.py)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="processes that each hold 1/N of every layer's heads and MLP width (all-reduce through shared "
        "memory on CPU, NCCL on CUDA); 1: the whole model in the engine's process",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="stages the layers are split into, each in its own process(es) (times tensor_parallel_size "
        "ranks in all); as many steps are in flight as there are stages, so the stages overlap",
    )
    enable_expert_parallel: bool = Field(
        False,
        description="a mixture of experts' routed experts shared out whole among each stage's tensor-parallel ranks "
        "(E / N experts per rank) instead of each rank holding 1/N of every expert's width; attention and shared "
        "experts are cut as without it (engine/models/expert_parallel.py)",
    )
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="how ranks 1 .. N-1 start: mp (processes forked here and by --headless nodes); ray (actors "
        "on the Ray cluster at RAY_ADDRESS, else the one `ray start` runs on this host; engine/ray_workers.py)",
    )
    ray_cpus_per_rank: int = Field(
        1,
        ge=1,
        description="with the ray backend: CPUs each rank's placement-group bundle reserves, and its threads "
        "(on CUDA a bundle also reserves one GPU)",
    )
    nnodes: int = Field(1, ge=1, description="hosts the ranks are spread over (world size / nnodes each)")
    node_rank: int = Field(0, ge=0, description="this host's place among them (0: the one that serves)")
    master_addr: str = Field("127.0.0.1", description="where node 0's rank 0 listens for the rendezvous")
    master_port: Optional[int] = Field(
        None, ge=1, le=65535, description="its port (required with nnodes > 1; one host: a free port is taken)"
    )
    headless: bool = Field(False, description="run this node's ranks without an API server (every node but node 0)")
    distributed_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a rank waits for another (a collective, the start-up, a step message) before the "
        "engine fails instead of hanging",
    )

    @model_validator(mode="after")
    def _nodes(self) -> "ParallelConfig":
        if self.distributed_executor_backend == "ray" and (self.nnodes > 1 or self.headless):
            raise ValueError(
                "distributed_executor_backend ray places every rank on the Ray cluster itself: give no nnodes, "
                "node_rank or headless (those are the mp backend's hosts)"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks do not spread evenly over "
                f"nnodes {self.nnodes}"
            )
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("nnodes > 1 needs master_port (and master_addr: node 0's address)")
        if self.headless != (self.node_rank > 0):
            raise ValueError("node 0 serves the API and the other nodes run --headless: give both or neither")
        return self

    @property
    def world_size(self) -> int:
        """Every rank: each pipeline stage's tensor-parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes
