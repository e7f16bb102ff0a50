"""POST /v1/completions."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.outputs import OutputAccumulator
from engine.request_stream import RequestStream
from server.errors import ERROR_RESPONSES, bad_request
from server.generation import (Choice, ChoicesStreamingResponse, RequestGuard, UsageCounter, check_common,
                               check_prompt_chars, check_queue_room, collect_or_cancel,
                               continuous_usage, make_sampling_params, plan_choices, start_generation, stream_choices)
from server.protocol import (CompletionChoice, CompletionRequest, CompletionResponse, new_id, now)
from server.sse import sse_event, with_error_events
from server.state import ServerState
from server.structured_request import compile_constraint, constraint_from_extras

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include tokenization
    state: ServerState = request.app.state.server
    model = check_common(body, state)
    if body.suffix is not None:
        raise bad_request("suffix is not supported.", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (best-of-n selection is not supported).", param="best_of",
                          code="unsupported_parameter")
    num_prompts = 1 if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) \
        else len(body.prompt)
    check_queue_room(state, num_prompts * max(body.n, 1), "prompt" if num_prompts > 1 else "n")
    constraint = constraint_from_extras(body)
    if constraint is not None:
        await compile_constraint(state, constraint)
    prompts = await _prompt_token_ids(body, state)
    params = make_sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                                  prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                                  structured_outputs=None if constraint is None else constraint[0])
    request_id = body.request_id or new_id("cmpl")
    choices = plan_choices(request_id, prompts, params)
    streams, guard = await start_generation(state, choices, body.priority, arrival_time)
    if body.stream:
        events = _stream(state, body, model, request_id, choices, streams, prompts, guard)
        return ChoicesStreamingResponse(with_error_events(events, state.metrics), streams, guard)
    results = await collect_or_cancel(request, choices, streams, guard)
    return JSONResponse(_response(state, body, model, request_id, choices, prompts, results).model_dump())


async def _prompt_token_ids(body: CompletionRequest, state: ServerState) -> list[list[int]]:
    """The prompts' token ids; text is measured first (too long to fit: a 400), then tokenized off the loop."""
    prompt = body.prompt
    if not isinstance(prompt, str) and not prompt:
        raise bad_request("prompt must not be empty.", param="prompt")
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        for text in texts:
            check_prompt_chars(state, len(text), "prompt")
        tokenizer = state.tokenizer
        return await asyncio.to_thread(lambda: [tokenizer.encode(text) for text in texts])
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _echo_text(state: ServerState, body: CompletionRequest, choice: Choice) -> str:
    """The prompt as sent when it was text; token ids are decoded."""
    if isinstance(body.prompt, str):
        return body.prompt
    if isinstance(body.prompt[0], str):
        return body.prompt[choice.prompt_index]
    return state.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)


def _response(state, body, model, request_id, choices: list[Choice], prompts, results: list[OutputAccumulator]):
    out_choices = []
    for choice, result in zip(choices, results):
        prefix = _echo_text(state, body, choice) if body.echo else ""
        logprobs = None
        if body.logprobs is not None:
            entries, tokens = list(result.logprobs or []), list(result.token_ids)
            if body.echo:
                prompt_entries = list(result.prompt_logprobs or [])
                if len(prompt_entries) != len(choice.prompt_token_ids):
                    raise RuntimeError(f"{len(prompt_entries)} prompt logprobs for "
                                       f"{len(choice.prompt_token_ids)} prompt tokens")
                entries = prompt_entries + entries
                tokens = choice.prompt_token_ids + tokens
            logprobs = state.formatter.completion(entries, tokens, body.logprobs)
        out_choices.append(CompletionChoice(index=choice.index, text=prefix + result.text, logprobs=logprobs,
                                            finish_reason=result.finish_reason, stop_reason=result.stop_reason))
    counter = UsageCounter.of(prompts, body.n)
    for choice, result in zip(choices, results):
        counter.add(choice, len(result.token_ids), result.num_cached_tokens)
    return CompletionResponse(id=request_id, created=now(), model=model, choices=out_choices,
                              usage=counter.usage())


async def _stream(state: ServerState, body: CompletionRequest, model: str, request_id: str,
                  choices: list[Choice], streams: list[RequestStream], prompts: list[list[int]],
                  guard: RequestGuard) -> AsyncIterator[bytes]:
    created = now()
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    every_chunk = continuous_usage(body)
    counter = UsageCounter.of(prompts, body.n)
    started: set[int] = set()
    offsets = {choice.index: 0 for choice in choices}
    async for choice, output in stream_choices(choices, streams, guard=guard):
        text, tokens, entries = output.text_delta, list(output.new_token_ids), list(output.logprobs or [])
        if body.echo and choice.index not in started:
            text = _echo_text(state, body, choice) + text
            if body.logprobs is not None:
                prompt_entries = output.prompt_logprobs or [None] * len(choice.prompt_token_ids)
                entries, tokens = list(prompt_entries) + entries, choice.prompt_token_ids + tokens
        started.add(choice.index)
        counter.add(choice, len(output.new_token_ids), output.num_cached_tokens)
        if not text and not output.finished and body.logprobs is None:
            continue  # nothing to say yet (text held back for a possible stop string)
        logprobs = None
        if body.logprobs is not None:
            logprobs = state.formatter.completion(entries, tokens, body.logprobs, offsets[choice.index])
            offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
        chunk = CompletionResponse(
            id=request_id, created=created, model=model,
            choices=[CompletionChoice(index=choice.index, text=text, logprobs=logprobs,
                                      finish_reason=output.finish_reason, stop_reason=output.stop_reason)],
            usage=counter.choice_usage(choice) if every_chunk else None,
        )
        yield sse_event(chunk)
    if include_usage:
        yield sse_event(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                           usage=counter.usage()))
