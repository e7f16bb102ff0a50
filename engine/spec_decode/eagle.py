"""EAGLE, EAGLE-3 and multi-token-prediction speculation: a draft head reads the target's hidden states beside
the tokens (an EAGLE head trained on the target, or the target checkpoint's own prediction layer: mtp.py).

The runner puts each step's features of every computed position in its output (`draft_features`: the final
hidden states, or EAGLE-3's three layers' residual streams); the scheduler hands the running requests' to
`observe` before it appends the step's tokens. The head at position p reads token p + 1 with the target's
feature of p (engine/spec_decode/eagle_model.py), so for a request of n tokens it can take positions up to n - 2.
`observe` reads at once every position whose next token is known (a prompt's chunks, in the step that computed
them, for all the step's requests in one forward), and keeps the rest (a row or two) for the proposal:

    forward 1      positions the head has not read, with the target's features (the accepted tokens since the
                   last proposal: 1 to k + 1 of them) -> d1
    forward j      d(j-1) at the next position, with the head's own output before it as its feature -> dj

The positions fed with the head's own outputs are not the target's: the next proposal drops them and feeds the
target's features there instead (the head's cache keeps only positions read with the target's). A position the
target never computed (a prefix-cache hit) has no feature: the head takes the blocks it read whole for another
request with the same prefix (indexed in its cache by the target's block hashes: draft_cache.py), else its
cache starts past the hit (`offset`), its positions still the absolute ones, so drafts read a shorter context
(more rejections, the same tokens). The drafts travel in the step message like any proposer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Optional, Protocol, Sequence, cast

import torch

from engine.attention import AttentionBackend
from engine.attention.kv_cache import KVCache
from engine.attention.step_metadata import step_metadata_for
from engine.spec_decode.draft_cache import DraftCache, DraftSequence
from scheduler import DraftQuery


class DraftHead(Protocol):
    """What the proposer runs: an EAGLE / EAGLE-3 head (eagle_model.py) or a prediction layer (mtp.py)."""

    arch: Any  # its LlamaArch (max_position_embeddings: its context)
    device: torch.device

    def combine(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features of some positions -> what the head reads as a position's feature."""
        ...

    def forward_head(self, input_ids, positions, features, kv_caches, metadata, backend) -> torch.Tensor:
        """Rows reading token p + 1 and the feature of p at position p -> their outputs (the next features)."""
        ...

    def draft_tokens(self, out: torch.Tensor, vocab_limit: int) -> list[int]:
        """The greedy next target token of each output row."""
        ...


@dataclass(slots=True)
class _HeadSequence:
    """One request's state in the head: the positions its cache holds, and the target's features not read yet."""

    cached: DraftSequence = field(default_factory=DraftSequence)  # blocks; token_ids: one per position held
    offset: int = 0  # the first position the cache holds (cache index = position - offset)
    num_read: int = 0  # positions offset .. offset + num_read - 1 read with the target's features (the rest fed
    # with the head's own outputs, dropped by the next proposal)
    features_start: int = 0  # the position of features' first row
    features: Optional[torch.Tensor] = None  # [rows, width]: the target's, positions the head has not read
    num_indexed: int = 0  # leading blocks indexed in the cache for other requests (DraftCache.register)

    @property
    def read_end(self) -> int:
        return self.offset + self.num_read


class _Row(NamedTuple):
    """One request's query rows in a head forward."""

    query: int  # its index in the proposal
    sequence: _HeadSequence
    token_ids: list[int]  # the tokens read at positions start .. start + len - 1 (token p + 1 at position p)
    start: int
    features: torch.Tensor  # [len, hidden]: the combined feature of each position


