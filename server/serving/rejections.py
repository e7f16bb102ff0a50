"""What OpenAI's 400 says for each refusal the engine and the scheduler raise: wording, `param` and `code`.

The engine's errors carry facts and name request fields in the engine's terms
(`SamplingParams` names, "prompt"); an endpoint passes `names` to spell them its
own way, e.g. chat's "max_completion_tokens" for "max_tokens".
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional

from engine.errors import InvalidParameterError, TokenIdOutOfVocabularyError
from scheduler import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EmptyPromptError,
    InvalidMaxTokensError,
    KVCacheTooSmallError,
    MinTokensOutOfRangeError,
    RequestRejectedError,
)

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

CHAT_FIELD_NAMES: Mapping[str, str] = {"logprobs": "top_logprobs", "prompt": "messages"}
"""How /v1/chat/completions spells the engine's fields (plus max_tokens when sent as max_completion_tokens)."""


class Refusal(NamedTuple):
    """The fields of OpenAI's error envelope for a 400."""

    message: str
    param: Optional[str]
    code: Optional[str] = None


def describe_rejection(exc: RequestRejectedError, names: Mapping[str, str]) -> Refusal:
    """What a client is told of `exc`, naming request fields as `names` spells them (others as they are)."""

    def name(field: Optional[str]) -> str:
        return names.get(field, field) if field is not None else "the request"

    def param(field: Optional[str]) -> Optional[str]:
        return None if field is None else name(field)

    if isinstance(exc, ContextLengthExceededError) and not exc.max_tokens:  # (a pooling request generates none)
        return Refusal(
            f"This model's maximum context length is {exc.max_model_len} tokens, but the input has "
            f"{exc.num_prompt_tokens}. Shorten it, or set truncate_prompt_tokens.",
            name(exc.field),
            CONTEXT_LENGTH_EXCEEDED,
        )
    if isinstance(exc, ContextLengthExceededError):
        return Refusal(
            f"This model's maximum context length is {exc.max_model_len} tokens, but {exc.num_tokens} were "
            f"requested ({exc.num_prompt_tokens} in the prompt, {exc.max_tokens} for the completion). "
            f"Shorten the prompt or lower {name('max_tokens')}.",
            name(exc.field),
            CONTEXT_LENGTH_EXCEEDED,
        )
    if isinstance(exc, KVCacheTooSmallError) and exc.prompt_alone:
        return Refusal(
            f"The prompt's {exc.num_prompt_tokens} tokens do not fit in the KV cache, which holds "
            f"{exc.num_blocks} blocks of {exc.block_size} tokens ({exc.num_blocks * exc.block_size} tokens) "
            f"in all. Shorten the prompt.",
            name(exc.field),
            CONTEXT_LENGTH_EXCEEDED,
        )
    if isinstance(exc, KVCacheTooSmallError):
        return Refusal(
            f"{exc.num_prompt_tokens} prompt tokens plus {name('max_tokens')} {exc.max_tokens} need "
            f"{exc.num_blocks_needed} KV blocks of {exc.block_size} tokens, but the whole cache holds "
            f"{exc.num_blocks} blocks ({exc.num_blocks * exc.block_size} tokens). "
            f"Shorten the prompt or lower {name('max_tokens')}.",
            name(exc.field),
            CONTEXT_LENGTH_EXCEEDED,
        )
    if isinstance(exc, EmptyPromptError):
        return Refusal("The prompt is empty.", name(exc.field))
    if isinstance(exc, InvalidMaxTokensError):
        return Refusal(f"{name('max_tokens')} must be at least 1, got {exc.max_tokens}.", name(exc.field))
    if isinstance(exc, MinTokensOutOfRangeError):
        bounds = "non-negative" if exc.max_tokens is None else f"between 0 and {name('max_tokens')} ({exc.max_tokens})"
        return Refusal(f"{name('min_tokens')} must be {bounds}, got {exc.min_tokens}.", name(exc.field))
    if isinstance(exc, DuplicateRequestIdError):
        return Refusal(f"request id {exc.request_id!r} is already in use.", name(exc.field))
    if isinstance(exc, InvalidParameterError):
        return Refusal(f"{name(exc.field)} {exc.problem}.", name(exc.field))
    if isinstance(exc, TokenIdOutOfVocabularyError):
        return Refusal(
            f"{name(exc.field)}: token id {exc.token_id} is outside the vocabulary (0..{exc.vocab_size - 1}).",
            name(exc.field),
        )
    return Refusal(exc.message, param(exc.field))
