"""Snapshots of a hybrid model's recurrent states at block boundaries: what lets a prefix-cache hit skip recurrent
layers too.

An attention layer's K/V of a cached block serve any request whose prefix holds that block; a recurrent layer
keeps one state summarising the whole prefix instead (engine/layers/recurrent_state.py), so a hit of n blocks is
usable only where the state after token n * block_size was kept. A snapshot is a copy of a request's states (every
recurrent layer's) at such a boundary, in one of `num_slots` slots beside the requests' own rows, keyed by the
hash of the block that ends there (the hash chain names the whole prefix). A prefix-cache hit stops at the last
block that has one; the runner copies the snapshot into the request's row before the step's forward.

Which boundaries a request keeps (copying a state costs a read and a write of it, and a slot holds one):

    prompt   [=========== shared system prompt ===========|=== question ===]
    blocks   |    |    |    |    |    |    |    |    |    |    |    |    |
                                              ^ junction           ^ last   (then, decoding: ^ end, ^ end, ...)

- the *junction*: where the KV hit ran past the last snapshot (a prefix another request computed, whose state
  nobody kept there): the next request sharing that prefix restores it (vLLM's "fine-grained" Mamba prefix cache);
- the *last* boundary before the prompt's final token: the same prompt again (n > 1, retries) restores it;
- the sequence's *end*, at each boundary a step reaches with all its tokens computed (a decode filling a block):
  the next turn of a chat, whose prompt is this one with its answer, restores it. Each end replaces the request's
  previous end in its slot, so a running request holds at most one, and once it holds one its last boundary is
  evicted first (a chat's next turn needs the end; the same prompt again, its siblings, came sooner).

A boundary inside a step's prompt chunk is kept by the recurrent layers as they reach it (the runner splits the
request's chunk there), so no chunk is cut short for it. Saves are pending until their step has run (as KV blocks
are: kv_cache_manager.py), and a request that ends or is preempted before then takes its pending saves with it.
Slots are evicted least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from scheduler.block_hash import BlockHash
from scheduler.request import Request


@dataclass(frozen=True, slots=True)
class SnapshotOps:
    """One step's copies between the requests' state rows and the snapshot slots (what the step message carries)."""

    restores: tuple[tuple[str, int], ...] = ()  # (request id, slot): into the request's row before the forward
    saves: tuple[tuple[str, int, int], ...] = ()  # (request id, position, slot): its state after token position - 1


@dataclass(slots=True)
class _Save:
    request_id: str
    key: bytes
    kind: str  # "end" (the request's latest: replaced by its next), "last" or "junction"


class StateSnapshots:
    """The snapshot slots' index, on the scheduler's side (no tensors: the runner holds the states)."""

    def __init__(self, num_slots: int, block_size: int):
        if num_slots < 1:
            raise ValueError(f"state snapshots need at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._index: dict[bytes, int] = {}  # block hash -> slot, of saves whose step has run
        self._lru: OrderedDict[int, bytes] = OrderedDict()  # indexed slot -> its key, least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # (pop() hands out slot 0 first)
        self._pending: dict[int, dict[int, _Save]] = {}  # step id -> slot -> the save it runs
        self._pending_keys: set[bytes] = set()
        self._points: dict[str, list[tuple[int, str]]] = {}  # request -> (position, kind) to keep besides its ends
        self._end: dict[str, tuple[int, bytes]] = {}  # request -> (slot, key) of its latest end kept
        self._last: dict[str, tuple[int, bytes]] = {}  # request -> (slot, key) of its prompt's last boundary kept
        self._restores: list[tuple[str, int]] = []  # the step being scheduled's
        self.num_restored = 0  # admissions that restored a snapshot, ever

    @property
    def num_indexed(self) -> int:
        return len(self._index)

    def longest_hit(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The most of the first `num_blocks` blocks after which a snapshot is kept (0: none)."""
        index = self._index
        for n in range(num_blocks, 0, -1):
            if block_hashes[n - 1].value in index:
                return n
        return 0

    def admit(self, request: Request, num_hit_blocks: int, num_kv_blocks: int) -> None:
        """A request admitted with a hit of `num_hit_blocks` (restored from their snapshot) where the KV cache alone
        held `num_kv_blocks`: plan the restore, and the boundaries its prompt keeps."""
        block_size = self.block_size
        hit = num_hit_blocks * block_size
        if num_hit_blocks:
            slot = self._index[request.block_hashes[num_hit_blocks - 1].value]
            self._lru.move_to_end(slot)
            self._restores.append((request.request_id, slot))
            self.num_restored += 1
        last = (request.num_tokens - 1) // block_size * block_size
        junction = num_kv_blocks * block_size
        points = sorted({(p, "junction" if p == junction else "last") for p in (junction, last) if p > hit})
        if points:
            self._points[request.request_id] = points
        else:
            self._points.pop(request.request_id, None)

    def take_ops(self, step_id: int, scheduled: Iterable[tuple[Request, int, int]]) -> SnapshotOps:
        """The step's restores, and its saves for `scheduled` (request, tokens computed before the step, tokens
        the step computes): the points each request's tokens reach, and its end where a step completes a block
        with every token computed. A save whose key is kept already, or that finds no slot, is skipped."""
        saves: list[tuple[str, int, int]] = []
        block_size = self.block_size
        for request, start, num_tokens in scheduled:
            end = start + num_tokens
            points = self._points.get(request.request_id)
            positions: list[tuple[int, str]] = []
            if points is not None:
                while points and points[0][0] <= end:
                    point = points.pop(0)
                    if point[0] > start:
                        positions.append(point)
                if not points:
                    del self._points[request.request_id]
            if end % block_size == 0 and end == len(request.all_token_ids):
                if positions and positions[-1][0] == end:
                    positions.pop()
                positions.append((end, "end"))
                self._demote_last(request.request_id)
            hashes = request.block_hashes
            for position, kind in positions:
                if len(hashes) < position // block_size:
                    continue  # (not hashed: never the case for tokens the step computes)
                key = hashes[position // block_size - 1].value
                if key in self._index or key in self._pending_keys:
                    continue
                slot = self._take_slot(request.request_id if kind == "end" else None)
                if slot is None:
                    continue
                self._pending.setdefault(step_id, {})[slot] = _Save(request.request_id, key, kind)
                self._pending_keys.add(key)
                saves.append((request.request_id, position, slot))
        restores, self._restores = tuple(self._restores), []
        return SnapshotOps(restores, tuple(saves))

    def commit(self, step_id: int) -> None:
        """Step `step_id` has run: its saves are kept, and hit from now on."""
        for slot, save in self._pending.pop(step_id, {}).items():
            self._pending_keys.discard(save.key)
            self._index[save.key] = slot
            self._lru[slot] = save.key
            if save.kind == "end":
                self._end[save.request_id] = (slot, save.key)
            elif save.kind == "last":
                self._last[save.request_id] = (slot, save.key)

    def discard(self) -> None:
        """No pending step will run: their slots are free again."""
        for saves in self._pending.values():
            self._free.extend(saves)
        self._pending.clear()
        self._pending_keys.clear()

    def release(self, request_id: str) -> None:
        """The request ended or was preempted: its pending saves are dropped (their step may still write their
        slots, before any later step writes them again), and what it was to keep is forgotten."""
        self._points.pop(request_id, None)
        self._end.pop(request_id, None)
        self._last.pop(request_id, None)
        for saves in self._pending.values():
            for slot in [slot for slot, save in saves.items() if save.request_id == request_id]:
                self._pending_keys.discard(saves.pop(slot).key)
                self._free.append(slot)
        if self._restores:
            self._restores = [r for r in self._restores if r[0] != request_id]

    def reset(self) -> None:
        """Forget every kept snapshot (the prefix cache was reset)."""
        for slot in self._lru:
            self._free.append(slot)
        self._index.clear()
        self._lru.clear()
        self._end.clear()
        self._last.clear()

    def _take_slot(self, ending: Optional[str]) -> Optional[int]:
        """A slot for a save: the previous end's of request `ending` (replaced), a free one, or the least recently
        used one's (evicted); None when every slot is pending."""
        if ending is not None and ending in self._end:
            slot, key = self._end.pop(ending)
            if self._index.get(key) == slot:
                self._unindex(slot)
                return slot
        if self._free:
            return self._free.pop()
        if self._lru:
            slot = next(iter(self._lru))
            self._unindex(slot)
            return slot
        return None

    def _demote_last(self, request_id: str) -> None:
        """The request keeps an end now (what its next turn restores): its prompt's last boundary, kept for the
        same prompt again, is evicted first from now on (it stays until a slot is needed)."""
        kept = self._last.pop(request_id, None)
        if kept is not None and self._index.get(kept[1]) == kept[0]:
            self._lru.move_to_end(kept[0], last=False)

    def _unindex(self, slot: int) -> None:
        del self._index[self._lru.pop(slot)]
