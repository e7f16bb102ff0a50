"""The draft model's own paged KV state: which of its cache's blocks each request holds, and which tokens' K/V.

A request's entry grows by catching up on the tokens the target accepted since the last proposal and by the
drafts fed to get the next draft. Drafts the target rejected are rolled back by `sync`, which keeps the common
prefix of what the cache holds and the request's tokens now:

    cache holds     t0 ... t(n-1) | d1 d2 d3            (d1..d3 fed to propose d2..d4)
    request now     t0 ... t(n-1)   d1 d2 x             (d1, d2 accepted, x the target's own token)
    after sync      t0 ... t(n-1)   d1 d2               (d3 rolled back; x is fed next)

A draft model's blocks are not shared between requests (its prompts are cheap to recompute) and go back to the
free list when the request ends or is preempted. An EAGLE head's may be: a full block it read whole is indexed
by a key (`register`: its content hash and the next token, which the head read at the block's last position),
and a later request with the same prefix takes it (`lookup`) instead of a context that starts after its
prefix-cache hit. An indexed block no request holds stays indexed until its room is needed (oldest first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence


@dataclass(slots=True)
class DraftSequence:
    """One request's K/V in the draft cache."""

    token_ids: list[int] = field(default_factory=list)  # the tokens whose K/V the cache holds, from position 0
    num_confirmed: int = 0  # leading token_ids known to be the request's own (the rest: drafts fed)
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftCache:
    """Block accounting of the draft's KV cache (its tensors: an engine `KVCache` of `num_blocks` blocks)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: block 0 first
        self.sequences: dict[str, DraftSequence] = {}
        self._holders: dict[int, int] = {}  # a block several sequences hold (lookup): how many (else one)
        self._index: dict[Hashable, int] = {}  # key -> an indexed block
        self._keys: dict[int, Hashable] = {}  # an indexed block -> its key
        self._unheld: OrderedDict[int, None] = OrderedDict()  # indexed blocks no sequence holds, oldest first

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take: free ones, and indexed ones no sequence holds."""
        return len(self._free) + len(self._unheld)

    def sync(self, request_id: str, token_ids: Sequence[int]) -> DraftSequence:
        """The request's entry (new: empty), rolled back to its longest prefix that `token_ids` share, and to
        at most all but the last of them (a proposal feeds at least one token)."""
        sequence = self.sequences.get(request_id)
        if sequence is None:
            sequence = self.sequences[request_id] = DraftSequence()
        held = sequence.token_ids
        keep = min(sequence.num_confirmed, len(token_ids) - 1)
        limit = min(len(held), len(token_ids) - 1)
        while keep < limit and held[keep] == token_ids[keep]:  # only the drafts fed since: a few tokens
            keep += 1
        del held[keep:]
        sequence.num_confirmed = keep
        return sequence

    def reserve(self, sequence: DraftSequence, num_tokens: int) -> bool:
        """Blocks for the sequence's first `num_tokens` positions; False (nothing taken) when too few are free."""
        missing = -(-num_tokens // self.block_size) - len(sequence.block_ids)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        sequence.block_ids += [self._take() for _ in range(missing)]
        return True

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._unheld.popitem(last=False)  # the oldest indexed block no sequence holds: unindexed
        del self._index[self._keys.pop(block)]
        return block

    def register(self, block: int, key: Hashable) -> None:
        """Index a block read whole under `key` (a key or a block indexed already stays as it is)."""
        if key not in self._index and block not in self._keys:
            self._index[key] = block
            self._keys[block] = key

    def lookup(self, key: Hashable) -> Optional[int]:
        """The block indexed under `key`, now held by one sequence more (the caller's); None without one."""
        block = self._index.get(key)
        if block is not None:
            if block in self._unheld:
                del self._unheld[block]
                self._holders[block] = 1
            else:
                self._holders[block] = self._holders.get(block, 1) + 1
        return block

    def slots(self, sequence: DraftSequence, start: int, end: int) -> list[int]:
        """Where positions start .. end - 1 of the sequence live in the cache (block_id * block_size + offset)."""
        size, blocks = self.block_size, sequence.block_ids
        return [blocks[position // size] * size + position % size for position in range(start, end)]

    def release(self, request_id: str) -> None:
        """Free the request's blocks (nothing happens for a request without an entry)."""
        sequence = self.sequences.pop(request_id, None)
        if sequence is not None:
            self.drop(sequence.block_ids)

    def drop(self, block_ids: Sequence[int]) -> None:
        """Let go of blocks a sequence held: free where none holds them, indexed ones kept for a later lookup."""
        for block in reversed(block_ids):
            holders = self._holders.pop(block, 1) - 1
            if holders > 0:
                self._holders[block] = holders
            elif block in self._keys:
                self._unheld[block] = None
            else:
                self._free.append(block)
