"""The KV tiers below the device pool, as the KVCacheManager sees them: host memory first, then disk.

    device pool miss ──► memory tier (slots, LRU) ──► disk tier (files, LRU, checksummed) ──► compute

A prompt's blocks after its pool hits are restored block by block from whichever tier holds each (memory
preferred: no file to read and check), up to the first block neither holds. Every block a step fills, and
every block it restores from disk, is written through to each tier that lacks it: a block the memory tier
evicts may still be on disk, and a disk hit is in memory for the next prompt.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from scheduler.kv_tier_index import KVTierIndex, KVTierStats
from scheduler.kv_tier_memory import MemoryTierIndex


class TierOps(NamedTuple):
    """One step's copies between the device pool and the tiers (what the step message carries)."""

    disk_saves: tuple[tuple[int, bytes], ...] = ()  # (block id, hash): copied out after the forward
    disk_restores: tuple[tuple[bytes, int], ...] = ()  # (hash, block id): read in before the forward
    memory_saves: tuple[tuple[int, int], ...] = ()  # (block id, slot): copied out after the forward
    memory_restores: tuple[tuple[int, int], ...] = ()  # (slot, block id): copied in before the forward


class KVTiers:
    """The memory tier, the disk tier, or both (at least one)."""

    def __init__(self, memory: Optional[MemoryTierIndex], disk: Optional[KVTierIndex]):
        if memory is None and disk is None:
            raise ValueError("KVTiers needs a memory tier, a disk tier or both")
        self.memory = memory
        self.disk = disk
        self._disk_restores: list[tuple[bytes, int]] = []
        self._memory_restores: list[tuple[bytes, int, int]] = []  # (hash, slot, block id)
        self._unconfirmed: dict[int, list[bytes]] = {}  # step id -> blocks its memory saves hold, until it has run
        self._disk_unwritten: dict[int, list[bytes]] = {}  # step id -> its disk saves, until it has run

    @property
    def stats(self) -> tuple[KVTierStats, ...]:
        """A snapshot of each tier's counters, memory first."""
        return tuple(tier.stats.snapshot() for tier in (self.memory, self.disk) if tier is not None)

    def run(self, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes`, from the first, some tier holds (disk files read back and checked)."""
        memory, disk = self.memory, self.disk
        for n, block_hash in enumerate(block_hashes):
            if memory is not None and block_hash in memory:
                continue
            if disk is None or block_hash not in disk or disk.verified_run([block_hash]) == 0:
                return n
        return len(block_hashes)

    def restore(self, block_hashes: Sequence[bytes], block_ids: Sequence[int], block_size: int) -> None:
        """Plan reading a run that `run` found into the blocks `block_ids` (the step being scheduled), counted as
        hits of the tier each block comes from."""
        memory, disk = self.memory, self.disk
        for block_hash, block_id in zip(block_hashes, block_ids):
            if memory is not None and block_hash in memory:
                self._memory_restores.append((block_hash, memory.take(block_hash), block_id))
                stats = memory.stats
            else:
                assert disk is not None  # (`run` found it there)
                self._disk_restores.append((block_hash, block_id))
                disk.touch([block_hash])
                stats = disk.stats
            stats.hit_blocks += 1
            stats.hit_tokens += block_size

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """A request that held these blocks (a prompt's, in order) has ended: each tier that holds them marks them
        used, its first block most recently (a prompt's tail is evicted first)."""
        for tier in (self.memory, self.disk):
            if tier is not None:
                tier.touch(block_hashes[::-1])

    def close(self) -> None:
        """The engine is shutting down: the disk tier writes its use order for the next start."""
        if self.disk is not None:
            self.disk.close()

    def take_ops(self, step_id: int, filling: dict[bytes, int]) -> TierOps:
        """Step `step_id`'s copies, once its scheduling is done: `filling` (hash -> block id) are the full blocks
        it fills or restores, saved to each tier that lacks them."""
        memory_restores, self._memory_restores = self._memory_restores, []
        disk_restores, self._disk_restores = tuple(self._disk_restores), []
        ops = TierOps(disk_restores=disk_restores, memory_restores=tuple((slot, b) for _, slot, b in memory_restores))
        if self.memory is not None:
            keep = [h for h, _, _ in memory_restores]
            saves = self.memory.plan_saves(list(filling), keep=keep)
            ops = ops._replace(memory_saves=tuple((filling[h], slot) for h, slot in saves))
            if saves:
                self._unconfirmed[step_id] = [h for h, _ in saves]
        if self.disk is not None:
            saves_ = self.disk.plan_saves(list(filling), keep=[h for h, _ in disk_restores])
            ops = ops._replace(disk_saves=tuple((filling[h], h) for h in saves_))
            if saves_:
                self._disk_unwritten[step_id] = saves_
        return ops

    def commit(self, step_id: int) -> None:
        """Step `step_id` has run: its saves are in the memory tier's rows, and queued for the disk's files."""
        self._unconfirmed.pop(step_id, None)
        self._disk_unwritten.pop(step_id, None)

    def discard(self) -> None:
        """No step awaiting its update will run (a failed step): their saves never happened, so neither tier
        holds those blocks (a later step that fills them saves them)."""
        if self.memory is not None:
            for block_hashes in self._unconfirmed.values():
                self.memory.forget(block_hashes)
        if self.disk is not None:
            for block_hashes in self._disk_unwritten.values():
                self.disk.unplan(block_hashes)
        self._unconfirmed.clear()
        self._disk_unwritten.clear()
