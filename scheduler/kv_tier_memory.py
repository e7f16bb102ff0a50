"""Which blocks the host-memory KV tier holds: a fixed number of slots, each one block, LRU.

The scheduler owns the accounting, the runner the bytes (engine/kv_tier/memory_tier.py): a save or a restore
names its slot in the step message, so every rank copies its own share of a block to and from its own row of
the same number, and no rank ever asks another where a block is. A slot is handed to a new block as soon as
the step that fills it is scheduled (write-through, as vLLM's KV offloading stores a block once it is computed:
the copy then overlaps the next steps, where one made at eviction would stall the step that needs the device
block back); the oldest other block leaves the tier to make room, never one the same step restores.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from scheduler.kv_tier_index import KVTierStats


class MemoryTierIndex:
    """`num_slots` slots of `block_bytes` each (a block's bytes over every rank: what the counters add)."""

    def __init__(self, num_slots: int, block_bytes: int):
        if num_slots < 1:
            raise ValueError(f"a memory tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.stats = KVTierStats("memory")
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))  # (popped from the end: slot 0 first)

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def take(self, block_hash: bytes) -> int:
        """The slot of a held block that a step restores (now the most recently used)."""
        self._slots.move_to_end(block_hash)
        self.stats.read_bytes += self.block_bytes
        return self._slots[block_hash]

    def touch(self, block_hashes: Sequence[bytes]) -> None:
        """Mark the held ones of `block_hashes` used now, the last of them most recently."""
        for block_hash in block_hashes:
            if block_hash in self._slots:
                self._slots.move_to_end(block_hash)

    def plan_saves(self, block_hashes: Sequence[bytes], keep: Sequence[bytes] = ()) -> list[tuple[bytes, int]]:
        """(hash, slot) for each of `block_hashes` not held yet, now held; each takes a free slot or the least
        recently used block's, but never one of `keep` (the step's restores: the runner reads them before it
        writes the saves, but a later step's save must not overwrite a row this step has yet to read)."""
        protect = set(keep)
        planned: list[tuple[bytes, int]] = []
        for block_hash in dict.fromkeys(block_hashes):
            if block_hash in self._slots:
                continue
            slot = self._free.pop() if self._free else self._evict(protect)
            if slot is None:
                break  # every slot holds a block this step reads or writes
            self._slots[block_hash] = slot
            protect.add(block_hash)  # (the step's own saves stay too)
            planned.append((block_hash, slot))
        for block_hash, _ in reversed(planned):  # a prompt's later blocks older: evicted before its first ones
            self._slots.move_to_end(block_hash)
        self.stats.written_bytes += len(planned) * self.block_bytes
        return planned

    def forget(self, block_hashes: Sequence[bytes]) -> None:
        """Free the slots of blocks whose saves never ran (their step failed): their rows hold other bytes."""
        for block_hash in block_hashes:
            slot = self._slots.pop(block_hash, None)
            if slot is not None:
                self._free.append(slot)

    def _evict(self, protect: set[bytes]) -> int | None:
        for block_hash in self._slots:
            if block_hash not in protect:
                return self._slots.pop(block_hash)
        return None
