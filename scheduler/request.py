"""A generation request as the scheduler sees it: token ids, progress and stop rules."""

from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Optional, Union

from scheduler.block_hash import BlockHash, MediaSpan


class RequestStatus(enum.IntEnum):
    """Ordered lifecycle: every state after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> Optional[str]:
        """The `finish_reason` name of a finished state ("stop", "length", "abort"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence to generate.

    `all_token_ids` is the prompt followed by the output so far; the scheduler
    brings `num_computed_tokens` (tokens whose K/V sit in the cache) up to
    `num_tokens` one step at a time. A step that computes the last token of the
    sequence samples the next one.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    skip_prefix_cache: bool = False  # e.g. prompt logprobs, which cached positions would not produce
    # A pooling request (embeddings): its prompt is computed and nothing sampled; it finishes (stopped) in the
    # step that computes its last prompt token, and its max_tokens is 0.
    prefill_only: bool = False
    # What the runner samples with (the engine's SamplingParams); opaque to the scheduler, which
    # hands it over in the step that first schedules the request (NewRequestData).
    sampling_params: object = None
    # The engine's compiled output grammar (an engine GrammarRef; opaque here), handed over alongside
    # sampling_params: held by the request, so no cache eviction can make the engine thread compile it again.
    grammar: object = None
    # The engine's resolved LoRA adapters (an engine LoRARef; opaque here), handed over like `grammar`.
    lora: object = None
    # The adapters' identities, counted against the scheduler's max_loras (distinct ones across running requests).
    lora_adapters: tuple[str, ...] = ()
    # A stable key of the adapter mix (names, scales, contents), mixed into the first block's hash: requests under
    # different adapters (or an adapter and the base) never share KV blocks. None: the base model.
    lora_key: Optional[bytes] = None
    # vLLM's cache_salt: mixed into the first block's hash too, so that only requests with the same salt share
    # cached blocks (tenants of one server cannot learn from cache hits what another one's prompts were).
    cache_salt: Optional[str] = None
    # A prompt with images: the engine's inputs for the runner (opaque here, handed over like `grammar`), and the
    # prompt spans their placeholder tokens cover with each image's content hash, digested into the hashes of the
    # blocks they overlap: the same placeholders for another image never hit this one's cached K/V.
    multi_modal: object = None
    media_spans: tuple[MediaSpan, ...] = ()
    # Whether each media span's tokens attend to each other both ways in the prompt (Gemma 3's images): then a
    # step computes a span whole or not at all, and a prefix-cache hit never ends inside one (bidirectional_spans.py).
    bidirectional_media: bool = False
    # Draft tokens this request may verify per step (speculative decoding): None, the engine's number; 0, none.
    num_speculative_tokens: Optional[int] = None
    # Recent share of its drafts accepted: a moving average, from an optimistic 1 (every draft accepted).
    draft_acceptance: float = 1.0

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache (or a KV tier) served at the first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Union[int, str, None] = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Length (prompt + output) at which the request stops at the latest: set by the scheduler.
    max_num_tokens: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        # Validated where the request was made (SamplingParams, the engine's resolution of max_tokens): here an
        # invariant, whose breach is a bug rather than a bad request.
        if self.prefill_only:
            if self.max_tokens or self.min_tokens:
                raise ValueError(f"a prefill-only request samples nothing: max_tokens {self.max_tokens}, not 0")
        elif self.max_tokens < 1 or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"a request needs 0 <= min_tokens ({self.min_tokens}) <= max_tokens ({self.max_tokens}) "
                f"and max_tokens >= 1"
            )
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.all_token_ids = self.prompt_token_ids + list(self.output_token_ids)

    @property
    def hash_seed(self) -> Optional[bytes]:
        """What the first block's hash starts from: the LoRA mix's key and the cache salt (None: neither)."""
        if self.cache_salt is None:
            return self.lora_key
        key = self.lora_key or b""  # (length-prefixed: a key and a salt with zero bytes cannot pass for others)
        return hashlib.sha256(b"salt\0" + len(key).to_bytes(8, "little") + key + self.cache_salt.encode()).digest()

    @property
    def bidirectional_spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of the spans a step must compute whole: the media spans of a request whose media attend
        both ways (a span of one token attends to itself alone: causal already)."""
        if not self.bidirectional_media:
            return ()
        return tuple((start, end) for start, end, _ in self.media_spans if end - start > 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
