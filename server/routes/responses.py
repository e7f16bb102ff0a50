"""POST /v1/responses: OpenAI's Responses API over the chat path (template, generation, grammar, tool calls).

Stateless: `store` is answered as false and nothing is kept, so `previous_response_id` is a 400; an agent
sends the whole conversation, its function_call items and their function_call_output, in `input`.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.request_stream import RequestStream
from engine.structured import StructuredOutputs
from scheduler import RequestRejectedError
from server.chat_messages import message_chars, render_prompt
from server.errors import ERROR_RESPONSES, bad_request, rejection_error
from server.generation import (Choice, ChoicesStreamingResponse, RequestGuard, check_common, check_prompt_chars,
                               check_queue_room, collect_or_cancel, make_sampling_params, plan_choices,
                               start_generation, stream_choices)
from server.protocol import DeltaMessage, now
from server.responses_input import chat_messages, chat_tool_choice, chat_tools, text_constraint
from server.responses_protocol import (UNSUPPORTED, ResponsesRequest, function_call_item, message_item,
                                       new_item_id, response_object, unsupported_reason, usage)
from server.responses_stream import ResponseEvents, sse_typed, with_error_event
from server.state import ServerState
from server.structured_request import compile_constraint, constraint_from_extras
from server.tool_calls import ToolPlan, new_call_id, plan_tools
from server.tool_stream import ToolCallStream

router = APIRouter()

FIELD_NAMES = {"max_tokens": "max_output_tokens", "prompt": "input"}
"""How the Responses API spells the engine's fields."""


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include template rendering and tokenization
    state: ServerState = request.app.state.server
    model = check_common(body, state)
    _refuse_unsupported(body)
    tools = plan_tools(chat_tools(body.tools), chat_tool_choice(body.tool_choice))
    constraint = _constraint(body, tools)
    check_queue_room(state, 1, "input")
    messages = chat_messages(body.instructions, body.input)
    if constraint is not None:
        await compile_constraint(state, constraint)
    check_prompt_chars(state, message_chars(messages), "input")
    prompt = await asyncio.to_thread(render_prompt, state.tokenizer, messages, True, tools.tools, "input")
    response_id = body.request_id or new_item_id("resp")
    try:
        params = make_sampling_params(body, max_tokens=body.max_output_tokens,
                                      structured_outputs=None if constraint is None else constraint[0])
        choices = plan_choices(response_id, [prompt], params)
        streams, guard = await start_generation(state, choices, body.priority, arrival_time)
    except RequestRejectedError as exc:
        raise rejection_error(exc, FIELD_NAMES) from None
    if body.stream:
        writer = ResponseEvents()
        events = _stream(state, body, model, response_id, choices[0], streams[0], guard, tools, writer)
        return ChoicesStreamingResponse(with_error_event(events, writer, state.metrics), streams, guard)
    (result,) = await collect_or_cancel(request, choices, streams, guard)
    status = "incomplete" if result.finish_reason == "length" else "completed"
    output = _output(tools, result.text, state.config.tool_call_parser, status)
    response = response_object(body, response_id=response_id, created_at=now(), model=model, output=output,
                               status=status,
                               usage_=usage(len(prompt), len(result.token_ids), result.num_cached_tokens))
    return JSONResponse(response)


def _refuse_unsupported(body: ResponsesRequest) -> None:
    for name, allowed in UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise bad_request(f"{name} is not supported: {unsupported_reason(name)}.", param=name,
                              code="unsupported_parameter")


def _constraint(body: ResponsesRequest, tools: ToolPlan) -> Optional[tuple[StructuredOutputs, str]]:
    """The output's grammar: from text.format, the vLLM extras (structured_outputs / guided_*) or the tools
    (required or named); at most one of them."""
    found = [c for c in (text_constraint(body.text), constraint_from_extras(body),
                         tools.constraint(body.parallel_tool_calls)) if c is not None]
    if len(found) > 1:
        raise bad_request("text.format, structured_outputs / guided_* and tool_choice required or named each "
                          "constrain the output; use one.", param=found[1][1])
    return found[0] if found else None


def _output(tools: ToolPlan, text: str, parser: str, status: str) -> list[dict]:
    """The output items of a finished generation: its text as a message, its tool calls as function_call items."""
    content, calls = tools.calls_of(text, parser)
    items = [message_item(new_item_id("msg"), content, status)] if content or not calls else []
    return items + [function_call_item(new_item_id("fc"), new_call_id(), call.name, call.arguments, status)
                    for call in calls]


async def _stream(state: ServerState, body: ResponsesRequest, model: str, response_id: str, choice: Choice,
                  stream: RequestStream, guard: RequestGuard, tools: ToolPlan,
                  writer: ResponseEvents) -> AsyncIterator[bytes]:
    created = now()

    def response(status: str, usage_: Optional[dict] = None) -> dict:
        return response_object(body, response_id=response_id, created_at=created, model=model,
                               output=writer.output, status=status, usage_=usage_)

    yield _frames([writer.event("response.created", response=response("in_progress")),
                   writer.event("response.in_progress", response=response("in_progress"))])
    tool_stream = ToolCallStream(tools, state.config.tool_call_parser) if tools.mode != "none" else None
    output_tokens = cached_tokens = 0
    finish_reason = None
    async for _, output in stream_choices([choice], [stream], guard=guard):
        output_tokens += len(output.new_token_ids)
        cached_tokens = output.num_cached_tokens
        finish_reason = output.finish_reason if output.finished else finish_reason
        if tool_stream is not None:
            deltas = tool_stream.feed(output.text_delta, output.finished)
        else:
            deltas = [DeltaMessage(content=output.text_delta)]
        events = writer.deltas(deltas)
        if events:
            yield _frames(events)
    status = "incomplete" if finish_reason == "length" else "completed"
    events = writer.finish(status)
    final = response(status, usage(len(choice.prompt_token_ids), output_tokens, cached_tokens))
    yield _frames(events + [writer.event(f"response.{status}", response=final)])


def _frames(events: list[dict]) -> bytes:
    return b"".join(sse_typed(event) for event in events)
