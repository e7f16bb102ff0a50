"""Every request field this server refuses by name, in one place: data, not code.

A field OpenAI (or vLLM) defines but this server does not implement is a 400 with code
`unsupported_parameter` when it is set to anything but a value that means "not used"; it is never
silently ignored. Fields nobody defines are another matter (logged, or refused under --strict-params:
serving/checks.py)."""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from server.http.errors import bad_request

NOT_SUPPORTED = "it is not supported by this server"
STATELESS = "this server is stateless: nothing is stored, so send the whole conversation in input"


class Unsupported(NamedTuple):
    """A refused field: the values that mean "not used", and why anything else is refused."""

    allowed: tuple
    reason: str = NOT_SUPPORTED


# vLLM request extras this server does not implement: refused on every route whenever present.
VLLM_EXTRAS = frozenset(
    {
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "chat_template_kwargs",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "documents",
        "mm_processor_kwargs",
        "lora_request",
        "kv_transfer_params",
        "vllm_xargs",
    }
)

COMPLETIONS: Mapping[str, Unsupported] = {
    "suffix": Unsupported((None,), "insertion (fill-in-the-middle) is not implemented"),
}

CHAT: Mapping[str, Unsupported] = {
    "functions": Unsupported((None, []), "the deprecated functions API is not implemented; use tools"),
    "function_call": Unsupported((None, "none"), "the deprecated functions API is not implemented; use tool_choice"),
    "audio": Unsupported((None,)),
    "prediction": Unsupported((None,)),
    "reasoning_effort": Unsupported((None,)),
    "web_search_options": Unsupported((None,)),
    "metadata": Unsupported((None,)),
    "verbosity": Unsupported((None,)),
    "store": Unsupported((None, False), "nothing is stored by this stateless server"),
    "service_tier": Unsupported((None, "auto", "default")),
    "modalities": Unsupported((None, ["text"]), "only text is generated"),
}

RESPONSES: Mapping[str, Unsupported] = {
    "previous_response_id": Unsupported((None,), STATELESS),
    "conversation": Unsupported((None,), STATELESS),
    "background": Unsupported(
        (None, False), "background responses need a response store, which this stateless server has not"
    ),
    "background_options": Unsupported((None,)),
    # (an empty reasoning object, or one of nulls, asks for nothing: agent SDKs send them)
    "reasoning": Unsupported((None, {}, {"effort": None}, {"summary": None}, {"effort": None, "summary": None})),
    "include": Unsupported((None, [])),
    "max_tool_calls": Unsupported((None,)),
    "prompt": Unsupported((None,)),
    "prompt_cache_key": Unsupported((None,)),
    "prompt_cache_options": Unsupported((None,)),
    "prompt_cache_retention": Unsupported((None,)),
    "truncation": Unsupported((None, "disabled")),
    "top_logprobs": Unsupported((None, 0)),
    "context_management": Unsupported((None, [])),
    "moderation": Unsupported((None,)),
    "image": Unsupported((None,)),
    "access_programs": Unsupported((None,)),
    "service_tier": Unsupported((None, "auto", "default")),
    "stream_options": Unsupported((None, {}, {"include_obfuscation": False})),
    "n": Unsupported((1,), "a response has one output"),
    "response_format": Unsupported((None,), "the Responses API takes text.format"),  # (chat's and completions')
}


def refuse_unsupported(body: Any, fields: Mapping[str, Unsupported]) -> None:
    """A 400 for the first field of `fields` set to a value that means it is used, or for a vLLM extra
    this server does not implement."""
    for name, field in fields.items():
        if getattr(body, name, None) not in field.allowed:  # (None: not declared and not sent)
            raise bad_request(f"{name} is not supported: {field.reason}.", param=name, code="unsupported_parameter")
    extras = sorted(VLLM_EXTRAS & set(getattr(body, "model_extra", None) or {}))
    if extras:
        raise bad_request(
            f"{', '.join(extras)} is not supported by this server.", param=extras[0], code="unsupported_parameter"
        )
