"""The runner's side of the host-memory KV tier: this rank's rows of the tier's slots, and the copies the step
message names (scheduler/kv_tier_memory.py decides which block goes to which slot).

On CUDA the rows are pinned and the copies run on two side streams (saves out, restores in), so the forward
waits only for the restores of its own step and never for a save; a row's copies stay in order through the
event of the last copy that touched it. On CPU the same calls copy at once.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.attention.kv_cache import KVCache
from engine.kv_tier.block_copy import (
    cache_tensors,
    copy_blocks_to_rows,
    copy_rows_to_blocks,
    gather_blocks,
    payload_bytes,
    scatter_device_blocks,
)


class MemoryTier:
    """`num_slots` rows, each one block's payload on this rank (block_copy's layout), in host memory."""

    def __init__(self, kv_cache: KVCache, num_slots: int):
        self.device = cache_tensors(kv_cache)[0].device
        cuda = self.device.type == "cuda"
        # [num_slots, payload_bytes]
        self.rows = torch.empty((num_slots, payload_bytes(kv_cache)), dtype=torch.uint8, pin_memory=cuda)
        self._save_stream = torch.cuda.Stream(self.device) if cuda else None
        self._restore_stream = torch.cuda.Stream(self.device) if cuda else None
        self._last_copy: dict[int, torch.cuda.Event] = {}  # slot -> event of the last copy to or from its row

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def save(self, kv_cache: KVCache, saves: Sequence[tuple[int, int]]) -> None:
        """Copy the blocks `(block id, slot)` out of the cache into their rows (the step's forward has filled
        them; the gather is on the compute stream, before any later step may overwrite them)."""
        block_ids = [block_id for block_id, _ in saves]
        slots = [slot for _, slot in saves]
        if self._save_stream is None:
            copy_blocks_to_rows(kv_cache, block_ids, self.rows.numpy(), slots)
            return
        payloads = gather_blocks(kv_cache, block_ids)  # [n, payload_bytes]
        gathered = torch.cuda.current_stream(self.device).record_event()
        with torch.cuda.stream(self._save_stream):
            self._save_stream.wait_event(gathered)
            self._after_earlier_copies(self._save_stream, slots)
            for row, slot in enumerate(slots):
                self.rows[slot].copy_(payloads[row], non_blocking=True)
            payloads.record_stream(self._save_stream)  # (freed for reuse only once the copies are done)
            self._mark(self._save_stream.record_event(), slots)

    def restore(self, kv_cache: KVCache, restores: Sequence[tuple[int, int]]) -> None:
        """Copy the rows `(slot, block id)` into the cache's blocks before the step's forward reads them."""
        slots = [slot for slot, _ in restores]
        block_ids = [block_id for _, block_id in restores]
        stream = self._restore_stream
        if stream is None:
            copy_rows_to_blocks(kv_cache, self.rows.numpy(), slots, block_ids)
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_stream(compute)  # (the blocks' earlier users in the compute stream are done with them)
            self._after_earlier_copies(stream, slots)
            staged = torch.empty((len(slots), self.rows.shape[1]), dtype=torch.uint8, device=self.device)
            for row, slot in enumerate(slots):
                staged[row].copy_(self.rows[slot], non_blocking=True)
            scatter_device_blocks(kv_cache, block_ids, staged)
            done = stream.record_event()
        compute.wait_event(done)  # the forward waits for these copies only
        self._mark(done, slots)

    def synchronize(self) -> None:
        """Wait for every copy in flight (the engine is shutting down)."""
        for stream in (self._save_stream, self._restore_stream):
            if stream is not None:
                stream.synchronize()
        self._last_copy.clear()

    def _after_earlier_copies(self, stream: torch.cuda.Stream, slots: Sequence[int]) -> None:
        waited: set[int] = set()
        for slot in slots:
            event: Optional[torch.cuda.Event] = self._last_copy.get(slot)
            if event is not None and id(event) not in waited:
                stream.wait_event(event)
                waited.add(id(event))

    def _mark(self, event: torch.cuda.Event, slots: Sequence[int]) -> None:
        for slot in slots:
            self._last_copy[slot] = event
