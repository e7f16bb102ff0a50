"""The engine's configuration: the model, cache and scheduler sections together."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from engine.cache_config import EngineCacheConfig
from engine.distributed.parallel_config import ParallelConfig
from engine.loading.model_config import ModelConfig
from engine.lora.lora_config import LoRAConfig
from engine.spec_decode.speculative_config import SpeculativeConfig
from scheduler import SchedulerConfig


class EngineConfig(BaseModel):
    """Everything `EngineCore.from_config` needs; each section is owned by its package."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: EngineCacheConfig = Field(default_factory=EngineCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    attention_backend: Literal["auto", "cpu", "torch", "flash", "triton"] = "auto"
    enforce_eager: bool = Field(
        False,
        description="never run CUDA graphs (on CUDA, decode steps are otherwise replayed from graphs "
        "captured at start-up for batch sizes up to max_num_seqs; engine/runner/cuda_graphs.py)",
    )
    profile: bool = Field(
        False,
        description="time every step's phases (schedule, prepare, forward, sample, update, detokenize, between) "
        "and log the breakdown every 1000 steps (engine/profiling/step_profile.py)",
    )
    speculative_config: Optional[SpeculativeConfig] = Field(
        None,
        description="speculative decoding: a proposer's draft tokens verified in the same forward pass "
        "(engine/spec_decode/); None: off",
    )
    cpu_threads: Optional[int] = Field(
        None,
        ge=1,
        description="CPU threads of the engine's operator pools (split among tensor-parallel ranks); None: the "
        "process's share of the machine, min(affinity mask, cgroup CPU quota) (engine/cpu_threads.py)",
    )
    batch_invariant: bool = Field(
        False,
        description="products, norms and attention whose per-row arithmetic does not depend on the batch: "
        "a request gives the same tokens and logprobs whatever runs beside it, in float32 and bfloat16 "
        "(CPU; engine/platform.py)",
    )
