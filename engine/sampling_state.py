"""Per-request sampling state: parameters, token history and the request's own generator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from engine.sampling_params import SamplingParams

_SEED_MODULUS = 1 << 64


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs of one request, kept by the model runner for the request's lifetime.

    `output_token_ids` is the request's live list, to which the runner appends each
    sampled token. For the penalties the state keeps the prompt's distinct ids and
    the output ids as device tensors, extended by the new tokens at each step.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int]
    generator: Optional[torch.Generator]
    suppressed_ids: tuple[int, ...] = field(default=(), init=False)  # masked until min_tokens
    has_processors: bool = field(default=False, init=False)  # min_tokens, logit_bias or penalties
    _prompt_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    _output_ids: Optional[torch.Tensor] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.params
        if params.min_tokens > 0:
            eos = frozenset() if params.ignore_eos else self.eos_token_ids
            self.suppressed_ids = tuple(sorted(eos | set(params.stop_token_ids)))
        self.has_processors = bool(self.suppressed_ids or params.logit_bias or params.needs_penalties)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> "SamplingState":
        """A state with a generator on `device` seeded with `params.seed` (mod 2**64) when it is set."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed % _SEED_MODULUS)
        return cls(params, prompt_token_ids, output_token_ids, frozenset(eos_token_ids), generator)

    @property
    def suppresses_stops(self) -> bool:
        """min_tokens not reached yet: eos and stop ids are masked at this step."""
        return bool(self.suppressed_ids) and len(self.output_token_ids) < self.params.min_tokens

    def unique_prompt_ids(self, device: torch.device) -> torch.Tensor:
        """The distinct prompt ids, built once.  # [num_distinct_prompt_ids]"""
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = torch.tensor(list(self.prompt_token_ids), dtype=torch.long, device=device)
            self._prompt_ids = torch.unique(ids)
        return self._prompt_ids

    def output_ids_tensor(self, device: torch.device) -> torch.Tensor:
        """The output ids, extended by those appended since the last call.  # [num_output_tokens]"""
        cached, num_tokens = self._output_ids, len(self.output_token_ids)
        if cached is None or cached.device != device or cached.numel() > num_tokens:
            cached = torch.tensor(list(self.output_token_ids), dtype=torch.long, device=device)
        elif cached.numel() < num_tokens:
            new = torch.tensor(list(self.output_token_ids[cached.numel():]), dtype=torch.long, device=device)
            cached = torch.cat((cached, new))
        self._output_ids = cached
        return cached
