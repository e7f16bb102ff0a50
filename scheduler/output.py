"""What the scheduler hands the model runner each step, and what it reports back.

The step message travels pickled to every worker process each step (engine/distributed/shm_broadcast.py),
so its pickled form is compact: a new request's token ids are one int32 array (its bytes on the wire,
where a tuple of ints would cost an int object per token on both ends). Unpickled, every field compares
equal to the original.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Optional, Union

from scheduler.draft_proposer import SpecDecodeStats
from scheduler.kv_tier_index import KVTierStats
from scheduler.request import RequestStatus


def token_array(token_ids: Iterable[int]) -> array[int]:
    """Token ids as a step message holds them: an `array("i")` (int32: every vocabulary's ids fit)."""
    return array("i", token_ids)


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Everything the runner needs of a request it holds no KV for: newly admitted, or resumed.

    `token_ids` is the whole sequence so far (the first `num_prompt_tokens` are the
    prompt, then any output kept across a preemption), an `array("i")` (any sequence of ints
    given is converted); `block_ids` is its whole block
    table, one per KV-cache layer group (scheduler/kv_cache_manager.py); `sampling_params` (the engine's,
    opaque here) and `eos_token_ids` are what it samples with, `grammar` (the engine's compiled grammar of a
    constrained request, opaque here) what it constrains with. A resumed request comes with all of it again:
    the runner keeps nothing of a preempted request, and any worker can rebuild it from this alone.
    """

    request_id: str
    token_ids: array[int]
    num_prompt_tokens: int
    block_ids: tuple[tuple[int, ...], ...]  # per KV-cache layer group
    num_computed_tokens: int
    sampling_params: object = None
    eos_token_ids: frozenset[int] = frozenset()
    grammar: object = None
    lora: object = None  # the engine's LoRARef of a request run with adapters (opaque here), like `grammar`
    multi_modal: object = None  # the engine's inputs of a prompt with images (opaque here), like `grammar`

    def __post_init__(self) -> None:
        token_ids: Any = self.token_ids
        if type(token_ids) is not array or token_ids.typecode != "i":
            object.__setattr__(self, "token_ids", token_array(token_ids))

    def __reduce__(self) -> tuple[Any, ...]:
        """The token ids as little-endian int32 bytes, the other fields as they are."""
        token_ids = self.token_ids
        if _BIG_ENDIAN:
            token_ids = array("i", token_ids)
            token_ids.byteswap()
        return _new_request_data, (
            self.request_id,
            token_ids.tobytes(),
            self.num_prompt_tokens,
            self.block_ids,
            self.num_computed_tokens,
            self.sampling_params,
            self.eos_token_ids,
            self.grammar,
            self.lora,
            self.multi_modal,
        )

    @property
    def prompt_token_ids(self) -> array[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> array[int]:
        return self.token_ids[self.num_prompt_tokens :]


_BIG_ENDIAN = sys.byteorder == "big"


def _new_request_data(request_id: str, token_bytes: bytes, *fields: Any) -> NewRequestData:
    """`NewRequestData.__reduce__`'s inverse."""
    token_ids = array("i")
    token_ids.frombytes(token_bytes)
    if _BIG_ENDIAN:
        token_ids.byteswap()
    return NewRequestData(request_id, token_ids, *fields)


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

    The KV tiers below the pool (scheduler/kv_tiers.py). Disk: `kv_tier_restores` (block hash, block id) are
    read into the cache before the forward (their tokens count as computed); `kv_tier_saves` (block id, block
    hash) are blocks the step's forward fills, copied out after it and written in the background. Host memory:
    `kv_memory_restores` (slot, block id) are copied in before the forward, `kv_memory_saves` (block id, slot)
    out after it. Each rank reads and writes its own file or row of a block (its shard, its stage's layers):
    the message is all any worker needs.

    A hybrid model's recurrent states (scheduler/state_snapshots.py): `state_restores` (request id, slot) copy a
    snapshot into the request's state row before the forward (its prefix-cache hit); `state_saves` (request id,
    position, slot) copy the request's states after its first `position` tokens into a slot, as the step's
    recurrent layers reach that position.
    """

    num_scheduled_tokens: dict[str, int]
    num_computed_tokens: dict[str, int]
    step_id: int = 0  # the scheduler's count of scheduled steps: update_from_output takes the latest only
    new_requests: tuple[NewRequestData, ...] = ()
    new_block_ids: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)  # per layer group
    preempted_request_ids: frozenset[str] = frozenset()
    finished_request_ids: frozenset[str] = frozenset()
    scheduled_spec_decode_tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kv_tier_saves: tuple[tuple[int, bytes], ...] = ()
    kv_tier_restores: tuple[tuple[bytes, int], ...] = ()
    kv_memory_saves: tuple[tuple[int, int], ...] = ()
    kv_memory_restores: tuple[tuple[int, int], ...] = ()
    state_restores: tuple[tuple[str, int], ...] = ()
    state_saves: tuple[tuple[str, int, int], ...] = ()

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
    kv_tiers: tuple[KVTierStats, ...] = ()  # one per KV tier below the pool (memory, disk), none without

    def kv_tier(self, name: str) -> Optional[KVTierStats]:
        """The counters of the tier `name` ("memory" or "disk"); None when the engine has no such tier."""
        return next((tier for tier in self.kv_tiers if tier.tier == name), None)
