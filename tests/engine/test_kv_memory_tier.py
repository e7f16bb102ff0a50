"""The host-memory KV tier (--swap-space / --kv-offloading-size): blocks the device pool evicted are restored from
it with the same greedy tokens, its slots are bounded (LRU), it is asked before the disk tier, and aborts leave
no block behind."""

from __future__ import annotations

import random

import pytest

from engine.sampling.params import SamplingParams
from scheduler.kv_tier_memory import MemoryTierIndex
from scheduler.kv_tiers import KVTiers
from tests.engine.references import assert_idle, make_llm

PROMPT = [random.Random(28).randrange(3, 500) for _ in range(150)]  # 37 full blocks of 4, and 2 tokens
OTHER = [random.Random(29).randrange(3, 500) for _ in range(240)]  # fills the pool: PROMPT's blocks evicted
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # the tiny model's block: layers, K and V, tokens, KV heads, head size, fp32
SMALL_POOL = dict(num_blocks=64)  # OTHER's 62 blocks leave at most 2 of PROMPT's in the pool


def gib(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / 2**30


def generate(llm, prompt=PROMPT):
    return llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def cold(llm):
    """Greedy tokens of the prompt without any tier (the reference)."""
    return generate(llm).outputs[0].token_ids


def test_evicted_prefix_is_restored_from_memory(tiny_llama_dir, cold):
    with make_llm(tiny_llama_dir, swap_space=gib(512), **SMALL_POOL) as llm:
        assert generate(llm).outputs[0].token_ids == cold
        generate(llm, OTHER)
        result = generate(llm)
        assert result.outputs[0].token_ids == cold
        stats = llm.engine.stats()
        memory = stats.kv_tier("memory")
        assert memory is not None and stats.kv_tier("disk") is None
        assert memory.hit_blocks >= 35 and result.num_cached_tokens == 148  # the rest: the pool's own hits
        assert memory.hit_tokens == 4 * memory.hit_blocks and memory.read_bytes == memory.hit_blocks * BLOCK_BYTES
        assert memory.written_bytes >= (37 + 60) * BLOCK_BYTES
        assert_idle(llm)
        # Aborted while its blocks are being restored and prefilled: every block goes back to the pool.
        generate(llm, OTHER)
        engine = llm.engine
        engine.add_request("a", PROMPT + [7, 8, 9, 10, 11], GREEDY)
        engine.add_request("b", PROMPT[:60] + [5] * 70, GREEDY)
        engine.step()
        engine.abort(["a", "b"])
        engine.step()
        assert_idle(llm)
        assert llm.engine.stats().kv_tier("memory").hit_blocks > memory.hit_blocks


def test_memory_before_disk_and_the_bound(tiny_llama_dir, cold, tmp_path):
    """Ten slots: after OTHER, PROMPT's first blocks are out of memory (least recently used) and come from disk;
    those restores are written through to memory, so after the pool is emptied its later blocks come from memory
    and its first ones from disk again, in one run."""
    with make_llm(tiny_llama_dir, swap_space=gib(10), kv_cache_dir=str(tmp_path), **SMALL_POOL) as llm:
        generate(llm)
        generate(llm, OTHER)
        llm.engine.runner.kv_tier.writer.flush()  # the disk tier's files are written in the background: all there
        assert generate(llm).outputs[0].token_ids == cold
        stats = llm.engine.stats()
        memory, disk = stats.kv_tier("memory"), stats.kv_tier("disk")
        assert memory is not None and disk is not None
        assert memory.hit_blocks == 0 and disk.hit_blocks >= 35
        assert llm.engine.scheduler.kv_cache_manager.reset_prefix_cache()
        result = generate(llm)
        assert result.outputs[0].token_ids == cold and result.num_cached_tokens == 148
        after = llm.engine.stats()
        memory_hits = after.kv_tier("memory").hit_blocks
        disk_hits = after.kv_tier("disk").hit_blocks - disk.hit_blocks
        assert 0 < memory_hits <= 10 and memory_hits + disk_hits == 37
        assert_idle(llm)


def test_slots_are_least_recently_used():
    index = MemoryTierIndex(3, block_bytes=100)
    blocks = [bytes([n]) * 32 for n in range(6)]
    assert index.plan_saves(blocks[:3]) == [(blocks[0], 0), (blocks[1], 1), (blocks[2], 2)]
    # a step's blocks (a prompt's, in order) are older the later they come: its tail leaves first
    assert index.take(blocks[0]) == 0  # block 0 used: now the most recent
    assert index.plan_saves(blocks[3:4] + blocks[:1]) == [(blocks[3], 2)]  # block 2 out, its slot reused
    assert [b in index for b in blocks] == [True, True, False, True, False, False]
    # a step's restores are never evicted by its own saves, nor its saves by each other
    assert index.plan_saves(blocks[4:6], keep=[blocks[1]]) == [(blocks[4], 0), (blocks[5], 2)]
    assert [b in index for b in blocks] == [False, True, False, False, True, True]
    assert index.plan_saves([bytes([9]) * 32], keep=blocks) == []  # every slot protected: not saved
    index.forget(blocks[4:5])  # a failed step's save: its slot is free again
    assert blocks[4] not in index and index.plan_saves([bytes([9]) * 32]) == [(bytes([9]) * 32, 0)]
    assert index.stats.written_bytes == 7 * 100 and index.stats.read_bytes == 100


def test_touch_orders_a_prompt_tail_first():
    """A request's end marks its blocks used (pool hits too), its first block most recently."""
    index = MemoryTierIndex(4, block_bytes=100)
    first, second = [bytes([n]) * 32 for n in range(2)], [bytes([n]) * 32 for n in range(2, 4)]
    index.plan_saves(first)
    index.plan_saves(second)
    index.touch(first[::-1])  # (KVTiers.touch reverses a prompt's blocks)
    fresh = [bytes([n]) * 32 for n in range(4, 7)]
    assert [slot for _, slot in index.plan_saves(fresh)] == [3, 2, 1]  # the other prompt's tail, then its head
    assert [b in index for b in first + second] == [True, False, False, False]


def test_a_failed_steps_saves_are_forgotten():
    """A step that never ran wrote no row: its planned saves leave the tier (a completed step's stay)."""
    tiers = KVTiers(MemoryTierIndex(4, block_bytes=100), None)
    first, second = bytes([1]) * 32, bytes([2]) * 32
    assert tiers.take_ops(1, {first: 7}).memory_saves == ((7, 0),)
    tiers.commit(1)
    assert tiers.take_ops(2, {second: 8}).memory_saves == ((8, 1),)
    tiers.discard()  # step 2 failed
    assert tiers.run([first, second]) == 1 and tiers.memory is not None and tiers.memory.num_blocks == 1
