"""Per-request block tables over the block pool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.block_pool import BlockPool, KVBlock
from scheduler.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache lookups, in tokens."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Maps each request to the blocks that hold its K/V.

    Request tokens and blocks (block_size 4):

        tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .  .
        blocks   [  blk 7   ] [  blk 2    ] [ blk 5    ]   <- block table [7, 2, 5]
                 full, hashed  full, hashed  partial, never shared

    Token i lives in slot `table[i // block_size] * block_size + i % block_size`.

    A full block enters the prefix-cache index only when the step that writes its
    K/V has completed (`commit_step`): while a step is being scheduled its newly
    filled blocks are *pending*, and a request preempted in that same step takes
    its pending blocks with it, unindexed. So a hit never points at unwritten K/V,
    whatever order requests are scheduled and preempted in.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading full blocks indexed or pending
        # Full blocks the current step fills, indexed once it completes: block id -> (block, hash).
        self._pending: dict[int, tuple[KVBlock, BlockHash]] = {}
        self._pending_hashes: dict[bytes, int] = {}  # hash value -> pending block id
        self.num_slots: dict[str, int] = {}  # token slots allocated per request (read-only outside)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_blocks(self, request_id: str) -> Sequence[KVBlock]:
        return self._req_blocks.get(request_id, ())

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of leading full blocks already in the cache, and its length in tokens.

        The hit stops one token short of the whole sequence, so that the step
        that admits the request computes at least one token (and samples).
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        get_cached = self.block_pool.get_cached_block
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def next_block_pending(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the block after a request's `num_hit_blocks` hits is being filled in this step.

        The request would hit it once the step completes: admitting it now would compute
        the same K/V twice (n > 1 siblings, identical prompts arriving together).
        """
        if not self._pending_hashes or request.skip_prefix_cache:
            return False
        if num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return False  # the hit is capped there anyway
        return request.block_hashes[num_hit_blocks].value in self._pending_hashes

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> Optional[Sequence[KVBlock]]:
        """Make room for `num_new_tokens` more tokens after the computed ones, scheduled now.

        `new_computed_blocks` are prefix-cache hits (from `get_computed_blocks`) to
        adopt first, at admission. `num_lookahead_tokens` more slots are allocated but
        not scheduled (the rest of a prompt admitted chunk by chunk). Returns the newly
        allocated blocks, or None (changing nothing) when the pool cannot serve the
        request now.
        """
        req_blocks = self._req_blocks.get(request.request_id)
        block_size = self.block_size
        if req_blocks is not None and not new_computed_blocks:
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total + num_lookahead_tokens <= len(req_blocks) * block_size:
                # Fast path (a decode within its last block, a chunk of an allocated prompt).
                self._cache_full_blocks(request, req_blocks, num_total)
                return ()
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * block_size
        num_total = num_computed + num_new_tokens
        if req_blocks is None:
            req_blocks = self._req_blocks[request.request_id] = []
            self._num_cached_blocks[request.request_id] = 0
        num_needed = self.num_blocks_for(num_total + num_lookahead_tokens) - len(req_blocks) - len(new_computed_blocks)
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_reclaimed:
            if not req_blocks:
                del self._req_blocks[request.request_id]
                del self._num_cached_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        self.num_slots[request.request_id] = len(req_blocks) * block_size
        self._cache_full_blocks(request, req_blocks, num_total)
        return new_blocks

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup for an admitted request."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so its tail is evicted first)."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.num_slots.pop(request.request_id, None)
        if not blocks:
            return
        if self._pending:  # preempted in the step that was to fill them: never indexed
            for block in blocks:
                entry = self._pending.pop(block.block_id, None)
                if entry is not None:
                    del self._pending_hashes[entry[1].value]
        self.block_pool.free_blocks(reversed(blocks))

    def commit_step(self) -> None:
        """The scheduled step has run: index the blocks it filled (see the class docstring)."""
        cache_block = self.block_pool.cache_block
        for block, block_hash in self._pending.values():
            cache_block(block, block_hash)
        self.discard_step()

    def discard_step(self) -> None:
        """Forget the pending blocks of a step that will not complete (or before scheduling anew)."""
        if self._pending:
            self._pending.clear()
            self._pending_hashes.clear()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVBlock], num_tokens: int) -> None:
        """Mark pending the blocks that `num_tokens` (scheduled, so known) tokens fill."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        hashes = request.block_hashes
        pending = self._pending
        pending_hashes = self._pending_hashes
        for i in range(num_cached, num_full):
            block, block_hash = req_blocks[i], hashes[i]
            if block.block_hash is None and block_hash.value not in pending_hashes:
                pending[block.block_id] = (block, block_hash)
                pending_hashes[block_hash.value] = block.block_id
        self._num_cached_blocks[request.request_id] = num_full
