"""POST /v1/chat/completions: the chat protocol in and out of the serving pipeline."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.http.errors import ERROR_RESPONSES, bad_request
from server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    new_id,
    now,
)
from server.openai.chat_messages import template_messages
from server.openai.reasoning import ReasoningSplitter, starts_in_reasoning
from server.openai.tools.calls import ToolPlan, plan_tools, tool_call_dicts
from server.openai.tools.stream import ToolCallStream
from server.serving import unsupported
from server.serving.choices import UsageCounter
from server.serving.constraints import constraint_from_response_format, format_beside_forced_calls
from server.serving.pipeline import Generation, GenerationRequest, start_generation
from server.serving.prompts import ChatPrompt
from server.serving.rejections import CHAT_FIELD_NAMES
from server.serving.sse import sse_event
from server.state import ServerState

router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include template rendering and tokenization
    state: ServerState = request.app.state.server
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    num_top = _num_top_logprobs(body)
    response_format = constraint_from_response_format(body.response_format)
    forced_calls = tools.constraint(body.parallel_tool_calls)
    names = dict(CHAT_FIELD_NAMES)
    if body.max_completion_tokens is not None:
        names["max_tokens"] = "max_completion_tokens"
    generation = await start_generation(
        state,
        GenerationRequest(
            body=body,
            request_id=body.request_id or new_id("chatcmpl"),
            prompt=ChatPrompt(
                body.messages,
                body.add_generation_prompt,
                tools.tools,
                add_special_tokens=body.add_special_tokens,
                continue_final_message=body.continue_final_message,
                template_kwargs=body.chat_template_kwargs,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side,
                chat_template=body.chat_template,
            ),
            max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
            logprobs=num_top,
            prompt_logprobs=body.prompt_logprobs,
            unsupported=unsupported.CHAT,
            constraints=[
                ("response_format", format_beside_forced_calls(response_format, forced_calls)),
                ("tool_choice required or named", forced_calls),
            ],
            field_names=names,
        ),
        arrival_time,
    )
    if body.stream:
        return generation.stream(_stream(generation, body, num_top, tools))
    results = await generation.collect(request)
    out = []
    counter = UsageCounter.of(generation.prompts, body.n)
    echoed = _echoed(state, body)
    role = _response_role(state, body)
    for choice, result in zip(generation.choices, results):
        logprobs = (
            state.formatter.chat(result.logprobs or [], num_top, body.return_tokens_as_token_ids)
            if num_top is not None
            else None
        )
        reasoning: Optional[str] = None
        answer: Optional[str] = result.text
        splitter = _reasoning_splitter(generation, choice.prompt_index)
        if splitter is not None:
            reasoning, answer = splitter.split(result.text)
        content, calls = (None, []) if answer is None else tools.calls_of(answer, state.config.tool_call_parser)
        finish_reason = tools.finish_reason(result.finish_reason, bool(calls))
        if echoed and content is not None:
            content = echoed + content
        message = AssistantMessage(
            role=role,
            content=content,
            reasoning=reasoning,
            tool_calls=tool_call_dicts(calls) if calls else None,
        )
        out.append(
            ChatChoice(
                index=choice.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=result.stop_reason,
            )
        )
        counter.add(choice, len(result.token_ids), result.num_cached_tokens)
    response = ChatCompletionResponse(
        id=generation.request_id,
        created=now(),
        model=generation.model,
        choices=out,
        usage=counter.usage(),
        prompt_logprobs=None
        if body.prompt_logprobs is None
        else state.formatter.prompt(
            results[0].prompt_logprobs or [], body.prompt_logprobs, body.return_tokens_as_token_ids
        ),
    )
    return JSONResponse(response.model_dump())


def _response_role(state: ServerState, body: ChatCompletionRequest) -> str:
    """The answer's role: --response-role's for a new turn, else the role of the message it continues (vLLM's)."""
    return state.config.response_role if body.add_generation_prompt or not body.messages else body.messages[-1].role


def _reasoning_splitter(generation: Generation, prompt_index: int) -> Optional[ReasoningSplitter]:
    """With --reasoning-parser, a choice's splitter, started as the rendered prompt's end says (None: no parser)."""
    parser = generation.state.config.reasoning_parser
    if parser is None:
        return None
    tail = generation.state.tokenizer.decode(generation.prompts[prompt_index][-4:], skip_special_tokens=False)
    return ReasoningSplitter(starts_in_reasoning(parser, tail))


def _echoed(state: ServerState, body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is in the answer's role (the answer continues it; the
    message's content parts joined as the template reads them)."""
    last = body.messages[-1] if body.echo and body.messages else None
    if last is None or last.role != _response_role(state, body):
        return ""
    return template_messages([last])[0]["content"]


def _num_top_logprobs(body: ChatCompletionRequest) -> Optional[int]:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


async def _stream(
    generation: Generation, body: ChatCompletionRequest, num_top: Optional[int], tools: ToolPlan
) -> AsyncIterator[bytes]:
    state, choices = generation.state, generation.choices
    created = now()
    include_usage = state.config.enable_force_include_usage or (
        body.stream_options is not None and body.stream_options.include_usage
    )
    every_chunk = body.stream_options is not None and body.stream_options.continuous_usage_stats
    counter = UsageCounter.of(generation.prompts, body.n)

    def chunk(choices_, usage=None) -> bytes:
        return sse_event(
            ChatCompletionChunk(
                id=generation.request_id, created=created, model=generation.model, choices=choices_, usage=usage
            )
        )

    role = _response_role(state, body)
    for choice in choices:  # closed here, the response still closes the streams
        yield chunk(
            [ChatChunkChoice(index=choice.index, delta=DeltaMessage(role=role, content=""))],
            counter.choice_usage(choice) if every_chunk else None,
        )
    echoed = _echoed(state, body)
    if echoed:
        for choice in choices:
            yield chunk(
                [ChatChunkChoice(index=choice.index, delta=DeltaMessage(content=echoed))],
                counter.choice_usage(choice) if every_chunk else None,
            )
    tool_streams = (
        {c.index: ToolCallStream(tools, state.config.tool_call_parser) for c in choices} if tools.mode != "none" else {}
    )
    splitters = {c.index: _reasoning_splitter(generation, c.prompt_index) for c in choices}
    async for choice, output in generation.outputs():
        counter.add(choice, len(output.new_token_ids), output.num_cached_tokens)
        if not output.text_delta and not output.finished and num_top is None:
            continue
        logprobs = (
            state.formatter.chat(output.logprobs or [], num_top, body.return_tokens_as_token_ids)
            if num_top is not None
            else None
        )
        finish_reason = output.finish_reason
        text, deltas = output.text_delta, []
        splitter = splitters[choice.index]
        if splitter is not None:  # the thinking first, then what the answer's text is
            thought, text = splitter.feed(text, output.finished)
            if thought:
                deltas.append(DeltaMessage(reasoning=thought))
        tool_stream = tool_streams.get(choice.index)
        if tool_stream is not None:
            deltas += tool_stream.feed(text, output.finished)
            finish_reason = tool_stream.finish_reason(finish_reason)
        elif text or not deltas:
            deltas.append(DeltaMessage(content=text))
        for delta in deltas[:-1]:
            yield chunk(
                [ChatChunkChoice(index=choice.index, delta=delta)],
                counter.choice_usage(choice) if every_chunk else None,
            )
        deltas = deltas[-1:] or [DeltaMessage()]
        # (a splitter or a tool stream holding text back: nothing to send yet)
        if deltas[0] in (DeltaMessage(), DeltaMessage(content="")) and not output.finished and num_top is None:
            continue
        yield chunk(
            [
                ChatChunkChoice(
                    index=choice.index,
                    delta=deltas[0],
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=output.stop_reason,
                )
            ],
            counter.choice_usage(choice) if every_chunk else None,
        )
    if include_usage:
        yield chunk([], counter.usage())
