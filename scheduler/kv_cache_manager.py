"""Per-request block tables over the block pool, with prefix caching and sliding-window and chunked groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from scheduler.bidirectional_spans import hit_limit
from scheduler.block_hash import BlockHash, extend_block_hashes
from scheduler.block_pool import BlockPool, KVBlock
from scheduler.kv_tiers import KVTiers, TierOps
from scheduler.request import Request
from scheduler.state_snapshots import StateSnapshots

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV-cache group (one tuple per group, in the groups' order)."""


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

    Layer groups (`group_windows`, one entry per group: its sliding window, None for full attention). A model
    whose layers attend differently (Gemma 2/3 and GPT-OSS mix sliding-window and full layers) keeps one
    block table per group over the one shared pool; a block holds the K/V of one group's layers (the KV cache
    lays its memory out so: engine/attention/kv_cache.py). A sliding group's blocks that lie wholly before
    its window (no query from now on reads them) go back to the pool, and their entries become the null
    block (id `num_blocks`, the cache's padding block, never handed out or read):

        full group       [ 7 ] [ 2 ] [ 5 ] [ 9 ]
        sliding group    [nul] [nul] [ 4 ] [ 8 ]    window 6, 14 tokens computed: keys >= 9 are read

    So a long chat holds, in its sliding layers, only its window's blocks (vLLM's hybrid allocator). A chunked
    group (`group_chunks`: Llama 4's local attention, where a query reads the keys of its own chunk of C
    positions only) frees the blocks wholly before the chunk of the first token still to compute, as vLLM's
    chunked-local-attention manager does:

        chunked group    [nul] [nul] [nul] [ 3 ]    chunk 8, 14 tokens computed: keys >= 8 are read

    A prompt's unscheduled remainder is reserved in the full groups only (a sliding group would free most of
    it before reading it).

    A full block enters the prefix-cache index only when the step that writes its
    K/V has completed (`commit_step`): from the step that schedules it until then it is
    *pending* under that step's id, and a request freed meanwhile (preempted in that same
    step, or ended while the step is in flight) takes its pending blocks with it, unindexed.
    So a hit never points at unwritten K/V, whatever order requests are scheduled and
    preempted in. Several steps may be pending at once (pipeline parallelism keeps more
    than one in flight); each commits only its own blocks. Each group indexes its own blocks (their
    hashes tagged with the group); a hit in a sliding group needs only the blocks inside the window.

    A hybrid model's recurrent layers keep a state per request instead of K/V (`num_state_snapshots`): a hit is
    served only as far as a snapshot of those states was kept (scheduler/state_snapshots.py, which this manager
    keeps in step with its blocks: admitted, committed, discarded and freed alike).

    Tiers below the pool (`kv_tiers`: host memory, disk or both; one full-attention group only) hold blocks
    beyond it: every block a step fills is written to them too (`take_tier_ops`' saves, which the runner copies
    out after the step's forward), and a miss looks there for the blocks that follow the pool's hits
    (`tier_hits`); those get new blocks, which the runner reads in before the forward (the restores) and which
    then count as computed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        group_windows: Sequence[Optional[int]] = (None,),
        kv_tiers: Optional[KVTiers] = None,
        group_chunks: Sequence[Optional[int]] = (),
        num_state_snapshots: int = 0,
    ):
        if not group_windows:
            raise ValueError("a KV cache has at least one layer group")
        if any(window is not None and window < 1 for window in group_windows):
            raise ValueError(f"sliding windows must be >= 1, got {tuple(group_windows)}")
        group_chunks = tuple(group_chunks) or (None,) * len(group_windows)
        if len(group_chunks) != len(group_windows) or any(
            chunk is not None and (chunk < 1 or window is not None)
            for window, chunk in zip(group_windows, group_chunks)
        ):
            raise ValueError(f"chunks {group_chunks} (>= 1, on groups without a window) for windows {group_windows}")
        self.group_chunks = group_chunks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.null_block = KVBlock(num_blocks, ref_cnt=1)  # the cache's padding block: never freed, never read
        self.prefix_cache_stats = PrefixCacheStats()
        # the groups whose queries read part of the past (a window or a chunk)
        self._partial = tuple(
            g for g, (window, chunk) in enumerate(zip(self.group_windows, group_chunks)) if window or chunk
        )
        self._no_blocks: BlockIds = ((),) * self.num_groups
        self._req_blocks: dict[str, list[list[KVBlock]]] = {}  # per request, per group
        self._first_live: dict[str, list[int]] = {}  # per request, per group: entries before it are null
        self._num_cached_blocks: dict[str, int] = {}  # leading full blocks indexed or pending
        # Full blocks that steps not yet completed fill, indexed when their step completes:
        # step id -> {block id -> (block, hash)}; `_filling` is the entry of the step being scheduled.
        self._pending: dict[int, dict[int, tuple[KVBlock, BlockHash]]] = {}
        self._filling_step = 0
        self._filling: dict[int, tuple[KVBlock, BlockHash]] = self._pending.setdefault(0, {})
        self._pending_step: dict[int, int] = {}  # pending block id -> its step id (every pending step's)
        self._pending_hashes: dict[bytes, int] = {}  # hash value -> pending block id (every pending step's)
        # step id -> {request id -> its _num_cached_blocks before the step}: put back if the step never runs
        self._advanced: dict[int, dict[str, int]] = {}
        self.num_slots: dict[str, int] = {}  # token slots allocated per request in every group (read-only outside)
        if kv_tiers is not None and (len(self.group_windows) > 1 or self._partial or not enable_caching):
            raise ValueError("a KV tier needs prefix caching and one full-attention layer group")
        self.kv_tiers = kv_tiers
        self.snapshots: Optional[StateSnapshots] = None
        if num_state_snapshots:
            if self._partial or kv_tiers is not None or not enable_caching:
                raise ValueError("state snapshots need prefix caching, full-attention layer groups and no KV tier")
            self.snapshots = StateSnapshots(num_state_snapshots, block_size)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds at once at most, over all groups, computing at most
        `max_step_tokens` per step (a sliding or chunked group: its window or chunk and a step's tokens)."""
        whole = self.num_blocks_for(num_tokens)
        return sum(
            whole if span is None else min(whole, self.num_blocks_for(span + max_step_tokens) + 1)
            for span in (window or chunk for window, chunk in zip(self.group_windows, self.group_chunks))
        )

    def max_tokens_held(self, max_step_tokens: int) -> int:
        """The most tokens one request's cache can hold in the whole pool (`num_blocks_needed`'s inverse)."""
        low, high = 0, self.num_blocks * self.block_size
        while low < high:  # the largest n with num_blocks_needed(n) <= num_blocks
            middle = (low + high + 1) // 2
            if self.num_blocks_needed(middle, max_step_tokens) <= self.num_blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def get_blocks(self, request_id: str) -> Sequence[Sequence[KVBlock]]:
        """The request's blocks, per group (null entries included)."""
        return self._req_blocks.get(request_id, ())

    def get_block_ids(self, request_id: str) -> BlockIds:
        groups = self._req_blocks.get(request_id)
        if groups is None:
            return self._no_blocks
        return tuple(tuple([b.block_id for b in blocks]) for blocks in groups)

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVBlock]], int]:
        """The longest run of leading full blocks already in the cache (per group), and its length in tokens.

        The hit stops one token short of the whole sequence, so that the step
        that admits the request computes at least one token (and samples), and never ends inside one of its
        bidirectional spans (scheduler/bidirectional_spans.py). A sliding group needs only
        the blocks that the next token's window reaches (the others are null in its hit). With snapshots (a hybrid
        model's recurrent states) it stops at the last block after which one is kept.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [[] for _ in self.group_windows], 0
        self._extend_hashes(request)
        spans = request.bidirectional_spans
        max_blocks = self._hit_blocks(spans, (request.num_tokens - 1) // self.block_size)
        hashes = request.block_hashes[:max_blocks]
        get_cached = self.block_pool.get_cached_block
        if self.num_groups == 1 and not self._partial:
            hits: list[KVBlock] = []
            for block_hash in hashes:
                block = get_cached(block_hash)
                if block is None:
                    break
                hits.append(block)
            num_hits = self._snapshot_hit(spans, hashes, self._hit_blocks(spans, len(hits)))
            del hits[num_hits:]
            return [hits], len(hits) * self.block_size
        lookups: list[dict[int, Optional[KVBlock]]] = [{} for _ in self.group_windows]

        def cached(g: int, i: int) -> Optional[KVBlock]:
            if i not in lookups[g]:
                lookups[g][i] = get_cached(self._group_hash(hashes[i], g))
            return lookups[g][i]

        n = max_blocks
        for g in range(self.num_groups):
            if g not in self._partial:
                run = 0
                while run < n and cached(g, run) is not None:
                    run += 1
                n = run
        n = self._hit_blocks(spans, n)
        while self._partial:  # the largest n every sliding or chunked group serves (n = 0 always does)
            start = n
            for g in self._partial:
                i = n - 1
                while i >= self._first_needed(g, n * self.block_size) // self.block_size:
                    if cached(g, i) is None:
                        n = i  # no hit reaching past block i: try one ending just before it
                    i -= 1
            n = self._hit_blocks(spans, n)
            if n == start:
                break
        n = self._snapshot_hit(spans, hashes, n)  # (no partial group beside snapshots: a shorter run is a hit too)
        groups: list[list[KVBlock]] = []
        for g in range(self.num_groups):
            first = self._first_needed(g, n * self.block_size) // self.block_size
            blocks = [self.null_block] * first
            for i in range(first, n):
                block = cached(g, i)
                assert block is not None  # checked above
                blocks.append(block)
            groups.append(blocks)
        return groups, n * self.block_size

    def next_block_pending(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether the block after a request's `num_hit_blocks` hits (with snapshots: after every block the index
        holds, the hit may stop short of them) is being filled by a step not yet completed (the one being
        scheduled, or one in flight).

        The request would hit it once that step completes: admitting it now would compute
        the same K/V twice (n > 1 siblings, identical prompts arriving together).
        """
        if not self._pending_hashes or request.skip_prefix_cache:
            return False
        if self.snapshots is not None:  # (blocks may be hit beyond the snapshot: the next after them is the one)
            num_hit_blocks = max(num_hit_blocks, self._kv_run(request))
        if num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return False  # the hit is capped there anyway
        return request.block_hashes[num_hit_blocks].value in self._pending_hashes

    def tier_hits(self, request: Request, num_hit_blocks: int) -> int:
        """How many blocks after the request's `num_hit_blocks` pool hits the tiers hold (capped as a pool hit
        is: one token is always computed); 0 without a tier."""
        tier = self.kv_tiers
        if tier is None or request.skip_prefix_cache:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[num_hit_blocks:max_blocks]
        run = tier.run([h.value for h in hashes])
        spans = request.bidirectional_spans
        return max(self._hit_blocks(spans, num_hit_blocks + run) - num_hit_blocks, 0) if spans else run

    def _hit_blocks(self, spans: Sequence[tuple[int, int]], num_blocks: int) -> int:
        """The most of `num_blocks` leading hit blocks that end inside no bidirectional span."""
        if not spans:
            return num_blocks
        return hit_limit(spans, num_blocks * self.block_size, self.block_size) // self.block_size

    def take_tier_ops(self) -> TierOps:
        """The step's copies to and from the tiers, once its scheduling is done (KVTiers.take_ops)."""
        if self.kv_tiers is None:
            return TierOps()
        filling = {h.value: block_id for block_id, (_, h) in self._filling.items()}
        return self.kv_tiers.take_ops(self._filling_step, filling)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[Sequence[Sequence[KVBlock]]] = None,
        num_lookahead_tokens: int = 0,
        num_reserved_tokens: int = 0,
        num_restored_blocks: int = 0,
    ) -> Optional[BlockIds]:
        """Make room for `num_new_tokens` more tokens after the computed ones, scheduled now.

        `new_computed_blocks` are prefix-cache hits per group (from `get_computed_blocks`) to
        adopt first, at admission. `num_lookahead_tokens` more slots are allocated in every group and
        computed now but never hashed (draft tokens); `num_reserved_tokens` more in the full-attention groups
        only, not scheduled (the rest of a prompt admitted chunk by chunk). Returns the ids of the newly
        allocated blocks per group, or None (changing nothing but freeing blocks the windows left behind)
        when the pool cannot serve the request now.
        """
        request_id = request.request_id
        groups = self._req_blocks.get(request_id)
        block_size = self.block_size
        hits = new_computed_blocks if new_computed_blocks and new_computed_blocks[0] else None
        if groups is not None and self._partial:
            self._free_outside_windows(request_id, groups, request.num_computed_tokens)
        if groups is not None and hits is None:
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total + num_lookahead_tokens + num_reserved_tokens <= self.num_slots[request_id]:
                # Fast path (a decode within its last block, a chunk of an allocated prompt).
                self._cache_full_blocks(request, groups, num_total)
                return self._no_blocks
        num_hit_blocks = len(hits[0]) if hits is not None else 0
        num_computed = request.num_computed_tokens + (num_hit_blocks + num_restored_blocks) * block_size
        num_total = num_computed + num_new_tokens
        current = groups if groups is not None else [[] for _ in self.group_windows]
        needs = []
        for g in range(self.num_groups):
            end = num_total + num_lookahead_tokens + (0 if g in self._partial else num_reserved_tokens)
            num_held = len(current[g]) + (len(hits[g]) if hits is not None else 0)
            needs.append(max(self.num_blocks_for(end) - num_held, 0))
        num_reclaimed = 0 if hits is None else sum(1 for blocks in hits for b in blocks if b.ref_cnt == 0)
        if sum(needs) > self.block_pool.num_free_blocks - num_reclaimed:
            return None
        if groups is None:
            groups = self._req_blocks[request_id] = current
            self._first_live[request_id] = [0] * self.num_groups
            self._num_cached_blocks[request_id] = 0
            if self.snapshots is not None and not request.skip_prefix_cache:
                self.snapshots.admit(request, num_hit_blocks, self._kv_run(request))
        if hits is not None:
            null = self.null_block
            first_live = self._first_live[request_id]
            for g, blocks in enumerate(hits):
                self.block_pool.touch([b for b in blocks if b is not null])
                groups[g].extend(blocks)
                first_live[g] = sum(1 for b in blocks if b is null)
            self._num_cached_blocks[request_id] = num_hit_blocks
        new_ids = []
        for g, num_needed in enumerate(needs):
            new_blocks = self.block_pool.get_new_blocks(num_needed)
            groups[g].extend(new_blocks)
            new_ids.append(tuple([b.block_id for b in new_blocks]))
        self.num_slots[request_id] = min(len(blocks) for blocks in groups) * block_size
        if num_restored_blocks and self.kv_tiers is not None:
            restored = groups[0][num_hit_blocks : num_hit_blocks + num_restored_blocks]
            hashes = request.block_hashes[num_hit_blocks : num_hit_blocks + num_restored_blocks]
            self.kv_tiers.restore([h.value for h in hashes], [b.block_id for b in restored], block_size)
        self._cache_full_blocks(request, groups, num_total)
        return tuple(new_ids)

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        """Count a prefix-cache lookup for a request admitted for the first time (its hits from the tiers included;
        each tier counts its own when the restore is planned). The scheduler does not count a resumed one."""
        if self.enable_caching:
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release every block of the request (tail first, so its tail is evicted first)."""
        request_id = request.request_id
        groups = self._req_blocks.pop(request_id, None)
        self._first_live.pop(request_id, None)
        num_cached = self._num_cached_blocks.pop(request_id, 0)
        self.num_slots.pop(request_id, None)
        if self.snapshots is not None:
            self.snapshots.release(request_id)
        if not groups:
            return
        if self.kv_tiers is not None and num_cached and not request.skip_prefix_cache:
            # the blocks it held whole (pool hits included: uses of the tiers' copies), not those never computed
            self.kv_tiers.touch([h.value for h in request.block_hashes[:num_cached]])
        for blocks in groups:
            self._release([b for b in reversed(blocks) if b is not self.null_block])

    @property
    def num_pending_blocks(self) -> int:
        """Full blocks filled by steps that have not completed, over all of them."""
        return len(self._pending_step)

    def begin_step(self, step_id: int) -> None:
        """Blocks filled from now on are pending under `step_id` (a new step is being scheduled)."""
        if step_id in self._pending and step_id != self._filling_step:
            raise ValueError(f"step {step_id} was begun already")
        if not self._filling:  # the previous step filled no block (or its blocks were freed): nothing to keep
            self._pending.pop(self._filling_step, None)
        self._filling_step = step_id
        self._filling = self._pending.setdefault(step_id, {})

    def commit_step(self, step_id: int) -> None:
        """Step `step_id` has run: index the blocks it filled, and only those (see the class docstring)."""
        if self.kv_tiers is not None:
            self.kv_tiers.commit(step_id)
        if self.snapshots is not None:
            self.snapshots.commit(step_id)
        self._advanced.pop(step_id, None)
        entries = self._pending.get(step_id)
        if not entries:
            return
        cache_block = self.block_pool.cache_block
        pending_step = self._pending_step
        pending_hashes = self._pending_hashes
        for block_id, (block, block_hash) in entries.items():
            cache_block(block, block_hash)
            del pending_step[block_id]
            del pending_hashes[block_hash.value]
        entries.clear()
        if step_id != self._filling_step:
            del self._pending[step_id]

    def discard_steps(self) -> None:
        """Forget the pending blocks of every step: none of them will complete (a failed step, or an older
        step superseded by a newer one)."""
        if self.kv_tiers is not None:
            self.kv_tiers.discard()
        if self.snapshots is not None:
            self.snapshots.discard()
        num_cached = self._num_cached_blocks
        for advanced in self._advanced.values():  # their blocks are marked again when a step fills them
            for request_id, before in advanced.items():
                if request_id in num_cached:
                    num_cached[request_id] = min(num_cached[request_id], before)
        self._advanced.clear()
        if self._pending_step:
            for entries in self._pending.values():
                entries.clear()
            self._pending_step.clear()
            self._pending_hashes.clear()
        self._pending = {self._filling_step: self._filling}

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.snapshots is not None:
            self.snapshots.reset()
        return True

    def _snapshot_hit(self, spans: Sequence[tuple[int, int]], hashes: Sequence[BlockHash], num_blocks: int) -> int:
        """The most of `num_blocks` leading hit blocks after which a hybrid model's recurrent states were kept
        (`num_blocks` without snapshots), ending inside no bidirectional span."""
        if self.snapshots is None:
            return num_blocks
        while True:  # (each cut can only shorten the other's answer: this ends)
            cut = self._hit_blocks(spans, self.snapshots.longest_hit(hashes, num_blocks))
            if cut == num_blocks:
                return cut
            num_blocks = cut

    def _kv_run(self, request: Request) -> int:
        """How many of the request's leading blocks (capped as a hit is) every group's index holds, snapshots or
        not."""
        self._extend_hashes(request)
        max_blocks = self._hit_blocks(request.bidirectional_spans, (request.num_tokens - 1) // self.block_size)
        get_cached = self.block_pool.get_cached_block
        n = 0
        for block_hash in request.block_hashes[:max_blocks]:
            if any(get_cached(self._group_hash(block_hash, g)) is None for g in range(self.num_groups)):
                break
            n += 1
        return n

    def _release(self, blocks: list[KVBlock]) -> None:
        if self._pending_step:  # freed before the step that was to fill them completed: never indexed
            pending_step = self._pending_step
            for block in blocks:
                step_id = pending_step.pop(block.block_id, None)
                if step_id is not None:
                    _, block_hash = self._pending[step_id].pop(block.block_id)
                    del self._pending_hashes[block_hash.value]
        self.block_pool.free_blocks(blocks)

    def _first_needed(self, g: int, position: int) -> int:
        """The first key group g's queries from `position` on read: k > q - window in a sliding group, k in q's
        chunk in a chunked one, every key in a full one."""
        window, chunk = self.group_windows[g], self.group_chunks[g]
        if window is not None:
            return max(position - window + 1, 0)
        return 0 if chunk is None else position // chunk * chunk

    def _free_outside_windows(self, request_id: str, groups: list[list[KVBlock]], num_computed: int) -> None:
        """Free each sliding or chunked group's blocks that no query from position `num_computed` on reads."""
        first_live = self._first_live[request_id]
        null = self.null_block
        for g in self._partial:
            blocks = groups[g]
            first_read = min(self._first_needed(g, num_computed) // self.block_size, len(blocks))
            if first_read <= first_live[g]:
                continue
            self._release([b for b in blocks[first_live[g] : first_read] if b is not null])
            blocks[first_live[g] : first_read] = [null] * (first_read - first_live[g])
            first_live[g] = first_read

    @staticmethod
    def _group_hash(block_hash: BlockHash, group: int) -> BlockHash:
        """The block's key in the index for `group`'s copy of it (group 0: the hash itself)."""
        if group == 0:
            return block_hash
        return BlockHash(block_hash.value + group.to_bytes(2, "little"), block_hash.token_ids)

    def _extend_hashes(self, request: Request) -> None:
        """The request's full blocks' hashes, brought up to its tokens; its seed (LoRA key, cache salt) is read
        only for the first block, which it roots (a salted seed is a digest: not made again every step)."""
        seed = request.hash_seed if not request.block_hashes else None
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, seed, request.media_spans)

    def _cache_full_blocks(self, request: Request, groups: list[list[KVBlock]], num_tokens: int) -> None:
        """Mark pending the blocks that `num_tokens` (scheduled, so known) tokens fill."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        num_cached = self._num_cached_blocks[request.request_id]
        if num_full <= num_cached:
            return
        self._extend_hashes(request)
        hashes = request.block_hashes
        pending = self._filling
        pending_step = self._pending_step
        step_id = self._filling_step
        self._advanced.setdefault(step_id, {}).setdefault(request.request_id, num_cached)
        pending_hashes = self._pending_hashes
        null = self.null_block
        for g, blocks in enumerate(groups):
            for i in range(num_cached, num_full):
                block = blocks[i]
                if block is null:
                    continue
                block_hash = self._group_hash(hashes[i], g)
                if block.block_hash is None and block_hash.value not in pending_hashes:
                    pending[block.block_id] = (block, block_hash)
                    pending_step[block.block_id] = step_id
                    pending_hashes[block_hash.value] = block.block_id
        self._num_cached_blocks[request.request_id] = num_full
