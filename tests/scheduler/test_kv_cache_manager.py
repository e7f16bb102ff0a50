import pytest

from scheduler import KVCacheManager

from tests.scheduler.factories import make_request


def decode(kv: KVCacheManager, request, tokens):
    """Each token appended and computed by a decode step of its own; yields the request's blocks per group after
    each."""
    for token in tokens:
        request.append_output_token(token)
        assert kv.allocate_slots(request, 1) is not None
        kv.commit_step(0)
        request.num_computed_tokens += 1
        yield kv.get_blocks(request.request_id)


def admit(kv: KVCacheManager, request):
    blocks, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    kv.record_admission(request, num_hit)
    kv.commit_step(0)  # the step that computes it completes
    return num_hit


def test_prefix_hit_on_shared_full_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request(list(range(10)))
    assert admit(kv, a) == 0
    b = make_request(list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == 8
    (b_ids,), (a_ids,) = kv.get_block_ids(b.request_id), kv.get_block_ids(a.request_id)
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert kv.prefix_cache_stats.queries == 21 and kv.prefix_cache_stats.hits == 8


def test_no_hit_on_partial_block_or_different_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request(list(range(6))))  # one full block [0..3], one partial [4, 5]
    assert kv.get_computed_blocks(make_request(list(range(6)) + [9]))[1] == 4
    assert kv.get_computed_blocks(make_request([0, 1, 2, 99, 4, 5, 6]))[1] == 0


def test_hit_of_a_later_block_needs_the_same_prefix():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: no hit at all.
    assert kv.get_computed_blocks(make_request([9, 2, 3, 4, 5, 6, 7, 8, 0]))[1] == 0


def test_cache_salt_shares_blocks_only_within_a_salt():
    """vLLM's cache_salt: the same tokens under another salt (or none) hash apart, under the same salt they hit;
    a salt with a LoRA mix's key is another seed than either alone."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    salted = make_request(list(range(10)))
    salted.cache_salt = "tenant-a"
    assert admit(kv, salted) == 0
    for salt, hit in ((None, 0), ("tenant-b", 0), ("tenant-a", 8)):
        other = make_request(list(range(10)))
        other.cache_salt = salt
        assert kv.get_computed_blocks(other)[1] == hit, salt
    keyed = make_request(list(range(10)))
    keyed.cache_salt, keyed.lora_key = "tenant-a", b"adapter"
    assert keyed.hash_seed not in (salted.hash_seed, b"adapter", None)
    assert kv.get_computed_blocks(keyed)[1] == 0


def test_a_salt_cannot_pass_for_a_lora_key_and_another_salt():
    """The key and the salt are hashed apart: a base-model request whose salt spells an adapter's key (here one
    that begins with a zero byte) and another salt never gets that adapter's blocks."""
    key = b"\0" + b"k" * 31
    adapter = make_request(list(range(10)))
    adapter.lora_key, adapter.cache_salt = key, "s"
    base = make_request(list(range(10)))
    base.cache_salt = "k" * 31 + "\0s"
    assert base.hash_seed != adapter.hash_seed
    kv = KVCacheManager(num_blocks=32, block_size=4)
    assert admit(kv, adapter) == 0
    assert kv.get_computed_blocks(base)[1] == 0


def test_hit_is_capped_to_leave_one_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request(list(range(8))))
    blocks, num_hit = kv.get_computed_blocks(make_request(list(range(8))))
    assert num_hit == 4 and len(blocks[0]) == 1


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(list(range(8)))
    admit(kv, a)
    b = make_request(list(range(8)) + list(range(20, 28)))  # hit 8, needs 2 more blocks, 1 free
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, b.num_tokens - num_hit, blocks) is None
    assert kv.block_pool.num_free_blocks == 1
    assert all(block.ref_cnt == 1 for block in kv.get_blocks(a.request_id)[0])
    assert kv.get_blocks(b.request_id) == ()


def test_freed_hit_blocks_count_as_reclaimable():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.usage == 0
    b = make_request(list(range(9)))  # 2 cached free blocks + 1 new: exactly the pool
    assert admit(kv, b) == 8
    assert kv.usage == 1.0


