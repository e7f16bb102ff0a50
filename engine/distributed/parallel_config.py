"""How many processes hold the model, and how long one waits for another."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ParallelConfig(BaseModel):
    """Tensor parallelism on one host: `tensor_parallel_size` processes, each holding a shard of every layer
    (rank 0 in the engine's process, the others in worker processes it starts; engine/tp_workers.py)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        le=64,
        description="processes that each hold 1/N of every layer's heads and MLP width (all-reduce through shared "
        "memory on CPU, NCCL on CUDA); 1: the whole model in the engine's process",
    )
    distributed_timeout: float = Field(
        60.0,
        gt=0,
        description="seconds a rank waits for another (a collective, the start-up, a step message) before the "
        "engine fails instead of hanging",
    )
