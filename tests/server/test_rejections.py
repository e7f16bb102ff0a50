"""The server words each typed refusal of the engine and the scheduler: message, `param`, `code`.

The errors carry facts; these tests build them by hand (no model), and check the wording per endpoint.
"""

from __future__ import annotations

import pytest

from engine.errors import InvalidParameterError, TokenIdOutOfVocabularyError
from engine.sampling.params import SamplingParams
from scheduler import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EmptyPromptError,
    InvalidMaxTokensError,
    KVCacheTooSmallError,
    MinTokensOutOfRangeError,
    RequestRejectedError,
)
from server.http.errors import rejection_error
from server.serving.rejections import CHAT_FIELD_NAMES

CHAT_WITH_MAX_COMPLETION_TOKENS = {**CHAT_FIELD_NAMES, "max_tokens": "max_completion_tokens"}


def test_context_length_names_both_numbers_and_the_field_at_fault():
    error = rejection_error(ContextLengthExceededError(250, 10, 256))
    assert (error.status, error.param, error.code) == (400, "max_tokens", "context_length_exceeded")
    assert error.message == (
        "This model's maximum context length is 256 tokens, but 260 were requested "
        "(250 in the prompt, 10 for the completion). Shorten the prompt or lower max_tokens."
    )
    assert rejection_error(ContextLengthExceededError(300, 1, 256)).param == "prompt"


def test_chat_spells_its_fields_in_param_and_message():
    error = rejection_error(ContextLengthExceededError(250, 10, 256), CHAT_WITH_MAX_COMPLETION_TOKENS)
    assert error.param == "max_completion_tokens" and error.message.endswith("lower max_completion_tokens.")
    assert "max_tokens" not in error.message.replace("max_completion_tokens", "")
    assert rejection_error(ContextLengthExceededError(300, 1, 256), CHAT_FIELD_NAMES).param == "messages"
    assert rejection_error(EmptyPromptError(), CHAT_FIELD_NAMES).param == "messages"
    with pytest.raises(RequestRejectedError) as info:
        SamplingParams(logprobs=21)
    error = rejection_error(info.value, CHAT_FIELD_NAMES)
    assert error.param == "top_logprobs" and error.message.startswith("top_logprobs must be between 0 and 20")
    error = rejection_error(MinTokensOutOfRangeError(5, 2), CHAT_WITH_MAX_COMPLETION_TOKENS)
    assert error.param == "min_tokens" and "max_completion_tokens (2)" in error.message


def test_kv_cache_too_small_names_the_pool():
    error = rejection_error(KVCacheTooSmallError(100, 100, 50, 40, 4))
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    assert all(
        part in error.message for part in ("100 prompt tokens", "50 KV blocks of 4 tokens", "40 blocks", "160 tokens")
    )


@pytest.mark.parametrize(
    "exc, param, words",
    [
        (EmptyPromptError(), "prompt", "prompt is empty"),
        (InvalidMaxTokensError(0), "max_tokens", "max_tokens must be at least 1, got 0"),
        (MinTokensOutOfRangeError(-1, None), "min_tokens", "min_tokens must be non-negative, got -1"),
        (DuplicateRequestIdError("abc"), "request_id", "'abc' is already in use"),
        (InvalidParameterError("top_p", "must be in (0, 1], got 1.5"), "top_p", "top_p must be in (0, 1], got 1.5"),
        (TokenIdOutOfVocabularyError("prompt", 600, 512), "prompt", "token id 600 is outside the vocabulary (0..511)"),
        (TokenIdOutOfVocabularyError("tokens", 600, 512), "tokens", "tokens: token id 600"),
        (RequestRejectedError("something else", field="seed"), "seed", "something else"),
        (RequestRejectedError("no field at fault"), None, "no field at fault"),
    ],
)
def test_each_refusal_is_a_400_naming_its_field(exc, param, words):
    error = rejection_error(exc)
    assert (error.status, error.param, error.code) == (400, param, None)
    assert words in error.message
    assert error.body()["error"]["type"] == "invalid_request_error"
