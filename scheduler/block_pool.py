"""The fixed pool of KV blocks: ref counts, an LRU free queue and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from scheduler.block_hash import BlockHash


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of `block_size` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None  # set once the block is full and indexed


class BlockPool:
    """Owns every block. A block is either in use (ref_cnt > 0) or in the free queue.

    Free queue (least recently freed first):

        head -> [never used: ids next_fresh .. num_blocks - 1] [freed: LRU order] <- tail
                 (no objects yet)                                (the OrderedDict)

    Freed blocks that still hold a full, hashed block stay in the prefix-cache
    index while they wait in the queue; a later request can take them back
    (`touch`) until `get_new_blocks` pops them from the head and evicts them.

    Blocks that were never used are a range, not objects: a freed block always
    joins behind them, so they leave the queue first and in id order, and a
    block's KVBlock is made when it is first handed out. Start-up costs the
    same for a hundred blocks as for the millions a large GPU holds.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._made: list[KVBlock] = []  # blocks 0 .. len - 1, by id; the others were never used
        self._free: OrderedDict[int, KVBlock] = OrderedDict()  # freed blocks, behind the never-used ones
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def _num_fresh(self) -> int:
        return self.num_blocks - len(self._made)

    @property
    def num_free_blocks(self) -> int:
        return self._num_fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Free block ids, head (next to evict) first."""
        return [*range(len(self._made), self.num_blocks), *self._free]

    def all_blocks(self) -> list[KVBlock]:
        """Every block by id (checks and tests): a never-used one as a new, free KVBlock."""
        return [*self._made, *(KVBlock(i) for i in range(len(self._made), self.num_blocks))]

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVBlock]:
        block = self._cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop `num_blocks` from the head of the free queue, evicting their cache entries."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        first = len(self._made)
        blocks = [KVBlock(i, ref_cnt=1) for i in range(first, first + min(num_blocks, self._num_fresh))]
        self._made.extend(blocks)
        popitem = self._free.popitem
        for _ in range(num_blocks - len(blocks)):
            block = popitem(last=False)[1]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero join the tail of the free queue.

        Pass a request's blocks tail-first, so that its last blocks (the least
        likely to be shared) are evicted first.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Index a full block under its hash (first writer wins on a duplicate)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash.value in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash.value] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash.value) is block:
            del self._cached[block.block_hash.value]
        block.block_hash = None
