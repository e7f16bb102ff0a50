"""A model runner without a model: it follows the step messages and records every KV slot it writes.

It keeps, per request, only what the `SchedulerOutput`s told it (token ids and block
tables from `new_requests`, blocks from `new_block_ids`, tokens it sampled itself),
exactly as a real or out-of-process runner must. Each step it

  1. writes K/V for every scheduled token: slot <- (the token ids up to and
     including that position, the step that wrote it);
  2. checks every position the request attends to (in a sliding-window group, those inside the
     window of the step's first query; the others may already be freed): positions before
     `num_computed_tokens` must have been written by an *earlier* step, for exactly
     the request's own token ids up to there (a prefix-cache hit is only sound if
     the block holds that prefix's K/V); positions of this step were just written; with
     `track_completion`, the earlier step must also have been updated already (`complete`): what
     the scheduler promises with several steps in flight, where a step still in flight may
     be abandoned;
  3. samples a token for every request whose scheduled range reaches its end; a request
     verifying draft tokens (written as positions past its end) gets the drafts
     `accept_fn` accepts and one token more.

A violation raises `UnwrittenKVError` naming the request, position and slot.

With `track_states` it also plays a hybrid model's recurrent states: each request's state is the tokens it has
consumed (unknown when it arrives: the row may hold anyone's), a step's `state_restores` set it from a snapshot
slot before anything is computed, a chunk must continue from exactly its first `num_computed_tokens` tokens (a
request computing its first token starts from zero), and `state_saves` put its tokens up to the position into
the slot. A restore must read a slot saved by an earlier, completed step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from scheduler import SchedulerOutput


class UnwrittenKVError(AssertionError):
    """A request read a KV slot that does not hold its tokens' K/V."""


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache layer group


TokenFn = Callable[[str, list[int]], int]
AcceptFn = Callable[[str, tuple[int, ...]], int]  # drafts -> how many leading ones the target accepts


