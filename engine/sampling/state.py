"""Per-request sampling state: parameters, token history and the request's own random stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.sampling.bad_words import masked_by_bad_words
from engine.sampling.device_io import to_device
from engine.sampling.params import SamplingParams

_SEED_MODULUS = 1 << 64
_MASK64 = _SEED_MODULUS - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's output function (a bijection on 64-bit ints with good avalanche)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs of one request, kept by the model runner for the request's lifetime.

    `output_token_ids` is the request's live list, to which the runner appends each
    sampled token. For the penalties the state keeps the prompt's distinct ids and
    the output ids as device tensors; the output ids live in a buffer that grows by
    doubling, so each step copies only its new tokens.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    seed: Optional[int]  # params.seed mod 2**64; None: draws come from torch's default generator
    suppressed_ids: tuple[int, ...] = field(default=(), init=False)  # masked until min_tokens
    has_processors: bool = field(default=False, init=False)  # min_tokens, logit_bias, bad words or penalties
    _prompt_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    _output_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)  # capacity >= filled
    _num_output_ids: int = field(default=0, init=False, repr=False)  # entries of _output_ids filled
    _disallowed: Optional[torch.Tensor] = field(default=None, init=False, repr=False)  # not allowed_token_ids
    # The request's own state when this one is what it will be after some draft tokens (`after`).
    origin: Optional["SamplingState"] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.params
        if params.min_tokens > 0:
            eos = frozenset() if params.ignore_eos else self.eos_token_ids
            self.suppressed_ids = tuple(sorted(eos | set(params.stop_token_ids)))
        self.has_processors = bool(
            self.suppressed_ids or params.logit_bias or params.needs_penalties or params.bad_words_token_ids
        )

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: list[int],
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> "SamplingState":
        """A state for a request with these tokens so far (`device`: where its tensors go)."""
        seed = None if params.seed is None else params.seed % _SEED_MODULUS
        return cls(params, prompt_token_ids, output_token_ids, frozenset(eos_token_ids), seed)

    def after(self, draft_token_ids: Sequence[int]) -> "SamplingState":
        """The state this request will be in once `draft_token_ids` are accepted (speculative decoding):
        penalties count them, min_tokens has seen them, and a seeded draw is that of the position after them.
        `origin` is this state; the copy is for one step's sampling."""
        state = SamplingState(
            self.params,
            self.prompt_token_ids,
            [*self.output_token_ids, *draft_token_ids],
            self.eos_token_ids,
            self.seed,
        )
        state._prompt_ids = self._prompt_ids
        state._disallowed = self._disallowed
        state.origin = self
        return state

    def seeded_uniform(self) -> float:
        """The U[0, 1) draw of a seeded request for its next output token.

        A pure function of (seed, number of outputs so far) (SplitMix64 over their
        combination), not a generator's running state: a request resumed after a
        preemption, or rebuilt from the step message by another worker, draws exactly
        what it would have drawn uninterrupted.
        """
        assert self.seed is not None
        # SplitMix64: the stream of seed mix64(seed), element len(outputs) + 1.
        state = (_mix64(self.seed) + (len(self.output_token_ids) + 1) * _GOLDEN_GAMMA) & _MASK64
        return (_mix64(state) >> 11) * (1.0 / (1 << 53))

    @property
    def suppresses_stops(self) -> bool:
        """min_tokens not reached yet: eos and stop ids are masked at this step."""
        return bool(self.suppressed_ids) and len(self.output_token_ids) < self.params.min_tokens

    @property
    def bad_word_ids(self) -> list[int]:
        """The tokens bad_words mask at this step (none without bad_words)."""
        sequences = self.params.bad_words_token_ids
        return masked_by_bad_words(sequences, self.output_token_ids) if sequences else []

    def disallowed(self, vocab: int, device: torch.device) -> torch.Tensor:
        """True for the tokens outside `allowed_token_ids` (set), built once.  # [vocab] bool"""
        if self._disallowed is None or self._disallowed.device != device or self._disallowed.numel() != vocab:
            # made on the device, the ids sent up from pinned memory: the GPU sampler never waits on a copy
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[to_device(self.params.allowed_token_ids or [], torch.long, device)] = False
            self._disallowed = mask
            if self.origin is not None:  # (a speculative step's copy: the request's own state keeps it)
                self.origin._disallowed = self._disallowed
        return self._disallowed

    def unique_prompt_ids(self, device: torch.device) -> torch.Tensor:
        """The distinct prompt ids, built once.  # [num_distinct_prompt_ids]"""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = torch.unique(torch.tensor(list(self.prompt_token_ids), dtype=torch.long))  # on the host
            self._prompt_ids = ids if device.type == "cpu" else ids.pin_memory().to(device, non_blocking=True)
        return self._prompt_ids

    def output_ids_tensor(self, device: torch.device) -> torch.Tensor:
        """The output ids, extended by those appended since the last call.  # [num_output_tokens]"""
        buffer, filled, num_tokens = self._output_ids, self._num_output_ids, len(self.output_token_ids)
        if buffer is None or buffer.device != device or filled > num_tokens:
            buffer, filled = torch.empty(max(16, 2 * num_tokens), dtype=torch.long, device=device), 0
        elif buffer.numel() < num_tokens:
            grown = torch.empty(2 * num_tokens, dtype=torch.long, device=device)
            grown[:filled] = buffer[:filled]
            buffer = grown
        if filled < num_tokens:
            buffer[filled:num_tokens] = to_device(list(self.output_token_ids[filled:]), torch.long, device)
        self._output_ids, self._num_output_ids = buffer, num_tokens
        return buffer[:num_tokens]