def test_blocks_are_cached_as_they_fill_during_decode():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request([1, 2, 3])
    admit(kv, a)
    for token in (4, 5):
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) is not None
        kv.commit_step(0)
        a.num_computed_tokens += 1
    blocks, num_hit = kv.get_computed_blocks(make_request([1, 2, 3, 4, 5, 6]))
    assert num_hit == 4 and blocks[0][0] is kv.get_blocks(a.request_id)[0][0]


def test_disabled_caching_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    admit(kv, make_request(list(range(12))))
    assert kv.get_computed_blocks(make_request(list(range(12))))[1] == 0
    assert kv.prefix_cache_stats.queries == 0


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request([1, 2, 3, 4, 5])
    admit(kv, a)
    (ids,) = kv.get_block_ids(a.request_id)
    kv.free(a)
    assert kv.block_pool.free_block_ids()[-3:] == list(ids[::-1])


def test_filled_blocks_are_hits_only_once_their_step_completes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)))
    assert kv.allocate_slots(a, 9) is not None  # scheduled: fills blocks 0 and 1
    probe = make_request(list(range(9)))
    assert kv.get_computed_blocks(probe)[1] == 0
    assert kv.next_block_pending(probe, 0)
    kv.commit_step(0)
    assert kv.get_computed_blocks(probe)[1] == 8
    assert not kv.next_block_pending(probe, 2)


def test_blocks_of_a_request_freed_in_their_own_step_are_never_indexed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)))
    assert kv.allocate_slots(a, 9) is not None
    kv.free(a)  # preempted in the step that was to write them
    kv.commit_step(0)
    assert kv.get_computed_blocks(make_request(list(range(9))))[1] == 0
    assert kv.block_pool.num_cached_blocks == 0


def test_a_step_that_never_completes_indexes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(list(range(9)))
    assert kv.allocate_slots(a, 9) is not None
    kv.discard_steps()
    kv.commit_step(0)
    assert kv.block_pool.num_cached_blocks == 0


def test_lookahead_allocates_without_scheduling():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(list(range(14)))
    new_blocks = kv.allocate_slots(a, 4, num_lookahead_tokens=10)
    assert len(new_blocks[0]) == 4 and kv.num_slots[a.request_id] == 16
    kv.commit_step(0)
    assert kv.block_pool.num_cached_blocks == 1  # only the scheduled 4 tokens' block
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 9) == ((),)  # a later chunk within the allocation: blocks 1 and 2 fill
    kv.commit_step(0)
    assert kv.block_pool.num_cached_blocks == 3


# ---------------------------------------------------------------- sliding-window layer groups


def test_a_sliding_group_frees_the_blocks_behind_its_window_as_a_request_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 6))
    a = make_request(list(range(8)))
    admit(kv, a)
    held = [sum(1 for b in groups[1] if b is not kv.null_block) for groups in decode(kv, a, range(100, 140))]
    full, sliding = kv.get_blocks(a.request_id)
    assert len(full) == len(sliding) == 12  # 48 tokens' entries in both tables
    assert all(b is not kv.null_block for b in full)
    # The window (6 keys) and the next block: never more than 3 live blocks of 4 tokens, freed as it slides.
    assert max(held[8:]) <= 3 and sliding[0] is kv.null_block
    assert kv.block_pool.num_free_blocks == 64 - 12 - held[-1]
    kv.free(a)
    assert kv.usage == 0


def test_a_sliding_group_hit_needs_only_the_blocks_in_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 5))
    a = make_request(list(range(24)))
    assert kv.allocate_slots(a, 24) is not None  # one step computes the whole prompt
    a.num_computed_tokens = 24
    kv.commit_step(0)
    for token in (100, 101):  # a decode frees the sliding blocks behind the window
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) is not None
        kv.commit_step(0)
        a.num_computed_tokens += 1
    assert kv.get_blocks(a.request_id)[1][0] is kv.null_block
    kv.free(a)  # freed blocks keep their hashes until evicted
    b = make_request(list(range(24)) + [7])
    (full, sliding), num_hit = kv.get_computed_blocks(b)
    assert num_hit == 24 and len(full) == len(sliding) == 6
    # The next token (position 24) reads keys 20..24: block 5 only; blocks 0..4 of the sliding group are null.
    assert sliding[:5] == [kv.null_block] * 5 and sliding[5] is not kv.null_block