class EagleProposer:
    """The `FeatureDraftProposer` of `{"method": "eagle"}`, `{"method": "eagle3"}` and `{"method": "mtp"}`."""

    def __init__(
        self,
        head: DraftHead,
        backend: AttentionBackend,
        kv_cache: KVCache,
        num_speculative_tokens: int,
        vocab_limit: int,
        max_catch_up_tokens: int,
        max_positions: int,
    ):
        """`vocab_limit`: drafts are target ids below it; `max_catch_up_tokens`: positions one proposal reads at
        most, and the target features a request keeps unread at most (older ones are dropped: the head's context
        then starts later); `max_positions`: the head's context (a sequence past it gets no drafts)."""
        self.head = head
        self.backend = backend
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_limit = vocab_limit
        self.max_catch_up_tokens = max_catch_up_tokens
        self.max_positions = max_positions
        self.cache = DraftCache(kv_cache.num_blocks, kv_cache.spec.block_size)
        self._sequences: dict[str, _HeadSequence] = {}

    @property
    def num_requests(self) -> int:
        """Requests the head holds any state of."""
        return len(self._sequences)

    @torch.inference_mode()
    def observe(self, features: Mapping[str, object], requests: Sequence[DraftQuery]) -> None:
        """A step's features of the positions it computed, by request, (first position, [rows, width]), with each
        request's tokens before the step's: the head reads at once every position whose next token is known (a
        prompt's chunks as they are computed: its context whole, the features kept a row or two), one forward
        for the step's requests together."""
        for request in requests:
            self._keep(request.request_id, *cast(tuple[int, torch.Tensor], features[request.request_id]))
        queries = [request._replace(max_num_tokens=1) for request in requests]
        rows = self._catch_up_rows(queries, [1] * len(queries))  # (a limit of 1: no room kept for drafts)
        if rows:
            self._read(rows, queries)

    def _keep(self, request_id: str, start: int, rows: torch.Tensor) -> None:
        """The target's features of positions start .. start + len(rows) - 1, joined to those kept unread."""
        sequence = self._sequences.get(request_id)
        if sequence is None:
            sequence = self._sequences[request_id] = _HeadSequence()
        held = sequence.features
        if held is not None and sequence.features_start <= start <= sequence.features_start + held.shape[0]:
            # contiguous, or over rows of rejected drafts (the target's positions from `start` are recomputed)
            rows = torch.cat([held[: start - sequence.features_start], rows])
            start = sequence.features_start
        if start < sequence.read_end:  # positions the head read already (a target step recomputing them)
            rows, start = rows[sequence.read_end - start :], sequence.read_end
        excess = rows.shape[0] - self.max_catch_up_tokens
        if excess > 0:  # more than a proposal reads (none read for long): the oldest go, the context starts later
            rows, start = rows[excess:], start + excess
        sequence.features, sequence.features_start = rows.clone() if rows.shape[0] else None, start

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)
        self._sequences.pop(request_id, None)

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """Nothing: the head learns nothing from outputs (its state goes in `release`)."""

    def shutdown(self) -> None:
        """Drop the head's KV cache and every request's state (the engine is shutting down)."""
        for request_id in list(self._sequences):
            self.release(request_id)
        self.kv_cache.release()

    @torch.inference_mode()
    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[Sequence[int]]:
        drafts: list[list[int]] = [[] for _ in queries]
        limits = [min(q.max_num_tokens, self.max_positions - len(q.token_ids)) for q in queries]
        rows = self._catch_up_rows(queries, limits)
        if not rows:
            return list(drafts)
        # Only a row that reached the request's position n - 2 drafts (a prompt read in part waits).
        last = [row for row in rows if row.start + len(row.token_ids) == len(queries[row.query].token_ids) - 1]
        outputs = {row.query: out[-1:] for row, out in zip(rows, self._read(rows, queries))}
        active = [row for row in last]
        step_outs = [outputs[row.query] for row in active]
        while active:
            tokens = self.head.draft_tokens(torch.cat(step_outs), self.vocab_limit) if step_outs else []
            next_rows: list[_Row] = []
            for row, token_id, out in zip(active, tokens, step_outs):
                drafts[row.query].append(token_id)
                if len(drafts[row.query]) >= limits[row.query]:
                    continue
                sequence = row.sequence
                position = sequence.offset + sequence.cached.num_tokens  # the next position after the last fed
                sequence.cached.token_ids.append(token_id)  # fed with the head's own feature: dropped next time
                next_rows.append(_Row(row.query, sequence, [token_id], position, out))
            if not next_rows:
                break
            active, step_outs = next_rows, [out[-1:] for out in self._forward(next_rows)]
        return list(drafts)

    def _read(self, rows: list[_Row], queries: Sequence[DraftQuery]) -> list[torch.Tensor]:
        """A forward over rows of the target's features; the positions are the head's to keep (read), the
        features read dropped, the blocks read whole from position 0 on indexed for other requests. Each row's
        outputs."""
        outs = self._forward(rows)
        for row in rows:
            sequence = row.sequence
            sequence.num_read += len(row.token_ids)
            sequence.cached.token_ids += row.token_ids
            sequence.cached.num_confirmed = sequence.num_read
            if sequence.features is not None:  # the rows read go (features_start <= row.start: _catch_up_rows)
                keep = sequence.features[sequence.read_end - sequence.features_start :]
                sequence.features = keep if keep.shape[0] else None
                sequence.features_start = sequence.read_end
            self._index_blocks(sequence, queries[row.query])
        return outs

    def _index_blocks(self, sequence: _HeadSequence, query: DraftQuery) -> None:
        """Index the sequence's blocks it has read whole (from position 0: a context that starts later is not
        another request's) by their content hash and the token after them."""
        if sequence.offset:
            return
        size, tokens, hashes = self.cache.block_size, query.token_ids, query.block_hashes
        done = min(sequence.read_end // size, len(hashes), (len(tokens) - 1) // size)
        for block in range(sequence.num_indexed, done):
            self.cache.register(sequence.cached.block_ids[block], _block_key(hashes[block], tokens[(block + 1) * size]))
        sequence.num_indexed = max(sequence.num_indexed, done)

    def _adopt(self, sequence: _HeadSequence, query: DraftQuery) -> None:
        """A new sequence whose first target feature is past position 0 (a prefix-cache hit): the indexed blocks
        of its prefix, if other requests read all of them, so that it reads on from there with their context."""
        size, tokens, hashes = self.cache.block_size, query.token_ids, query.block_hashes
        wanted = sequence.features_start // size
        if not hashes or wanted * size != sequence.features_start or len(hashes) < wanted:
            return
        blocks = []
        for block in range(wanted):
            found = self.cache.lookup(_block_key(hashes[block], tokens[(block + 1) * size]))
            if found is None:
                break
            blocks.append(found)
        if len(blocks) < wanted:
            self.cache.drop(blocks)
            return
        cached = sequence.cached
        cached.block_ids = blocks
        cached.token_ids = list(tokens[1 : wanted * size + 1])
        sequence.num_read = sequence.num_indexed = cached.num_confirmed = wanted * size

    def _catch_up_rows(self, queries: Sequence[DraftQuery], limits: list[int]) -> list[_Row]:
        """Each query's positions the head has not read with the target's features (within the catch-up budget),
        with blocks reserved for them and for the drafts to feed after; a request without features there, or
        that the cache has no room for, gets no drafts this step."""
        budget = self.max_catch_up_tokens
        rows = []
        for index, (query, limit) in enumerate(zip(queries, limits)):
            if budget <= 0:
                break
            sequence = self._sequences.get(query.request_id)
            if limit <= 0 or sequence is None or sequence.features is None:
                continue
            self.cache.sequences[query.request_id] = sequence.cached
            if sequence.read_end == 0 and sequence.features_start > 0:  # new, after a prefix-cache hit
                self._adopt(sequence, query)
            cached = sequence.cached
            del cached.token_ids[sequence.num_read :]  # the positions fed with the head's own outputs
            first = sequence.read_end
            if sequence.features_start > first:  # no feature there: the cache restarts where they begin
                self.cache.release(query.request_id)
                sequence.cached = cached = DraftSequence()
                sequence.offset = first = sequence.features_start
                sequence.num_read = sequence.num_indexed = 0
                self.cache.sequences[query.request_id] = cached
            target_end = len(query.token_ids) - 1  # positions below it have the target's features
            end = min(target_end, sequence.features_start + sequence.features.shape[0], first + budget)
            if end <= first:
                continue
            complete = end == target_end
            if not self.cache.reserve(cached, end - sequence.offset + (limit - 1 if complete else 0)):
                continue
            budget -= end - first
            lo = first - sequence.features_start
            features = self.head.combine(sequence.features[lo : lo + end - first])
            rows.append(_Row(index, sequence, list(query.token_ids[first + 1 : end + 1]), first, features))
        return rows

    def _forward(self, rows: list[_Row]) -> list[torch.Tensor]:
        """One head forward over `rows` (their K/V written into the head's cache): each row's outputs
        [len, hidden], in `rows`' order."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].token_ids) > 1)  # decodes first
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        features = []
        spans: dict[int, tuple[int, int]] = {}
        for i in order:
            row = rows[i]
            sequence = row.sequence
            lo, hi = row.start - sequence.offset, row.start - sequence.offset + len(row.token_ids)
            spans[i] = (len(input_ids), len(input_ids) + len(row.token_ids))
            input_ids += row.token_ids
            positions += range(row.start, row.start + len(row.token_ids))
            slots += self.cache.slots(sequence.cached, lo, hi)
            features.append(row.features)
        device = self.kv_cache.layers[0][0].device
        step = step_metadata_for(
            [
                (
                    rows[i].start - rows[i].sequence.offset + len(rows[i].token_ids),
                    len(rows[i].token_ids),
                    rows[i].sequence.cached.block_ids,
                )
                for i in order
            ],
            torch.tensor(slots, dtype=torch.int64),
            sum(1 for i in order if len(rows[i].token_ids) == 1),
            device,
        )
        metadata = self.backend.build_metadata(step, self.kv_cache.spec)
        out = self.head.forward_head(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            torch.cat(features).to(device),
            self.kv_cache.layers,
            [metadata] * len(self.kv_cache.layers),
            self.backend,
        )  # [num_tokens, hidden]
        return [out[spans[i][0] : spans[i][1]] for i in range(len(rows))]


def _block_key(block_hash: object, next_token: int) -> tuple[object, int]:
    """A head block's key: the target's block hash (its tokens, and what else the target's K/V depended on:
    adapters, images, a salt) and the token the head read at its last position."""
    return getattr(block_hash, "value", block_hash), next_token
