"""What the runner returns to the engine, and what the engine publishes per request."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from engine.sampling.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """One step's sampled tokens, keyed by request id (only requests that sampled): one token, or with draft
    tokens the accepted drafts and one more; their logprobs, one per token."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # requests that asked
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # this step's prompt chunk
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # pooling requests done: [dimensions] float32
    # An EAGLE proposer's input (engine/spec_decode/eagle.py): each request's features of the positions this step
    # computed, (its first position, [rows, width]), drafts rejected in this step included
    draft_features: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Monotonic timestamps (time.monotonic seconds) for latency metrics."""

    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    last_token_time: Optional[float]
    finished_time: Optional[float]
    previous_token_time: Optional[float] = None  # the step before last_token_time's, when there was one

    @property
    def queue_time(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latency(self) -> Optional[float]:
        """Between the last two steps that produced tokens."""
        if self.previous_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.previous_token_time

    @property
    def e2e_latency(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """A request's progress in one engine step.

    `text` is everything settled so far; `text_delta` what this step added (text
    that may still turn into a stop string is held back until resolved).
    `prompt_logprobs` is set once, on the first output of a request that asked
    for it: one entry per prompt token, None for the first.
    """

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    text: str
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: Optional[list[TokenLogprobs]] = None  # one per new token, when asked
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    error: Optional[str] = None  # finish_reason "error": what failed this request alone (see fault_isolation)
    abort_reason: Optional[str] = None  # finish_reason "abort": why ("aborted": the caller; "timeout": its deadline)
    embedding: Optional[list[float]] = None  # a pooling request's, on its one (finished) output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "RequestOutput") -> "RequestOutput":
        """This output and the `later` one of the same request as one (a stream that sends every few tokens):
        their new tokens, text and logprobs joined, the rest as the later one says."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = later.logprobs if logprobs is None else logprobs + later.logprobs
        return dataclasses.replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text_delta=self.text_delta + later.text_delta,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
        )


@dataclass(slots=True)
class OutputAccumulator:
    """One sequence's RequestOutputs gathered into its final result (offline API, non-streaming HTTP)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[TokenLogprobs]] = None  # None unless the request asked for them
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None  # finish_reason "error": what failed it
    embedding: Optional[list[float]] = None  # a pooling request's

    def add(self, output: RequestOutput) -> None:
        self.text = output.text
        self.token_ids.extend(output.new_token_ids)
        if output.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.finish_reason = output.finish_reason
        self.stop_reason = output.stop_reason
        self.num_cached_tokens = output.num_cached_tokens
        self.error = output.error
        if output.embedding is not None:
            self.embedding = output.embedding


@dataclass(frozen=True, slots=True)
class Logprob:
    """vLLM's: a token's raw logprob, its rank (1 + tokens strictly more likely) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class PositionLogprobs(dict[int, Logprob]):
    """One position's logprobs as vLLM's offline API gives them: token id -> Logprob, the chosen token first, then
    the top alternatives best first (code written for vLLM reads `logprobs[i][token_id].logprob`). Also this
    engine's view of the same entry: `token_id`, `logprob`, `rank` and `top` [(token id, logprob)]."""

    __slots__ = ("token_id", "logprob", "rank", "top")

    def __init__(self, entry: TokenLogprobs, decode: Callable[[int], str]):
        super().__init__()
        self.token_id, self.logprob, self.rank, self.top = entry.token_id, entry.logprob, entry.rank, entry.top
        self[entry.token_id] = Logprob(entry.logprob, entry.rank, decode(entry.token_id))
        for rank, (token_id, logprob) in enumerate(entry.top, 1):
            if token_id not in self:
                self[token_id] = Logprob(logprob, rank, decode(token_id))


def prompt_logprobs(
    entries: Optional[list[Optional[TokenLogprobs]]], decode: Callable[[int], str]
) -> Optional[list[Optional[PositionLogprobs]]]:
    """A prompt's `entries` (None: not asked for; the first position's None) in vLLM's offline shape."""
    if entries is None:
        return None
    return [None if entry is None else PositionLogprobs(entry, decode) for entry in entries]


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """One generated sequence of a finished request (the offline API)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    logprobs: Optional[list[PositionLogprobs]]  # vLLM's shape: per token, token id -> Logprob
    error: Optional[str] = None  # finish_reason "error": what failed this sequence alone
    cumulative_logprob: Optional[float] = None  # the sum of its tokens' raw logprobs, when logprobs were asked


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A finished prompt with its `n` completions, as `LLM.generate` returns it."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]]  # the first None, as vLLM's
    outputs: list[CompletionOutput]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    """vLLM's: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    """A pooled prompt, as `LLM.embed` returns it (vLLM's shape: `outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ClassificationOutput:
    """vLLM's: one prompt's class probabilities (the raw logits with use_activation false), one per label."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True, slots=True)
class ClassificationRequestOutput:
    """A classified prompt, as `LLM.classify` returns it (vLLM's shape: `outputs.probs`)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass(frozen=True, slots=True)
class ScoringOutput:
    """vLLM's: one pair's score."""

    score: float


@dataclass(frozen=True, slots=True)
class ScoringRequestOutput:
    """A scored pair, as `LLM.score` returns it (vLLM's shape: `outputs.score`)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's together (a classifier's), or the second text's (an embedding model's)
    finished: bool = True
