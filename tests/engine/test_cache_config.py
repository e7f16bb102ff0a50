"""The engine's cache section: the scheduler's layout plus the memory budget, sizes parsed from text."""

import pytest
from pydantic import ValidationError

from engine.cache_config import EngineCacheConfig, parse_size
from engine.engine_config import EngineConfig
from scheduler import CacheConfig


@pytest.mark.parametrize(
    "text,expected",
    [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("2g", 2 * 10**9), (4096, 4096), ("100", 100)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert EngineCacheConfig(kv_cache_memory=text).kv_cache_memory == expected


@pytest.mark.parametrize("text", ["", "GiB", "1 parsec", "-1GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValidationError):
        EngineCacheConfig(kv_cache_memory=text)


def test_gpu_memory_utilization_is_a_fraction():
    assert EngineCacheConfig().gpu_memory_utilization == 0.9
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError):
            EngineCacheConfig(gpu_memory_utilization=bad)


def test_unknown_keys_refused():
    with pytest.raises(ValidationError, match="extra"):
        EngineCacheConfig(block_sizes=16)


def test_scheduler_gets_the_layout_only():
    cache = EngineConfig(cache={"block_size": 8, "kv_cache_memory": "1MiB", "enable_prefix_caching": False}).cache
    section = cache.for_scheduler(num_blocks=12, num_state_snapshots=3)
    assert type(section) is CacheConfig
    assert section.model_dump() == {
        "block_size": 8,
        "num_blocks": 12,
        "enable_prefix_caching": False,
        "num_state_snapshots": 3,
    }


def test_the_snapshot_slots_are_the_engines_to_resolve():
    with pytest.raises(ValueError, match="set state_snapshots"):
        EngineCacheConfig(num_state_snapshots=4)
    with pytest.raises(ValueError, match="--mamba-cache-mode none keeps no snapshot"):
        EngineCacheConfig(mamba_cache_mode="none", state_snapshots=4)
