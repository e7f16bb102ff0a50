import pytest
from pydantic import ValidationError

from scheduler import CacheConfig, Scheduler, SchedulerConfig


def test_memory_sizing_is_not_the_schedulers():
    """The pool's byte budget belongs to the engine's cache section (engine/cache_config.py)."""
    for key in ("kv_cache_memory", "gpu_memory_utilization"):
        assert key not in CacheConfig.model_fields
        with pytest.raises(ValidationError, match="extra"):
            CacheConfig(**{key: 1})


def test_defaults():
    cache = CacheConfig()
    assert cache.block_size == 16 and cache.enable_prefix_caching and cache.num_blocks is None
    sched = SchedulerConfig()
    assert sched.policy == "fcfs" and sched.max_num_seqs == 256 and sched.max_concurrent_batches == 1
    with pytest.raises(ValidationError, match="max_concurrent_batches"):
        SchedulerConfig(max_concurrent_batches=0)


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


def test_scheduler_needs_resolved_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        Scheduler(SchedulerConfig(max_model_len=128), CacheConfig())
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(SchedulerConfig(), CacheConfig(num_blocks=8))
