import pytest

from scheduler import BlockPool, hash_block


def test_allocate_and_free_counts():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage == pytest.approx(0.75)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0


def test_over_allocation_raises():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3)


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(RuntimeError):
        pool.free_blocks([block])


def test_free_queue_is_lru():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c])
    pool.free_blocks([a])
    pool.free_blocks([d, b])
    assert pool.free_block_ids() == [c.block_id, a.block_id, d.block_id, b.block_id]
    assert [x.block_id for x in pool.get_new_blocks(2)] == [c.block_id, a.block_id]


def test_freed_cached_block_is_reusable_until_evicted():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [1, 2, 3, 4])
    pool.cache_block(a, h)
    pool.free_blocks([a, b])
    assert pool.get_cached_block(h) is a
    pool.touch([a])  # taken back from the free queue
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    # b is at the head, a at the tail: the first allocation evicts b, the second a.
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is a
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_shared_block_ref_counts():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, hash_block(None, [5]))
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block(None, [9, 9])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a and b.block_hash is None


def test_hash_chains_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [0, 2]), [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    h = hash_block(None, [1])
    pool.cache_block(a, h)
    assert pool.get_cached_block(h) is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    h = hash_block(None, [1])
    pool.cache_block(a, h)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and pool.num_cached_blocks == 0


def test_never_used_blocks_leave_first_in_id_order_then_the_freed_ones_lru():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    pool.free_blocks([b, a])  # behind the never-used blocks 2..5
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert [x.block_id for x in pool.get_new_blocks(5)] == [2, 3, 4, 5, 1]
    assert pool.num_free_blocks == 1 and pool.get_new_blocks(1) == [a]
    assert [x.block_id for x in pool.all_blocks()] == list(range(6))


def test_a_pool_of_millions_of_blocks_costs_no_object_per_block_at_start_up():
    """A large GPU's cache holds millions of blocks (0.3 of an H200 for a tiny model: ~22 M); the pool,
    the KV cache manager and the scheduler must not build a Python object per block before serving."""
    import tracemalloc

    from scheduler import CacheConfig, Scheduler, SchedulerConfig

    num_blocks = 5_000_000
    tracemalloc.start()
    try:
        scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
            CacheConfig(num_blocks=num_blocks, block_size=16),
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.0f} MiB to start a pool of {num_blocks} blocks"
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == num_blocks and pool.usage == 0.0
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 1, 2]
