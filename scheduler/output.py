"""What the scheduler hands the model runner each step, and what it reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

from scheduler.draft_proposer import SpecDecodeStats
from scheduler.request import RequestStatus


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Everything the runner needs of a request it holds no KV for: newly admitted, or resumed.

    `token_ids` is the whole sequence so far (the first `num_prompt_tokens` are the
    prompt, then any output kept across a preemption); `block_ids` is its whole block
    table, one per KV-cache layer group (scheduler/kv_cache_manager.py); `sampling_params` (the engine's,
    opaque here) and `eos_token_ids` are what it samples with, `grammar` (the engine's compiled grammar of a
    constrained request, opaque here) what it constrains with. A resumed request comes with all of it again:
    the runner keeps nothing of a preempted request, and any worker can rebuild it from this alone.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache layer group
    num_computed_tokens: int
    sampling_params: object = None
    eos_token_ids: frozenset[int] = frozenset()
    grammar: object = None
    lora: object = None  # the engine's LoRARef of a request run with adapters (opaque here), like `grammar`

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step of work, keyed by request id.

    The message is complete: a runner (in this process, or a worker that receives
    it pickled) needs nothing else. It learns of a request when it is first
    scheduled (`new_requests`, again when it resumes), and forgets it when it is
    preempted (`preempted_request_ids`) or has ended (`finished_request_ids`:
    finished, aborted, or stopped, since the last step).

    For every scheduled request the runner computes tokens
    `[num_computed_tokens[id], num_computed_tokens[id] + num_scheduled_tokens[id])`
    of its sequence, writing their K/V to the request's blocks, and samples a
    token when that range reaches the end of the sequence.

    A decoding request may also verify draft tokens (speculative decoding): then
    `scheduled_spec_decode_tokens[id]` holds its k drafts, and `num_scheduled_tokens[id]`
    is 1 + k, the sequence's last token followed by the drafts:

        sequence  t0 ... t(n-1) | d1 ... dk          (n = num_computed_tokens + 1)
        computed  ----------------------------       positions n-1 .. n-1+k, one query row each

    The runner samples at all k + 1 positions and returns the accepted drafts and one
    token more (the target's own at the first rejection, else a bonus token): 1 to k + 1
    tokens. The scheduler rolls `num_computed_tokens` back past the rejected drafts,
    whose slots the next step overwrites; no block holding a draft is ever indexed.

    Prefix-cache hits only name blocks written by earlier, completed steps, so
    within a step no request reads K/V that another request of the step writes.
    """

    num_scheduled_tokens: dict[str, int]
    num_computed_tokens: dict[str, int]
    step_id: int = 0  # the scheduler's count of scheduled steps: update_from_output takes the latest only
    new_requests: tuple[NewRequestData, ...] = ()
    new_block_ids: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)  # per layer group
    preempted_request_ids: frozenset[str] = frozenset()
    finished_request_ids: frozenset[str] = frozenset()
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class RequestStepOutput(NamedTuple):
    """A request's progress in one step: new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    stop_reason: Union[int, str, None] = None

    @property
    def finish_reason(self) -> Optional[str]:
        return self.status.finish_reason


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    speculation: Optional[SpecDecodeStats] = None  # None without speculative decoding
