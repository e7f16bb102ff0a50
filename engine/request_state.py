"""The engine's per-request bookkeeping: text, stop strings, logprobs, timestamps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from engine.text.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestMetrics
from engine.sampling.sampler import TokenLogprobs
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams
from engine.text.stop_strings import StopStringMatcher
from scheduler import Request


@dataclass(slots=True)
class RequestState:
    request: Request
    params: Union[SamplingParams, PoolingParams]
    detokenizer: Optional[IncrementalDetokenizer]  # None for a pooling request: it has no text
    stop_matcher: Optional[StopStringMatcher]
    text: str = ""
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    prompt_logprobs_sent: bool = False
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    previous_token_time: Optional[float] = None

    @property
    def sampling(self) -> SamplingParams:
        """The parameters of a request that generates (every request whose tokens are processed)."""
        assert isinstance(self.params, SamplingParams), "a pooling request has no tokens to process"
        return self.params

    @property
    def text_decoder(self) -> IncrementalDetokenizer:
        assert self.detokenizer is not None, "a pooling request has no text"
        return self.detokenizer

    def metrics(self, finished_time: Optional[float]) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=self.request.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=finished_time,
            previous_token_time=self.previous_token_time,
        )

    def take_text(self, delta: str, finishing: bool, check_stops: bool = True) -> tuple[str, Optional[str]]:
        """Run a detokenized delta through the stop strings; returns (text to emit, stop string hit).

        Before `min_tokens` output tokens (`check_stops` False) stop strings are not looked for."""
        if finishing:
            delta += self.text_decoder.flush()
        stop = None
        if self.stop_matcher is not None and check_stops:
            match = self.stop_matcher.add_text(delta)
            delta, stop = match.text, match.stop
            if stop is None and finishing:
                delta += self.stop_matcher.flush()
        self.text += delta
        return delta, stop
