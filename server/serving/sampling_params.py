"""SamplingParams from a request's fields: the one place a request's sampling settings are validated."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from engine.sampling.params import SamplingParams
from engine.structured import StructuredOutputs
from server.openai.protocol import SamplingFields

_DEFAULTED_WHEN_NULL = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
)


def make_sampling_params(
    request: SamplingFields,
    *,
    max_tokens: Optional[int],
    logprobs: Optional[int] = None,
    prompt_logprobs: Optional[int] = None,
    structured_outputs: Optional[StructuredOutputs] = None,
    defaults: Optional[Mapping[str, Any]] = None,
) -> SamplingParams:
    """SamplingParams from the request's fields; a bad value is a RequestRejectedError naming its field.
    `defaults`: the model's sampling defaults (its generation_config.json's, engine/loading/generation_defaults.py),
    taken for the fields the request leaves unset (null), as vLLM takes them."""
    values: dict[str, Any] = {  # SamplingParams checks each value: its field is named in a refusal
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": request.logit_bias,
        "allowed_token_ids": request.allowed_token_ids,
        "bad_words": request.bad_words,
        "seed": request.seed,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "structured_outputs": structured_outputs,
        "speculative": request.speculative,
        "num_speculative_tokens": request.num_speculative_tokens,
    }
    for key, value in (defaults or {}).items():
        if values.get(key) is None:
            values[key] = value
    # An unset (null) field takes SamplingParams' default; for the others None is the default.
    kwargs = {k: v for k, v in values.items() if v is not None or k not in _DEFAULTED_WHEN_NULL}
    return SamplingParams(**kwargs)
