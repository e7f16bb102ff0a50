import pytest
from pydantic import ValidationError

from scheduler import CacheConfig, Scheduler, SchedulerConfig, parse_size


def test_defaults():
    cache = CacheConfig()
    assert cache.block_size == 16 and cache.enable_prefix_caching and cache.num_blocks is None
    sched = SchedulerConfig()
    assert sched.policy == "fcfs" and sched.max_num_seqs == 256


@pytest.mark.parametrize("model", [CacheConfig, SchedulerConfig])
def test_unknown_keys_refused(model):
    with pytest.raises(ValidationError, match="extra"):
        model(block_sizes=16)


def test_budget_must_cover_max_num_seqs():
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_policy_is_checked():
    with pytest.raises(ValidationError):
        SchedulerConfig(policy="lifo")


@pytest.mark.parametrize(
    "text,expected",
    [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("2g", 2 * 10**9), (4096, 4096), ("100", 100)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert CacheConfig(kv_cache_memory=text).kv_cache_memory == expected


@pytest.mark.parametrize("text", ["", "GiB", "1 parsec", "-1GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValidationError):
        CacheConfig(kv_cache_memory=text)


def test_scheduler_needs_resolved_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(max_model_len=128), CacheConfig())
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=8))
