"""The runner's side of structured output: a matcher per constrained request, a bitmask per step.

step:   fill_bitmask(rows)  ->  TokenBitmask (host fill, one upload)  ->  sampler masks its logits
after:  accept(state, token) per constrained request
resume: a matcher rebuilt from the output tokens (a preempted request comes back with them)
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Mapping, Optional, Sequence

import torch

from engine.structured.constraint import StructuredOutputs
from engine.structured.grammar_compiler import GrammarCompiler
from engine.structured.token_bitmask import TokenBitmask

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class GrammarDecoder:
    """Builds matchers and fills the step's bitmask; requests without a constraint never reach it."""

    def __init__(self, compiler: GrammarCompiler, max_rows: int, device: torch.device):
        self.compiler = compiler
        self.max_rows = max_rows
        self.device = device
        self.on_fill: Optional[Callable[[float], None]] = None  # observes each step's fill time, seconds
        self._host: Optional[torch.Tensor] = None  # [max_rows, words] int32, pinned on CUDA

    def new_matcher(
        self,
        constraint: StructuredOutputs,
        output_token_ids: Sequence[int],
        compiled: Optional["xgrammar.CompiledGrammar"] = None,
    ) -> "xgrammar.GrammarMatcher":
        """A matcher at the state after `output_token_ids` (the request's outputs so far); `compiled` is the
        constraint's grammar as the request holds it (compiled here only without it: a worker's message)."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(compiled if compiled is not None else self.compiler.compile(constraint))
        for token_id in output_token_ids:
            if not matcher.accept_token(token_id):
                logger.warning("a resumed request's output token %d does not fit its grammar", token_id)
                break
        return matcher

    def fill_bitmask(
        self,
        matchers: Sequence[tuple[int, "xgrammar.GrammarMatcher"]],
        num_rows: int,
        drafts: Optional[Mapping[int, Sequence[int]]] = None,
    ) -> TokenBitmask:
        """The bitmask of a step whose sampled rows `row` have matchers (others unconstrained).

        `drafts[row]`: the draft tokens a request verifies in rows row + 1 .. row + k (speculative decoding).
        Row row + j gets the mask of the state after its first j drafts, checked by the matcher (then rolled
        back): the draft the grammar refuses, and all after it, are never accepted, since the masked sample of
        its row cannot equal it (the rows after it are left unconstrained: nothing of theirs is kept)."""
        started = time.perf_counter()
        host = self._buffer(num_rows)
        rows = []
        for row, matcher in matchers:
            matcher.fill_next_token_bitmask(host, row)
            rows.append(row)
            num_checked = 0
            for token_id in (drafts or {}).get(row, ()):
                if matcher.is_terminated() or not matcher.accept_token(token_id):
                    break
                num_checked += 1
                if matcher.is_terminated():  # the draft was a stop token: the request ends there, and a
                    break  # terminated matcher has no next mask (xgrammar raises)
                matcher.fill_next_token_bitmask(host, row + num_checked)
                rows.append(row + num_checked)
            if num_checked:
                matcher.rollback(num_checked)
        bitmask = host[:num_rows]
        if self.device.type != "cpu":
            bitmask = bitmask.to(self.device, non_blocking=True)  # from pinned memory: no wait
        if self.on_fill is not None:
            self.on_fill(time.perf_counter() - started)
        return TokenBitmask(bitmask, rows)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            import xgrammar as xgr

            host = xgr.allocate_token_bitmask(max(num_rows, self.max_rows), self.compiler.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host


def accept(matcher: "xgrammar.GrammarMatcher", token_id: int) -> bool:
    """Advance the matcher by the sampled token (a terminated matcher has nothing left to accept)."""
    if matcher.is_terminated():
        return True
    return matcher.accept_token(token_id)
