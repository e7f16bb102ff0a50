"""The KV cache section of the engine's configuration: the scheduler's layout plus how big the pool is.

The scheduler only needs the pool's layout (`block_size`, `num_blocks`,
`enable_prefix_caching`); how many bytes it may take is the engine's business,
which turns a memory budget into `num_blocks` once the model is loaded.
"""

from __future__ import annotations

import re
from typing import Literal, Optional, Union

from engine.errors import SettingsConflictError

from pydantic import Field, field_validator, model_validator

from scheduler import CacheConfig

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB when neither num_blocks nor kv_cache_memory is set

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "t": 10**12,
    "tb": 10**12,
}


def parse_size(value: Union[int, str]) -> int:
    """Bytes from an int or a string such as "512MiB", "1.5GB", "2g"."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 1GiB, 512MiB, 2000000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


class EngineCacheConfig(CacheConfig):
    """The `cache` section: the scheduler's `CacheConfig` plus the memory budget of the pool.

    The number of blocks is `num_blocks` when given; otherwise the engine derives
    it from `kv_cache_memory` (CPU) or `gpu_memory_utilization` (CUDA).
    """

    kv_cache_memory: Optional[Union[int, str]] = Field(None, description='KV cache budget on CPU, e.g. "1GiB"')
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="fraction of GPU memory for weights + activations + KV"
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="dtype the KV cache stores: auto = the model's; fp8 = fp8_e4m3 = float8 e4m3 (cpu, torch "
        "and triton attention backends), fp8_e5m2 = float8 e5m2 (torch and triton), with a per-layer scale; "
        "engine/attention/kv_cache.py",
    )

    kv_cache_dir: Optional[str] = Field(
        None,
        description="directory of the disk KV tier: blocks written through, restored instead of computed, kept "
        "across restarts (engine/kv_tier/); None = no disk tier",
    )
    kv_cache_dir_size: float = Field(16.0, gt=0, description="GiB the disk tier may take (least recently used out)")
    swap_space: float = Field(
        0.0,
        ge=0,
        description="GiB of host memory (over all ranks) for the memory KV tier: blocks written through, "
        "restored before the disk tier is asked (vLLM's --swap-space, --kv-offloading-size; pinned on CUDA; on CPU "
        "a second bounded pool beside the cache); 0 = none",
    )

    state_snapshots: Optional[int] = Field(
        None,
        ge=0,
        description="a hybrid model's snapshots of recurrent states at block boundaries, which its prefix-cache "
        "hits restore (scheduler/state_snapshots.py), from the KV cache budget; None = as many as the requests "
        "that run (fewer where their states and the snapshots would take more than half the budget); 0 = none "
        "(prefix caching off for such a model)",
    )

    mamba_cache_mode: Literal["align", "none"] = Field(
        "align",
        description="vLLM's: how a hybrid model's prefix-cache hits restore its recurrent states; align = from "
        "snapshots at block boundaries (state_snapshots), none = no prefix caching for such a model",
    )

    @model_validator(mode="after")
    def _one_answer_for_snapshots(self) -> "EngineCacheConfig":
        if self.mamba_cache_mode == "none" and self.state_snapshots:
            raise SettingsConflictError(
                f"--mamba-cache-mode none keeps no snapshot, but --state-snapshots asks for {self.state_snapshots}"
            )
        return self

    @field_validator("num_state_snapshots")
    @classmethod
    def _resolved_by_the_engine(cls, value: int) -> int:
        if value:
            raise SettingsConflictError("num_state_snapshots is resolved at start-up: set state_snapshots")
        return value

    @property
    def tier_flags(self) -> list[str]:
        """The flags that asked for a KV tier (none: no tier)."""
        wanted = (("--swap-space", bool(self.swap_space)), ("--kv-cache-dir", self.kv_cache_dir is not None))
        return [flag for flag, asked in wanted if asked]

    @field_validator("kv_cache_memory")
    @classmethod
    def _check_size(cls, value: Optional[Union[int, str]]) -> Optional[int]:
        if value is None:
            return None
        size = parse_size(value)
        if size <= 0:
            raise SettingsConflictError("kv_cache_memory must be positive")
        return size

    def for_scheduler(self, num_blocks: int, num_state_snapshots: int = 0) -> CacheConfig:
        """The scheduler's section with the pool size and the snapshot slots the engine resolved."""
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            num_state_snapshots=num_state_snapshots,
        )
