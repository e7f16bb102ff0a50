"""The KV tiers from the engine's settings: the scheduler's indexes (rank 0), each rank's DiskTier and MemoryTier."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from engine.attention.kv_cache import KVCache
from engine.engine_config import EngineConfig
from engine.errors import SettingsConflictError
from engine.kv_tier.block_copy import payload_bytes
from engine.kv_tier.disk_tier import DiskTier
from engine.kv_tier.identity import model_identity
from engine.kv_tier.memory_tier import MemoryTier
from engine.loading.loader import Checkpoint
from engine.shard_builder import Shard
from scheduler.kv_tier_file import HEADER
from scheduler.kv_tier_index import KVTierIndex
from scheduler.kv_tier_memory import MemoryTierIndex
from scheduler.kv_tiers import KVTiers

logger = logging.getLogger(__name__)


def check_kv_tiers(config: EngineConfig, shard: Shard) -> None:
    """SettingsConflictError for a tier this engine cannot keep."""
    cache = config.cache
    flags = cache.tier_flags
    if not flags:
        return
    named = " / ".join(flags)
    if not cache.enable_prefix_caching:
        raise SettingsConflictError(f"{named} needs prefix caching (the tiers hold the prefix cache's blocks)")
    if not shard.kv_groups.is_uniform:
        raise SettingsConflictError(
            f"{named}: models with sliding-window layer groups are not supported by the KV tiers yet"
        )
    speculative = config.speculative_config
    if speculative is not None and speculative.method == "draft_model":
        raise SettingsConflictError(
            f"{named} with a draft model: the draft's own KV cache of a restored block is not in the tiers"
        )
    if cache.kv_cache_dir is not None and config.parallel.nnodes > 1:
        raise SettingsConflictError(
            "--kv-cache-dir with --nnodes > 1: node 0 verifies every rank's block files, which other hosts keep"
        )
    if cache.kv_cache_dir is not None:
        directory = Path(cache.kv_cache_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SettingsConflictError(f"--kv-cache-dir {directory}: cannot make it: {error.strerror}") from None
        if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
            raise SettingsConflictError(f"--kv-cache-dir {directory}: this user cannot read and write files there")


def tier_identity(config: EngineConfig, checkpoint: Checkpoint, hf_config: Any, shard: Shard) -> bytes:
    parallel = config.parallel
    return model_identity(
        checkpoint.path,
        checkpoint.gguf,
        shard.spec,
        num_layers=hf_config.num_hidden_layers,
        dtype=str(shard.dtype),
        quantization=f"{config.model.quantization}/{config.model.quantization_group_size}",
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
    )


def open_disk_tier(
    config: EngineConfig, checkpoint: Checkpoint, hf_config: Any, shard: Shard, rank: int
) -> Optional[DiskTier]:
    """Rank `rank`'s side of the disk tier (None without --kv-cache-dir)."""
    if config.cache.kv_cache_dir is None:
        return None
    return DiskTier(Path(config.cache.kv_cache_dir), tier_identity(config, checkpoint, hf_config, shard), rank)


def block_bytes_all_ranks(config: EngineConfig, hf_config: Any, kv_cache: KVCache) -> int:
    """A block's payload over every rank and stage (from any rank's cache: a layer's share is the same on all)."""
    per_layer = payload_bytes(kv_cache) // len(kv_cache.layers)
    return config.parallel.tensor_parallel_size * hf_config.num_hidden_layers * per_layer


def memory_tier_slots(config: EngineConfig, hf_config: Any, kv_cache: KVCache) -> int:
    """How many blocks `--swap-space` GiB hold over all ranks (vLLM's --kv-offloading-size is the total of every
    rank's buffer): the same number on every rank, each of which keeps its own share of every block."""
    block_bytes = block_bytes_all_ranks(config, hf_config, kv_cache)
    num_slots = int(config.cache.swap_space * 2**30) // block_bytes
    if num_slots < 1:
        raise SettingsConflictError(
            f"--swap-space / --kv-offloading-size {config.cache.swap_space:g} GiB holds no KV block "
            f"({block_bytes} bytes each over all ranks)"
        )
    return num_slots


def open_memory_tier(config: EngineConfig, hf_config: Any, kv_cache: KVCache, rank: int) -> Optional[MemoryTier]:
    """Rank `rank`'s rows of the host-memory tier (None without --swap-space)."""
    if not config.cache.swap_space:
        return None
    tier = MemoryTier(kv_cache, memory_tier_slots(config, hf_config, kv_cache))
    if rank == 0:
        pinned = "pinned host memory" if tier.device.type == "cuda" else "host memory"
        logger.info(
            "KV memory tier: %d blocks in %.1f MiB of %s on this rank%s",
            tier.rows.shape[0],
            tier.nbytes / 2**20,
            pinned,
            (
                ""
                if tier.device.type == "cuda"
                else " (on CPU the KV cache is host memory too: this is a second bounded pool that keeps the blocks "
                "the cache evicts; --kv-cache-memory makes the cache itself larger instead)"
            ),
        )
    return tier


def open_kv_tiers(
    config: EngineConfig, hf_config: Any, disk: Optional[DiskTier], memory: Optional[MemoryTier], kv_cache: KVCache
) -> Optional[KVTiers]:
    """The scheduler's view of the tiers (every rank's share of a block is accounted at rank 0's size)."""
    world_size = config.parallel.world_size
    memory_index = None
    if memory is not None:
        memory_index = MemoryTierIndex(memory.rows.shape[0], block_bytes_all_ranks(config, hf_config, kv_cache))
    disk_index = None
    if disk is not None:
        disk_index = KVTierIndex.open(
            disk.directory,
            disk.identity,
            world_size,
            int(config.cache.kv_cache_dir_size * 2**30),
            world_size * (HEADER.size + payload_bytes(kv_cache)),
        )
    if memory_index is None and disk_index is None:
        return None
    return KVTiers(memory_index, disk_index)
