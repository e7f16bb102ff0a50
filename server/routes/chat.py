"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.request_stream import RequestStream
from scheduler import RequestRejectedError
from server.chat_messages import message_chars, render_prompt
from server.errors import ERROR_RESPONSES, bad_request, rejection_error
from server.generation import (Choice, ChoicesStreamingResponse, RequestGuard, UsageCounter, check_common,
                               check_prompt_chars, check_queue_room, collect_or_cancel,
                               continuous_usage, make_sampling_params, plan_choices, start_generation, stream_choices)
from server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                             ChatCompletionRequest, ChatCompletionResponse, DeltaMessage,
                             new_id, now)
from server.rejections import CHAT_FIELD_NAMES
from server.structured_request import compile_constraint, constraint_from_extras, constraint_from_response_format
from server.tool_calls import ToolPlan, plan_tools, tool_call_dicts
from server.tool_stream import ToolCallStream
from engine.structured import StructuredOutputs
from server.sse import sse_event, with_error_events
from server.state import ServerState

router = APIRouter()

# OpenAI fields this server does not implement, with the values that mean "not used".
_UNSUPPORTED = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "metadata": (None,),
    "verbosity": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "echo": (False,),
    "continue_final_message": (False,),
}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include template rendering and tokenization
    state: ServerState = request.app.state.server
    model = check_common(body, state)
    _refuse_unsupported(body)
    tools = plan_tools(body.tools, body.tool_choice)
    constraint = _constraint(body, tools)
    check_queue_room(state, max(body.n, 1), "n")
    if constraint is not None:
        await compile_constraint(state, constraint)
    prompt = await _render(body, state, tools.tools)
    num_top = _num_top_logprobs(body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request_id = body.request_id or new_id("chatcmpl")
    try:
        params = make_sampling_params(body, max_tokens=max_tokens, logprobs=num_top,
                                      structured_outputs=None if constraint is None else constraint[0])
        choices = plan_choices(request_id, [prompt], params)
        streams, guard = await start_generation(state, choices, body.priority, arrival_time)
    except RequestRejectedError as exc:  # name the fields as chat spells them
        names = dict(CHAT_FIELD_NAMES)
        if body.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        raise rejection_error(exc, names) from None
    if body.stream:
        events = _stream(state, body, model, request_id, choices, streams, num_top, guard, tools)
        return ChoicesStreamingResponse(with_error_events(events, state.metrics), streams, guard)
    results = await collect_or_cancel(request, choices, streams, guard)
    out = []
    for choice, result in zip(choices, results):
        logprobs = state.formatter.chat(result.logprobs or [], num_top) if num_top is not None else None
        content, calls = tools.calls_of(result.text, state.config.tool_call_parser)
        finish_reason = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
        message = AssistantMessage(content=content, tool_calls=tool_call_dicts(calls) if calls else None)
        out.append(ChatChoice(index=choice.index, message=message, logprobs=logprobs,
                              finish_reason=finish_reason, stop_reason=result.stop_reason))
    counter = UsageCounter.of([prompt], body.n)
    for choice, result in zip(choices, results):
        counter.add(choice, len(result.token_ids), result.num_cached_tokens)
    response = ChatCompletionResponse(id=request_id, created=now(), model=model, choices=out, usage=counter.usage())
    return JSONResponse(response.model_dump())


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    for name, allowed in _UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise bad_request(f"{name} is not supported by this server.", param=name, code="unsupported_parameter")


def _constraint(body: ChatCompletionRequest, tools: ToolPlan) -> Optional[tuple[StructuredOutputs, str]]:
    """The output's grammar: from response_format, the vLLM extras or the tools; at most one of them."""
    found = [c for c in (constraint_from_response_format(body.response_format), constraint_from_extras(body),
                         tools.constraint(body.parallel_tool_calls)) if c is not None]
    if len(found) > 1:
        raise bad_request("response_format, structured_outputs / guided_* and tool_choice required or named "
                          "each constrain the output; use one.", param=found[1][1])
    return found[0] if found else None


def _num_top_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


async def _render(body: ChatCompletionRequest, state: ServerState, tools: Optional[list[dict]]) -> list[int]:
    """The prompt's token ids: the messages are measured first, then rendered and tokenized off the loop."""
    if not body.messages:
        raise bad_request("messages must not be empty.", param="messages")
    check_prompt_chars(state, message_chars(body.messages), "messages")
    return await asyncio.to_thread(render_prompt, state.tokenizer, body.messages, body.add_generation_prompt, tools)


async def _stream(state: ServerState, body: ChatCompletionRequest, model: str, request_id: str,
                  choices: list[Choice], streams: list[RequestStream], num_top: Optional[int],
                  guard: RequestGuard, tools: ToolPlan) -> AsyncIterator[bytes]:
    created = now()
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    every_chunk = continuous_usage(body)
    counter = UsageCounter.of([choices[0].prompt_token_ids], body.n)

    def chunk(choices_, usage=None) -> bytes:
        return sse_event(ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices_,
                                             usage=usage))

    for choice in choices:  # closed here, the response still closes the streams
        yield chunk([ChatChunkChoice(index=choice.index, delta=DeltaMessage(role="assistant", content=""))],
                    counter.choice_usage(choice) if every_chunk else None)
    tool_streams = {c.index: ToolCallStream(tools, state.config.tool_call_parser) for c in choices} \
        if tools.mode != "none" else {}
    async for choice, output in stream_choices(choices, streams, guard=guard):
        counter.add(choice, len(output.new_token_ids), output.num_cached_tokens)
        if not output.text_delta and not output.finished and num_top is None:
            continue
        logprobs = state.formatter.chat(output.logprobs or [], num_top) if num_top is not None else None
        finish_reason = output.finish_reason
        deltas = [DeltaMessage(content=output.text_delta)]
        tool_stream = tool_streams.get(choice.index)
        if tool_stream is not None:
            deltas = tool_stream.feed(output.text_delta, output.finished)
            finish_reason = tool_stream.finish_reason(finish_reason)
            for delta in deltas[:-1]:
                yield chunk([ChatChunkChoice(index=choice.index, delta=delta)],
                            counter.choice_usage(choice) if every_chunk else None)
            deltas = deltas[-1:] or [DeltaMessage()]
            if deltas[0] == DeltaMessage() and not output.finished and num_top is None:
                continue
        yield chunk([ChatChunkChoice(index=choice.index, delta=deltas[0], logprobs=logprobs,
                                     finish_reason=finish_reason, stop_reason=output.stop_reason)],
                    counter.choice_usage(choice) if every_chunk else None)
    if include_usage:
        yield chunk([], counter.usage())
