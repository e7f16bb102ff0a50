"""A model runner without a model: it follows the step messages and records every KV slot it writes.

It keeps, per request, only what the `SchedulerOutput`s told it (token ids and block
tables from `new_requests`, blocks from `new_block_ids`, tokens it sampled itself),
exactly as a real or out-of-process runner must. Each step it

  1. writes K/V for every scheduled token: slot <- (the token ids up to and
     including that position, the step that wrote it);
  2. checks every position the request attends to: positions before
     `num_computed_tokens` must have been written by an *earlier* step, for exactly
     the request's own token ids up to there (a prefix-cache hit is only sound if
     the block holds that prefix's K/V); positions of this step were just written;
  3. samples a token for every request whose scheduled range reaches its end; a request
     verifying draft tokens (written as positions past its end) gets the drafts
     `accept_fn` accepts and one token more.

A violation raises `UnwrittenKVError` naming the request, position and slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from scheduler import SchedulerOutput


class UnwrittenKVError(AssertionError):
    """A request read a KV slot that does not hold its tokens' K/V."""


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)


TokenFn = Callable[[str, list[int]], int]
AcceptFn = Callable[[str, tuple[int, ...]], int]  # drafts -> how many leading ones the target accepts


class RecordingRunner:
    """Replays step messages against a ledger of written slots (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        token_fn: TokenFn = lambda request_id, token_ids: 7,
        accept_fn: AcceptFn = lambda request_id, drafts: len(drafts),
    ):
        self.block_size = block_size
        self.token_fn = token_fn
        self.accept_fn = accept_fn
        self.seqs: dict[str, _Seq] = {}
        # slot -> (prefix of token ids whose last token's K/V the slot holds, step that wrote it)
        self.slots: dict[int, tuple[tuple[int, ...], int]] = {}
        self.num_steps = 0
        self.num_tokens_written = 0

    def execute(self, so: SchedulerOutput) -> dict[str, list[int]]:
        self.num_steps += 1
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.seqs.pop(request_id, None)
        for new in so.new_requests:
            self.seqs[new.request_id] = _Seq(list(new.token_ids), list(new.block_ids))
        for request_id, block_ids in so.new_block_ids.items():
            self.seqs[request_id].block_ids.extend(block_ids)
        spec = so.scheduled_spec_decode_tokens
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            seq = self.seqs[request_id]
            start = so.num_computed_tokens[request_id]
            tokens = seq.token_ids + list(spec.get(request_id, ()))
            if start + num_tokens > len(tokens):
                raise UnwrittenKVError(f"{request_id} scheduled past its sequence and drafts")
            for pos in range(start, start + num_tokens):
                self.slots[self._slot(seq, pos)] = (tuple(tokens[: pos + 1]), self.num_steps)
            self.num_tokens_written += num_tokens
        sampled = {}
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            seq = self.seqs[request_id]
            start = so.num_computed_tokens[request_id]
            drafts = spec.get(request_id, ())
            self._check_reads(request_id, seq, start, start + num_tokens, drafts)
            if start + num_tokens == len(seq.token_ids) + len(drafts):
                accepted = list(drafts[: self.accept_fn(request_id, drafts)]) if drafts else []
                seq.token_ids += accepted
                token_id = self.token_fn(request_id, seq.token_ids)
                seq.token_ids.append(token_id)
                sampled[request_id] = [*accepted, token_id]
        return sampled

    def _check_reads(self, request_id: str, seq: _Seq, start: int, end: int, drafts: tuple[int, ...] = ()) -> None:
        tokens = seq.token_ids + list(drafts)
        for pos in range(end):
            slot = self._slot(seq, pos)
            entry: Optional[tuple[tuple[int, ...], int]] = self.slots.get(slot)
            expected = tuple(tokens[: pos + 1])
            if entry is None or entry[0] != expected:
                what = "never written" if entry is None else "written for other tokens"
                raise UnwrittenKVError(
                    f"step {self.num_steps}: {request_id} reads position {pos} from slot {slot}, {what}"
                )
            if pos < start and entry[1] >= self.num_steps:
                raise UnwrittenKVError(
                    f"step {self.num_steps}: {request_id} counts position {pos} as computed, "
                    f"but slot {slot} is only written in this step"
                )

    def _slot(self, seq: _Seq, pos: int) -> int:
        block_index = pos // self.block_size
        if block_index >= len(seq.block_ids):
            raise UnwrittenKVError(f"position {pos} is past the request's {len(seq.block_ids)} blocks")
        return seq.block_ids[block_index] * self.block_size + pos % self.block_size
