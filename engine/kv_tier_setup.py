"""The second KV tier from the engine's settings: the scheduler's index (rank 0) and each rank's DiskTier."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from engine.attention.kv_cache import KVCache
from engine.engine_config import EngineConfig
from engine.errors import SettingsConflictError
from engine.kv_tier.block_copy import payload_bytes
from engine.kv_tier.disk_tier import DiskTier
from engine.kv_tier.identity import model_identity
from engine.loading.loader import Checkpoint
from engine.shard_builder import Shard
from scheduler.kv_tier_file import HEADER
from scheduler.kv_tier_index import KVTierIndex

logger = logging.getLogger(__name__)


def check_kv_tiers(config: EngineConfig, shard: Shard) -> None:
    """SettingsConflictError for a tier this engine cannot keep; a warning for `--swap-space` on CPU."""
    cache = config.cache
    if cache.swap_space:
        if shard.device.type != "cuda":
            logger.warning(
                "--swap-space / --kv-offloading-size %g GiB ignored: on CPU the KV cache already lives in host "
                "memory (give it that memory with --kv-cache-memory; --kv-cache-dir keeps blocks on disk)",
                cache.swap_space,
            )
        else:
            raise SettingsConflictError(
                "--swap-space / --kv-offloading-size: the host-memory KV tier is not built yet on CUDA; "
                "use --kv-cache-dir (the disk tier, which the page cache keeps in host memory too)"
            )
    if cache.kv_cache_dir is None:
        return
    if not cache.enable_prefix_caching:
        raise SettingsConflictError("--kv-cache-dir needs prefix caching (the tier holds the prefix cache's blocks)")
    if shard.kv_groups.num_groups > 1 or shard.kv_groups.windows[0] is not None:
        raise SettingsConflictError(
            "--kv-cache-dir: models with sliding-window layer groups are not supported by the disk tier yet"
        )
    speculative = config.speculative_config
    if speculative is not None and speculative.method == "draft_model":
        raise SettingsConflictError(
            "--kv-cache-dir with a draft model: the draft's own KV cache of a restored block is not on disk"
        )
    if config.parallel.nnodes > 1:
        raise SettingsConflictError(
            "--kv-cache-dir with --nnodes > 1: node 0 verifies every rank's block files, which other hosts keep"
        )


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


def open_tier_index(config: EngineConfig, tier: Optional[DiskTier], kv_cache: KVCache) -> Optional[KVTierIndex]:
    """The scheduler's index of rank 0's tier (every rank's files are accounted at rank 0's size)."""
    if tier is None:
        return None
    world_size = config.parallel.world_size
    return KVTierIndex.open(
        tier.directory,
        tier.identity,
        world_size,
        int(config.cache.kv_cache_dir_size * 2**30),
        world_size * (HEADER.size + payload_bytes(kv_cache)),
    )