def test_an_evicted_block_inside_the_window_shortens_the_hit_to_where_the_window_is_whole():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 5))
    a = make_request(list(range(24)))
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    kv.commit_step(0)
    kv.free(a)
    block_5 = kv.get_computed_blocks(make_request(list(range(25))))[0][1][5]
    kv.block_pool._evict(block_5)  # the sliding group's copy of block 5 is gone, the full group's is not
    (full, sliding), num_hit = kv.get_computed_blocks(make_request(list(range(25))))
    # A hit of 20 tokens reads keys 16..20 (block 4, then 5 computed anew); 24 would need block 5.
    assert num_hit == 20 and len(full) == len(sliding) == 5 and sliding[4] is not kv.null_block


def test_a_chunked_group_frees_the_blocks_before_the_current_chunk():
    """Llama 4's local attention (chunks of 8): a query reads its own chunk's keys only, so once the next token
    to compute is in chunk c, the blocks wholly before c * 8 go back to the pool (the full group keeps all)."""
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, None), group_chunks=(None, 8))
    a = make_request(list(range(6)))
    admit(kv, a)
    live = [[i for i, b in enumerate(groups[1]) if b is not kv.null_block] for groups in decode(kv, a, range(100, 130))]
    # computing token 6 + i: its chunk starts at (6 + i) // 8 * 8, whose block is (6 + i) // 8 * 2
    assert all(blocks[0] == (6 + i) // 8 * 2 for i, blocks in enumerate(live))
    full, chunked = kv.get_blocks(a.request_id)
    assert all(b is not kv.null_block for b in full) and chunked[:6] == [kv.null_block] * 6
    assert kv.num_blocks_needed(1000, 16) == 250 + (-(-(8 + 16) // 4) + 1)  # a chunk and a step, not the sequence
    kv.free(a)
    assert kv.usage == 0


def test_a_chunked_group_hit_needs_only_the_blocks_of_the_next_tokens_chunk():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, None), group_chunks=(None, 8))
    a = make_request(list(range(24)))
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    kv.commit_step(0)
    kv.free(a)
    (full, chunked), num_hit = kv.get_computed_blocks(make_request(list(range(22)) + [7, 7, 7]))
    # 20 tokens hit (block 5 differs); the next token, 20, is in chunk 16..23: block 4 only
    assert num_hit == 20 and len(full) == len(chunked) == 5
    assert chunked[:4] == [kv.null_block] * 4 and chunked[4] is not kv.null_block


def test_chunks_go_on_groups_without_a_window():
    with pytest.raises(ValueError, match="chunks"):
        KVCacheManager(num_blocks=8, block_size=4, group_windows=(None, 4), group_chunks=(None, 8))


def test_a_prompt_remainder_is_reserved_in_full_groups_only():
    kv = KVCacheManager(num_blocks=64, block_size=4, group_windows=(None, 4))
    a = make_request(list(range(40)))
    new_ids = kv.allocate_slots(a, 8, num_reserved_tokens=32)  # the first chunk of a 40-token prompt
    assert new_ids is not None and [len(ids) for ids in new_ids] == [10, 2]
    assert kv.num_slots[a.request_id] == 8


def test_the_most_tokens_one_request_holds():
    assert KVCacheManager(num_blocks=10, block_size=4).max_tokens_held(8) == 40
    # Two full groups: each token takes a slot in both.
    assert KVCacheManager(num_blocks=10, block_size=4, group_windows=(None, None)).max_tokens_held(8) == 20
    # A full and a sliding group (window 4, steps of 8 tokens: at most 4 blocks): 6 blocks left for the full one.
    assert KVCacheManager(num_blocks=10, block_size=4, group_windows=(None, 4)).max_tokens_held(8) == 24