class RecordingRunner:
    """Replays step messages against a ledger of written slots (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        token_fn: TokenFn = lambda request_id, token_ids: 7,
        accept_fn: AcceptFn = lambda request_id, drafts: len(drafts),
        group_windows: Sequence[Optional[int]] = (None,),
        null_block: Optional[int] = None,
        track_completion: bool = False,
        track_states: bool = False,
    ):
        """`group_windows`: the scheduler's KV groups' sliding windows; `null_block`: the id a freed sliding
        block's entry becomes (never written, never read inside a window); `track_completion`: reads of computed
        positions must find writes of steps reported by `complete`."""
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.null_block = null_block
        self.token_fn = token_fn
        self.accept_fn = accept_fn
        self.seqs: dict[str, _Seq] = {}
        # slot -> (prefix of token ids whose last token's K/V the slot holds, step that wrote it, its step_id)
        self.slots: dict[int, tuple[tuple[int, ...], int, int]] = {}
        self.completed: Optional[set[int]] = set() if track_completion else None  # step ids updated
        self.num_steps = 0
        self.num_tokens_written = 0
        # with track_states: request -> the tokens its recurrent state has consumed (None: unknown), and snapshot
        # slot -> (the tokens it holds the state after, its step_id)
        self.states: Optional[dict[str, Optional[tuple[int, ...]]]] = {} if track_states else None
        self.snapshots: dict[int, tuple[tuple[int, ...], int]] = {}
        self.num_restores = 0

    def complete(self, step_id: int) -> None:
        """The scheduler has taken step `step_id`'s update: later steps may count its writes as computed."""
        assert self.completed is not None, "built without track_completion"
        self.completed.add(step_id)

    def execute(self, so: SchedulerOutput) -> dict[str, list[int]]:
        self.num_steps += 1
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.seqs.pop(request_id, None)
        for new in so.new_requests:
            assert len(new.block_ids) == len(self.group_windows)
            self.seqs[new.request_id] = _Seq(list(new.token_ids), [list(ids) for ids in new.block_ids])
        for request_id, block_ids in so.new_block_ids.items():
            assert len(block_ids) == len(self.group_windows)
            for group, ids in zip(self.seqs[request_id].block_ids, block_ids):
                group.extend(ids)
        if self.states is not None:
            self._play_states(so)
        spec = so.scheduled_spec_decode_tokens
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            seq = self.seqs[request_id]
            start = so.num_computed_tokens[request_id]
            tokens = seq.token_ids + list(spec.get(request_id, ()))
            if start + num_tokens > len(tokens):
                raise UnwrittenKVError(f"{request_id} scheduled past its sequence and drafts")
            for pos in range(start, start + num_tokens):
                for group in range(len(self.group_windows)):
                    self.slots[self._slot(seq, pos, group)] = (tuple(tokens[: pos + 1]), self.num_steps, so.step_id)
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

    def _play_states(self, so: SchedulerOutput) -> None:
        states = self.states
        assert states is not None
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            states.pop(request_id, None)
        for new in so.new_requests:
            states[new.request_id] = None  # (its row's content is whoever held it last)
        for request_id, slot in so.state_restores:
            entry = self.snapshots.get(slot)
            if entry is None:
                raise UnwrittenKVError(
                    f"step {self.num_steps}: {request_id} restores snapshot slot {slot}, never saved"
                )
            if self.completed is not None and entry[1] not in self.completed:
                raise UnwrittenKVError(
                    f"step {self.num_steps}: {request_id} restores snapshot slot {slot}, saved by step id {entry[1]}, "
                    "still in flight"
                )
            states[request_id] = entry[0]
            self.num_restores += 1
        saves: dict[str, list[tuple[int, int]]] = {}
        for request_id, position, slot in so.state_saves:
            saves.setdefault(request_id, []).append((position, slot))
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            tokens, start = self.seqs[request_id].token_ids, so.num_computed_tokens[request_id]
            state = () if start == 0 else states[request_id]
            if state != tuple(tokens[:start]):
                raise UnwrittenKVError(
                    f"step {self.num_steps}: {request_id} continues from position {start} on a recurrent state "
                    f"of {'unknown tokens' if state is None else f'{len(state)} other tokens'}"
                )
            for position, slot in saves.pop(request_id, ()):
                if not start < position <= start + num_tokens:
                    raise UnwrittenKVError(f"{request_id} saves position {position} outside its chunk")
                self.snapshots[slot] = (tuple(tokens[:position]), so.step_id)
            states[request_id] = tuple(tokens[: start + num_tokens])
        if saves:
            raise UnwrittenKVError(f"saves of requests the step does not compute: {sorted(saves)}")

    def _check_reads(self, request_id: str, seq: _Seq, start: int, end: int, drafts: tuple[int, ...] = ()) -> None:
        tokens = seq.token_ids + list(drafts)
        for group, window in enumerate(self.group_windows):
            first = 0 if window is None else max(start - window + 1, 0)
            for pos in range(first, end):
                self._check_read(request_id, seq, pos, group, start, tokens)

    def _check_read(self, request_id: str, seq: _Seq, pos: int, group: int, start: int, tokens: list[int]) -> None:
        slot = self._slot(seq, pos, group)
        entry: Optional[tuple[tuple[int, ...], int, int]] = self.slots.get(slot)
        expected = tuple(tokens[: pos + 1])
        if entry is None or entry[0] != expected:
            what = "never written" if entry is None else "written for other tokens"
            raise UnwrittenKVError(f"step {self.num_steps}: {request_id} reads position {pos} from slot {slot}, {what}")
        if pos < start and entry[1] >= self.num_steps:
            raise UnwrittenKVError(
                f"step {self.num_steps}: {request_id} counts position {pos} as computed, "
                f"but slot {slot} is only written in this step"
            )
        if pos < start and self.completed is not None and entry[2] not in self.completed:
            raise UnwrittenKVError(
                f"step {self.num_steps}: {request_id} counts position {pos} as computed, "
                f"but slot {slot} was written by step id {entry[2]}, still in flight"
            )

    def _slot(self, seq: _Seq, pos: int, group: int) -> int:
        block_index = pos // self.block_size
        blocks = seq.block_ids[group]
        if block_index >= len(blocks):
            raise UnwrittenKVError(f"position {pos} is past the request's {len(blocks)} blocks in group {group}")
        if blocks[block_index] == self.null_block:
            raise UnwrittenKVError(f"position {pos} of group {group} is in a freed (null) block")
        return blocks[block_index] * self.block_size + pos % self.block_size
