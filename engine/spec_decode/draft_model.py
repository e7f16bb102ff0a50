"""Draft-model speculation: a smaller model of the same vocabulary proposes each request's next k tokens greedily.

One proposal for the step's decoding requests together, over the draft's own paged KV cache (`DraftCache`):

    forward 1      every request's tokens the draft has not seen (the target's accepted tokens since the last
                   proposal: 1 to k + 1 of them; a new or resumed request's whole sequence, within a token
                   budget) -> d1 of each request that reached its last token
    forward j      d(j-1) of each request still short of its limit, one decode row each  -> dj   (j = 2 .. k)

The drafts travel in the step message like any proposer's: a worker verifying them needs no draft model. The
proposer runs where the scheduler runs, between steps; the drafts it fed stay in its cache until the next
proposal rolls back the rejected ones (`DraftCache.sync`).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from engine.attention import AttentionBackend
from engine.attention.kv_cache import KVCache
from engine.attention.step_metadata import step_metadata_for
from engine.models.llama import LlamaForCausalLM
from engine.spec_decode.draft_cache import DraftCache, DraftSequence
from scheduler import DraftQuery


class _Row(NamedTuple):
    """One request's query tokens in a draft forward."""

    query: int  # its index in the proposal
    sequence: DraftSequence
    token_ids: list[int]  # fed at positions start .. start + len - 1
    start: int


class DraftModelProposer:
    """The `BatchDraftProposer` of `{"method": "draft_model"}`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        kv_cache: KVCache,
        num_speculative_tokens: int,
        vocab_limit: int,
        max_catch_up_tokens: int,
        max_positions: int,
    ):
        """`vocab_limit`: drafts are taken among token ids below it (the vocabulary both models have: a draft's
        padded rows past it are never proposed); `max_catch_up_tokens`: tokens one proposal feeds at most
        (a long new prompt is caught up over several steps, drafting once it is in); `max_positions`: the
        draft's context (a sequence past it gets no drafts)."""
        self.model = model
        self.backend = backend
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_limit = vocab_limit
        self.max_catch_up_tokens = max_catch_up_tokens
        self.max_positions = max_positions
        self.cache = DraftCache(kv_cache.num_blocks, kv_cache.spec.block_size)

    @property
    def num_requests(self) -> int:
        """Requests whose K/V the draft cache holds."""
        return len(self.cache.sequences)

    def release(self, request_id: str) -> None:
        self.cache.release(request_id)

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """Nothing: the draft model learns nothing from outputs (its state goes in `release`)."""

    def shutdown(self) -> None:
        """Drop the draft's KV cache and every request's state (the engine is shutting down)."""
        for request_id in list(self.cache.sequences):
            self.cache.release(request_id)
        self.kv_cache.release()

    @torch.inference_mode()
    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[Sequence[int]]:
        drafts: list[list[int]] = [[] for _ in queries]
        # Drafts sit at positions len .. len + limit - 1: within the draft's context.
        limits = [min(q.max_num_tokens, self.max_positions - len(q.token_ids)) for q in queries]
        rows = self._catch_up_rows(queries, limits)
        if not rows:
            return list(drafts)
        # Only a row that reached the request's last token drafts (a prompt caught up in part waits).
        last = [row for row in rows if row.start + len(row.token_ids) == len(queries[row.query].token_ids)]
        tokens = self._forward(rows, last)
        active = []
        for row, token_id in zip(last, tokens):
            drafts[row.query].append(token_id)
            if limits[row.query] > 1:
                active.append(row)
        while active:  # one decode row per request still short of its limit
            rows = [_Row(r.query, r.sequence, [drafts[r.query][-1]], r.sequence.num_tokens) for r in active]
            for row in rows:
                row.sequence.token_ids.append(row.token_ids[0])  # a draft fed: unconfirmed (rolled back by sync)
            active = []
            for row, token_id in zip(rows, self._forward(rows, rows)):
                drafts[row.query].append(token_id)
                if len(drafts[row.query]) < limits[row.query]:
                    active.append(row)
        return list(drafts)

    def _catch_up_rows(self, queries: Sequence[DraftQuery], limits: list[int]) -> list[_Row]:
        """Each query's tokens the draft has not computed (within the catch-up budget), with blocks reserved for
        them and for the drafts to feed after; a request the cache has no room for gets no drafts this step."""
        cache, budget = self.cache, self.max_catch_up_tokens
        rows = []
        for index, (query, limit) in enumerate(zip(queries, limits)):
            if budget <= 0:
                break
            if limit <= 0:
                continue
            sequence = cache.sync(query.request_id, query.token_ids)
            start = sequence.num_tokens
            feed = list(query.token_ids[start : start + budget])
            complete = start + len(feed) == len(query.token_ids)
            if not cache.reserve(sequence, start + len(feed) + (limit - 1 if complete else 0)):
                continue
            budget -= len(feed)
            sequence.token_ids += feed
            sequence.num_confirmed = sequence.num_tokens
            rows.append(_Row(index, sequence, feed, start))
        return rows

    def _forward(self, rows: list[_Row], sampled: list[_Row]) -> list[int]:
        """One forward over `rows` (their K/V written into the draft cache); the greedy next token after each
        row of `sampled` (a subset of `rows`), in its order."""
        order = sorted(rows, key=lambda row: len(row.token_ids) > 1)  # decodes first (StepMetadata's layout)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_row: dict[int, int] = {}  # query index -> its last token's row
        for row in order:
            end = row.start + len(row.token_ids)
            input_ids += row.token_ids
            positions += range(row.start, end)
            slots += self.cache.slots(row.sequence, row.start, end)
            last_row[row.query] = len(input_ids) - 1
        device = self.kv_cache.layers[0][0].device
        step = step_metadata_for(
            [(row.start + len(row.token_ids), len(row.token_ids), row.sequence.block_ids) for row in order],
            torch.tensor(slots, dtype=torch.int64),
            sum(1 for row in order if len(row.token_ids) == 1),
            device,
        )
        metadata = self.backend.build_metadata(step, self.kv_cache.spec)
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.kv_cache.layers,
            [metadata] * len(self.kv_cache.layers),  # one block table for every layer (a window is read, not freed)
            self.backend,
        )  # [num_tokens, hidden]
        if not sampled:  # prompts caught up in part only: their K/V is all this forward is for
            return []
        picked = torch.tensor([last_row[row.query] for row in sampled], dtype=torch.int64, device=device)
        logits = self.model.compute_logits(hidden.index_select(0, picked))  # [len(sampled), vocab]
        return logits[:, : self.vocab_limit].argmax(dim=-1).tolist()
