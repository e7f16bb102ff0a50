"""What the scheduler asks for draft tokens (speculative decoding), and what it counts of their fate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Protocol, Sequence, runtime_checkable


class DraftProposer(Protocol):
    """Guesses the next tokens of a sequence, for the target model to verify in one forward pass.

    The scheduler calls `propose` for each running request that decodes in the coming step and puts
    the result in the step message (`SchedulerOutput.scheduled_spec_decode_tokens`), so a runner, in
    this process or a worker rebuilt from the message, needs nothing else to verify them. A proposer
    that needs no torch (n-gram lookup) keeps the scheduler pure Python; the engine builds it.
    """

    num_speculative_tokens: int  # the most draft tokens a request gets per step

    def propose(self, token_ids: Sequence[int], max_num_tokens: int) -> Sequence[int]:
        """At most `max_num_tokens` guesses of what follows `token_ids` (prompt + accepted output); may be
        empty."""
        ...

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None:
        """A request ended with this output (a proposer that learns from recent outputs keeps it)."""
        ...


class DraftQuery(NamedTuple):
    """One request's entry in a batched proposal: its tokens (prompt + accepted output) and how many
    drafts it may get at most."""

    request_id: str
    token_ids: Sequence[int]
    max_num_tokens: int
    # the content hashes of its full blocks, so far (with prefix caching; a proposer may share its own cache's
    # blocks between requests by them)
    block_hashes: Sequence[object] = ()


@runtime_checkable
class BatchDraftProposer(Protocol):
    """A proposer that drafts for all of a step's decoding requests at once and keeps state per request (a
    draft model: one forward per draft position for the whole batch, over its own KV cache).

    The scheduler asks it instead of `DraftProposer.propose` when it has `propose_batch`; its drafts travel
    in the step message as any proposer's do. `release` says that a request's state may go: the request
    ended (finished, aborted) or was preempted (it is recomputed from its tokens when it resumes).
    """

    num_speculative_tokens: int

    def propose_batch(self, queries: Sequence[DraftQuery]) -> list[Sequence[int]]:
        """Drafts for each query, in order: at most its `max_num_tokens` (may be empty)."""
        ...

    def release(self, request_id: str) -> None:
        """Forget the request's state (nothing happens for a request it holds none of)."""
        ...

    def on_request_finished(self, output_token_ids: Sequence[int]) -> None: ...


@runtime_checkable
class FeatureDraftProposer(BatchDraftProposer, Protocol):
    """A batched proposer that reads what the target computed (EAGLE: its hidden states beside each token).

    The runner puts them in its step output; `Scheduler.update_from_output` hands the running requests' to
    `observe` before the step's tokens are appended, so they reach the proposer by the step's own path (a worker
    rebuilt from the step message needs none of them). They are opaque here (torch tensors: the proposer's).
    """

    def observe(self, features: Mapping[str, object], requests: Sequence[DraftQuery]) -> None:
        """The running requests' features of the positions the step computed (`features`, by request id), with
        each one's tokens before the step's (`requests`: their max_num_tokens 0; a request that opted out of
        speculation is left out)."""
        ...


@dataclass(slots=True)
class SpecDecodeStats:
    """Cumulative counts of speculation, vLLM's names: steps with a draft, draft tokens proposed and
    accepted, and accepted tokens by their position in the draft (0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1

    def snapshot(self) -> "SpecDecodeStats":
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos)
        )

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted step produced on average (accepted ones plus the one the target always gives)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
