"""Beam search as vLLM runs it (`LLM.beam_search`, the OpenAI routes' `use_beam_search`): a search over engine
requests, not a mode of the engine. Each step sends one request per live beam (its prompt and output so far,
`max_tokens` 1) for the `2 * beam_width` best next tokens by their raw logprobs; prefix caching makes the beams'
shared prefix a cache hit, so a step computes one token per beam. Every (beam, next token) pair is scored, an
end-of-sequence token completes its beam, and the `beam_width` best of the rest go on. After `max_tokens` steps
(or once no beam is left) the `beam_width` best of the completed and live beams are the result, best first.

Score (vLLM's `get_beam_search_score`): cumulative logprob / length ** length_penalty, the length counting the
prompt's tokens and not a final end-of-sequence token.

The next tokens are the top of the raw log-softmax (logprobs never see temperature, as vLLM reports them), so the
search is deterministic; `temperature` is passed to the step requests as vLLM passes it, where it only changes
which token each step request samples, a token the search does not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from engine.errors import InvalidParameterError
from engine.sampling.params import MAX_LOGPROBS, SamplingParams

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
"""Each step asks for 2 x beam_width alternatives, at most MAX_LOGPROBS."""


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, low in (("beam_width", 1), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(name, f"must be an integer of at least {low}, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise InvalidParameterError("beam_width", f"must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidParameterError(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise InvalidParameterError("temperature", f"must be non-negative, got {self.temperature}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's and the output's; `text` the output's text once the search ends."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each output token's raw logprob
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (an end-of-sequence token) or "length"
    stop_reason: Optional[int] = None  # the end-of-sequence token


@dataclass(slots=True)
class BeamSearchOutput:
    """A prompt's best beams, best first (vLLM's shape)."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_ids: frozenset[int], length_penalty: float) -> float:
    length = len(beam.tokens)
    if beam.tokens and beam.tokens[-1] in eos_token_ids:
        length -= 1
    return beam.cum_logprob / (length**length_penalty)


class BeamSearch:
    """One prompt's search: `pending` the beams whose next tokens the step needs, `advance` with them."""

    def __init__(
        self, prompt_token_ids: Sequence[int], params: BeamSearchParams, eos_token_ids: frozenset[int], max_tokens: int
    ):
        """`max_tokens`: the steps the context leaves (at most params.max_tokens)."""
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps_left = max(min(params.max_tokens, max_tokens), 0)
        # what every step request of the search samples with (one object: the engine does not change it)
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature)

    @property
    def done(self) -> bool:
        return self.steps_left == 0 or not self.beams

    def pending(self) -> list[list[int]]:
        """Each live beam's tokens (prompt and output): the step's prompts (none once done)."""
        return [] if self.done else [beam.tokens for beam in self.beams]

    def advance(self, tops: Sequence[Sequence[tuple[int, float]]]) -> None:
        """`tops[i]`: live beam i's best next tokens, (token, raw logprob) best first."""
        params, grown = self.params, []
        for beam, top in zip(self.beams, tops):
            for token, logprob in top[: 2 * params.beam_width]:
                cum = beam.cum_logprob + logprob
                if token in self.eos_token_ids and not params.ignore_eos:
                    tokens = beam.tokens + [token] if params.include_stop_str_in_output else beam.tokens
                    self.completed.append(
                        BeamSearchSequence(tokens, cum, beam.logprobs + [logprob], None, "stop", token)
                    )
                else:
                    grown.append(BeamSearchSequence(beam.tokens + [token], cum, beam.logprobs + [logprob]))
        grown.sort(key=self._score, reverse=True)
        self.beams = grown[: params.beam_width]
        self.steps_left -= 1

    def result(self, decode: Callable[[list[int], bool], str]) -> list[BeamSearchSequence]:
        """The best `beam_width` beams, best first, their text decoded (`decode(ids, skip_special_tokens)`)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted([*self.completed, *self.beams], key=self._score, reverse=True)[: self.params.beam_width]
        for beam in best:
            beam.text = decode(beam.tokens[self.num_prompt_tokens :], not self.params.include_stop_str_in_output)
        return best

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam, self.eos_token_ids, self.params.length_penalty)
