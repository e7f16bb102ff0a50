"""The checks every generation request passes before any work: the server can take it, the model is
served, its fields are known and consistent, its prompt could fit and the queue has room."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional, Sequence

from pydantic import BaseModel

from server.http.errors import APIError, bad_request, model_not_found
from server.openai.protocol import LoRAPart, SamplingFields
from server.serving.constraints import STRUCTURED_EXTRAS
from server.serving.rejections import CONTEXT_LENGTH_EXCEEDED
from server.serving.unsupported import VLLM_EXTRAS

if TYPE_CHECKING:
    from engine.lora.request import LoRAMix
    from server.state import ServerState

logger = logging.getLogger(__name__)

PROMPT_CHARS_MARGIN = 4  # normalizers may fold characters: refuse only far beyond what could fit


def check_server_and_model(
    state: "ServerState", requested: Optional[str], lora: Optional[Sequence[LoRAPart]] = None
) -> tuple[str, Optional["LoRAMix"]]:
    """503 while draining or with the engine down; the model id the response reports and the LoRA adapters
    the request runs with (None: the base model alone). 404 for an unknown model or adapter."""
    if state.draining or not state.engine.is_alive:
        raise APIError(
            503,
            "the server is shutting down"
            if state.draining
            else f"the engine is not running: {state.engine.error or 'stopped'}",
        )
    if state.adapters is not None:
        return state.adapters.resolve(requested, lora)
    if lora is not None:
        raise bad_request("lora needs a server started with --enable-lora.", param="lora")
    return check_model(requested, state.served_model_names), None


def check_model(requested: Optional[str], served: Sequence[str]) -> str:
    """The served model name for the request (the first when it names none); 404 for an unknown one."""
    if requested is None or requested in served:
        return served[0] if requested is None else requested
    raise model_not_found(requested, served)


def check_fields(request: SamplingFields, state: "ServerState") -> None:
    """Unknown fields, stream_options without stream (or asking for padding), too many logprobs, a priority without
    the policy."""
    check_extra_fields(request, state.config.strict_params)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    if getattr(request.stream_options, "include_obfuscation", None):  # (the Responses API's options are a dict)
        raise bad_request(
            "stream_options.include_obfuscation is not supported: this server does not pad its chunks.",
            param="stream_options.include_obfuscation",
            code="unsupported_parameter",
        )
    check_max_logprobs(request, state.config.max_logprobs)
    if getattr(request, "prompt_logprobs", None) is not None and request.stream:
        raise bad_request("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")
    check_priority(state, request.priority)


def check_priority(state: "ServerState", priority: int) -> None:
    """A priority needs the priority policy."""
    if priority != 0 and state.engine.scheduling_policy != "priority":
        raise bad_request("priority needs a server started with --scheduling-policy priority.", param="priority")


def check_extra_fields(
    request: BaseModel, strict: bool, known: frozenset[str] = STRUCTURED_EXTRAS | VLLM_EXTRAS
) -> None:
    """Fields nobody defines (none of `known`, the generation routes' extras read or refused elsewhere): logged and
    accepted, or 400 under --strict-params."""
    extra = sorted(set(request.model_extra or {}) - known)
    if not extra:
        return
    if strict:
        raise bad_request(
            f"Unrecognized request argument(s): {', '.join(extra)}.", param=extra[0], code="unknown_parameter"
        )
    shown = ", ".join(repr(name[:40]) for name in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    logger.warning("ignoring unrecognized request field(s): %s", shown)  # names only, cut short: never values


def check_max_logprobs(request: SamplingFields, limit: int) -> None:
    """Alternatives per token past --max-logprobs: a 400 naming the field (completions' `logprobs`, chat's
    `top_logprobs`, vLLM's `prompt_logprobs`; chat's boolean `logprobs` is not a count)."""
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(request, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise bad_request(f"{name} {value} is more than this server allows (--max-logprobs {limit}).", param=name)


def check_prompt_chars(state: "ServerState", num_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose length in characters alone proves it cannot fit: no token
    covers more than the vocabulary's longest entry (times a margin for normalizers)."""
    per_token = state.tokenizer.max_token_chars
    if per_token is None:
        return
    limit = state.max_model_len * per_token * PROMPT_CHARS_MARGIN
    if num_chars > limit:
        raise APIError(
            400,
            f"The prompt has {num_chars} characters; this model's maximum context length is "
            f"{state.max_model_len} tokens, which never hold more than {limit} characters. "
            f"Shorten the prompt.",
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,
        )


def check_queue_room(state: "ServerState", num_sequences: int, param: str) -> None:
    """Before any work: 400 for a request that could never be queued, 429 when the queue is full now."""
    state.admission.check_size(num_sequences, param)
    state.admission.precheck(num_sequences)
