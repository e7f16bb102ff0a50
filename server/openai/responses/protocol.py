"""The Responses API's shapes (`POST /v1/responses`): the request, its output items and the response object.

Stateless: nothing is stored. `store` is accepted (true is OpenAI's default) and answered as `false`, as vLLM
does without its response store; `previous_response_id` and every other field that needs state or a feature
this server lacks is refused by name (server/serving/unsupported.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import ConfigDict

from server.openai.protocol import SamplingFields


class ResponsesRequest(SamplingFields):
    """OpenAI's ResponseCreateParams; vLLM's sampling extras (top_k, seed, ...) come from SamplingFields."""

    model_config = ConfigDict(extra="allow", strict=True)

    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    text: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    stream_options: Optional[dict[str, Any]] = None  # type: ignore[assignment]  # Responses' own options
    # OpenAI fields with no implementation here: refused when set (server/serving/unsupported.py).
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    background: Optional[bool] = None
    background_options: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    include: Optional[list[str]] = None
    max_tool_calls: Optional[int] = None
    prompt: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    prompt_cache_retention: Optional[str] = None
    truncation: Optional[str] = None
    top_logprobs: Optional[int] = None
    context_management: Optional[list[dict[str, Any]]] = None
    moderation: Optional[dict[str, Any]] = None
    image: Optional[dict[str, Any]] = None
    access_programs: Optional[dict[str, Any]] = None


def new_item_id(prefix: str) -> str:
    """OpenAI's ids: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: Optional[str], status: str) -> dict:
    """An assistant message item; `text` None: its content part has not begun (a stream's first event)."""
    content = [] if text is None else [output_text_part(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    body: ResponsesRequest,
    *,
    response_id: str,
    created_at: int,
    model: str,
    output: list[dict],
    status: str,
    usage_: Optional[dict] = None,
    sampling: Optional[tuple[float, float]] = None,
) -> dict:
    """The `response` object; `status` in_progress (a stream's first events), completed or incomplete;
    `sampling`: the temperature and top_p the request runs with (the model's defaults where the body gave none,
    as vLLM reports them)."""
    temperature, top_p = sampling if sampling is not None else (body.temperature, body.top_p)
    text = body.text if body.text is not None else {"format": {"type": "text"}}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "model": model,
        "status": status,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "text": text,
        "metadata": body.metadata or {},
        "user": body.user,
        "store": False,
        "previous_response_id": None,
        "background": False,
        "truncation": "disabled",
        "reasoning": None,
        "service_tier": "default",
        "usage": usage_,
    }
