"""A request's choices (one engine request each: prompt x n) and the token usage they add up to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from engine.multimodal.inputs import MultiModalInputs
from engine.sampling.parallel import fan_out
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams
from server.openai.protocol import PromptTokensDetails, Usage


@dataclass(slots=True)
class Choice:
    """One engine request behind a response choice."""

    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: Union[SamplingParams, PoolingParams]  # PoolingParams: an embedding's (one per input)
    multi_modal: Optional[MultiModalInputs] = None  # its prompt's images (a vision-language model's)

    @property
    def sampling(self) -> SamplingParams:
        """A generation choice's parameters."""
        assert isinstance(self.params, SamplingParams), "an embedding's choice samples nothing"
        return self.params


def plan_choices(
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    multi_modal: Optional[Sequence[Optional[MultiModalInputs]]] = None,
) -> list[Choice]:
    """Choice `prompt_index * n + i` is child i of prompt `prompt_index` (OpenAI's numbering); each carries its
    prompt's images (`multi_modal`, one entry per prompt)."""
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        base = request_id if len(prompts) == 1 else f"{request_id}-p{prompt_index}"
        images = None if multi_modal is None else multi_modal[prompt_index]
        for i, (child_id, child_params) in enumerate(fan_out(base, params)):
            choices.append(Choice(prompt_index * params.n + i, child_id, prompt_index, prompt, child_params, images))
    return choices


@dataclass(slots=True)
class UsageCounter:
    """A response's token usage, streamed or not: every prompt once, every choice's completion tokens,
    the cached prompt tokens of each prompt's first choice."""

    prompt_tokens: int
    n: int
    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> cached tokens
    per_choice: dict[int, int] = field(default_factory=dict)  # choice index -> its completion tokens so far

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], n: int) -> "UsageCounter":
        return cls(sum(len(p) for p in prompts), n)

    def add(self, choice: Choice, num_tokens: int, num_cached_tokens: int) -> None:
        self.completion_tokens += num_tokens
        self.per_choice[choice.index] = self.per_choice.get(choice.index, 0) + num_tokens
        if choice.index % self.n == 0:
            self.cached_tokens[choice.prompt_index] = num_cached_tokens

    def choice_usage(self, choice: Choice) -> Usage:
        """One choice's usage so far (a chunk's, under continuous_usage_stats): its prompt, its tokens."""
        prompt_tokens = len(choice.prompt_token_ids)
        completion_tokens = self.per_choice.get(choice.index, 0)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )
