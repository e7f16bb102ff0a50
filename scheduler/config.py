"""Scheduler and KV-cache configuration (pydantic, unknown keys refused)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CacheConfig(BaseModel):
    """How the paged KV cache is laid out.

    `num_blocks` must be resolved (the engine derives it from its memory budget)
    before a `Scheduler` is built.
    """

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: Optional[int] = Field(None, ge=1, description="KV blocks in the pool")
    enable_prefix_caching: bool = True
    num_state_snapshots: int = Field(
        0,
        ge=0,
        description="slots for snapshots of a hybrid model's recurrent states, which its prefix-cache hits need "
        "(scheduler/state_snapshots.py); 0: none",
    )


class SchedulerConfig(BaseModel):
    """Continuous-batching limits. `max_model_len` None means "the model's own"."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(256, ge=1, description="requests in the running batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens computed per step at most")
    max_model_len: Optional[int] = Field(None, ge=1, description="prompt + output tokens at most")
    policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="prompt tokens one request computes per step at most (vLLM's): a long prompt is prefilled in "
        "chunks this large, so prompts arriving behind it share the step's budget instead of waiting for it; 0: "
        "no cap but the budget",
    )
    max_concurrent_batches: int = Field(
        1,
        ge=1,
        description="steps scheduled and not yet updated at most (pipeline parallelism keeps one per stage in "
        "flight); a request is in one of them at a time. The engine sets it to its pipeline_parallel_size, "
        "replacing a value given here",
    )

    @model_validator(mode="after")
    def _check_budget(self) -> "SchedulerConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token per step"
            )
        return self
