"""Scheduler and KV-cache configuration (pydantic, unknown keys refused)."""

from __future__ import annotations

import re
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12,
}


def parse_size(value: Union[int, str]) -> int:
    """Bytes from an int or a string such as "512MiB", "1.5GB", "2g"."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 1GiB, 512MiB, 2000000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


class CacheConfig(BaseModel):
    """How the paged KV cache is laid out and sized.

    The number of blocks is `num_blocks` when given; otherwise the engine derives
    it from `kv_cache_memory` (CPU) or `gpu_memory_utilization` (CUDA).
    """

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: Optional[int] = Field(None, ge=1, description="KV blocks in the pool")
    kv_cache_memory: Optional[Union[int, str]] = Field(
        None, description='KV cache budget on CPU, e.g. "1GiB"'
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="fraction of GPU memory for weights + activations + KV"
    )
    enable_prefix_caching: bool = True

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_size(cls, value: Optional[Union[int, str]]) -> Optional[int]:
        if value is None:
            return None
        size = parse_size(value)
        if size <= 0:
            raise ValueError("kv_cache_memory must be positive")
        return size


class SchedulerConfig(BaseModel):
    """Continuous-batching limits. `max_model_len` None means "the model's own"."""

    model_config = ConfigDict(extra="forbid")

    max_num_seqs: int = Field(256, ge=1, description="requests in the running batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens computed per step at most")
    max_model_len: Optional[int] = Field(None, ge=1, description="prompt + output tokens at most")
    policy: Literal["fcfs", "priority"] = "fcfs"

    @model_validator(mode="after")
    def _check_budget(self) -> "SchedulerConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): every running request needs a token per step"
            )
        return self
