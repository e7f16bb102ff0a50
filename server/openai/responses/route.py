"""POST /v1/responses: OpenAI's Responses API in and out of the serving pipeline, over the chat template and the
chat path's tools.

Stateless: `store` is answered as false and nothing is kept, so `previous_response_id` is a 400; an agent
sends the whole conversation, its function_call items and their function_call_output, in `input`.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.http.errors import ERROR_RESPONSES
from server.openai.protocol import DeltaMessage, now
from server.openai.responses.events import ResponseEvents
from server.openai.responses.input import chat_messages, chat_tool_choice, chat_tools, text_constraint
from server.openai.responses.protocol import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_item_id,
    response_object,
    usage,
)
from server.openai.tools.calls import ToolPlan, new_call_id, plan_tools
from server.openai.tools.stream import ToolCallStream
from server.serving import unsupported
from server.serving.constraints import format_beside_forced_calls
from server.serving.pipeline import Generation, GenerationRequest, start_generation
from server.serving.prompts import ChatPrompt
from server.serving.sse import Framing, sse_typed
from server.state import ServerState

router = APIRouter()

FIELD_NAMES = {"max_tokens": "max_output_tokens", "prompt": "input"}
"""How the Responses API spells the engine's fields."""


@router.post("/v1/responses", responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include template rendering and tokenization
    created_at = now()  # when the response was created, as OpenAI's completed_at - created_at is its duration
    state: ServerState = request.app.state.server
    tools = plan_tools(chat_tools(body.tools), chat_tool_choice(body.tool_choice), body.parallel_tool_calls)
    text_format, forced_calls = text_constraint(body.text), tools.constraint(body.parallel_tool_calls)
    generation = await start_generation(
        state,
        GenerationRequest(
            body=body,
            request_id=body.request_id or new_item_id("resp"),
            prompt=ChatPrompt(
                chat_messages(body.instructions, body.input, state.engine.processor is not None),
                True,
                tools.tools,
                "input",
            ),
            max_tokens=body.max_output_tokens,
            unsupported=unsupported.RESPONSES,
            constraints=[
                ("text.format", format_beside_forced_calls(text_format, forced_calls)),
                ("tool_choice required or named", forced_calls),
            ],
            field_names=FIELD_NAMES,
        ),
        arrival_time,
    )
    if body.stream:
        writer = ResponseEvents()
        framing = Framing(lambda error: sse_typed(writer.error(error)), b"")
        return generation.stream(_stream(generation, body, tools, writer, created_at), framing)
    (result,) = await generation.collect(request)
    status = "incomplete" if result.finish_reason == "length" else "completed"
    output = _output(tools, result.text, state.config.tool_call_parser, status)
    response = response_object(
        body,
        response_id=generation.request_id,
        created_at=created_at,
        model=generation.model,
        output=output,
        status=status,
        usage_=usage(len(generation.prompts[0]), len(result.token_ids), result.num_cached_tokens),
        sampling=_sampling(generation),
    )
    return JSONResponse(response)


def _output(tools: ToolPlan, text: str, parser: str, status: str) -> list[dict]:
    """The output items of a finished generation: its text as a message, its tool calls as function_call items.
    Only the last item takes `status`: those before it ended before the output did (as the stream closes them)."""
    content, calls = tools.calls_of(text, parser)
    items = [message_item(new_item_id("msg"), content, "completed")] if content or not calls else []
    items += [
        function_call_item(new_item_id("fc"), new_call_id(), call.name, call.arguments, "completed") for call in calls
    ]
    items[-1]["status"] = status
    return items


async def _stream(
    generation: Generation, body: ResponsesRequest, tools: ToolPlan, writer: ResponseEvents, created: int
) -> AsyncIterator[bytes]:
    state, (choice,) = generation.state, generation.choices

    def response(status: str, usage_: Optional[dict] = None) -> dict:
        return response_object(
            body,
            response_id=generation.request_id,
            created_at=created,
            model=generation.model,
            output=writer.output,
            status=status,
            usage_=usage_,
            sampling=_sampling(generation),
        )

    yield _frames(
        [
            writer.event("response.created", response=response("in_progress")),
            writer.event("response.in_progress", response=response("in_progress")),
        ]
    )
    tool_stream = ToolCallStream(tools, state.config.tool_call_parser) if tools.mode != "none" else None
    output_tokens = cached_tokens = 0
    finish_reason = None
    async for _, output in generation.outputs():
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


def _sampling(generation: Generation) -> tuple[float, float]:
    params = generation.choices[0].sampling
    return params.temperature, params.top_p


def _frames(events: list[dict]) -> bytes:
    return b"".join(sse_typed(event) for event in events)
