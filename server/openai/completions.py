"""POST /v1/completions: the completions protocol in and out of the serving pipeline."""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.outputs import OutputAccumulator
from engine.sampling.sampler import TokenLogprobs
from server.http.errors import ERROR_RESPONSES, bad_request
from server.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, new_id, now
from server.serving import unsupported
from server.serving.constraints import constraint_from_response_format
from server.serving.choices import Choice, UsageCounter
from server.serving.pipeline import Generation, GenerationRequest, start_generation
from server.serving.prompts import TextPrompts
from server.serving.sse import sse_event
from server.state import ServerState

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request):
    arrival_time = time.monotonic()  # queue time and TTFT include tokenization
    state: ServerState = request.app.state.server
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(
            "best_of must equal n (best-of-n selection is not supported).",
            param="best_of",
            code="unsupported_parameter",
        )
    # echo with max_tokens 0 (vLLM's echo without generation: a prompt scored, its logprobs): one token is
    # generated, as a step must, and left out of the response
    echo_only = body.echo and body.max_tokens == 0
    generation = await start_generation(
        state,
        GenerationRequest(
            body=body,
            request_id=body.request_id or new_id("cmpl"),
            prompt=TextPrompts(
                body.prompt,
                add_special_tokens=body.add_special_tokens,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
                truncation_side=body.truncation_side,
            ),
            max_tokens=1 if echo_only else body.max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=_prompt_logprobs(body),
            unsupported=unsupported.COMPLETIONS,
            constraints=[("response_format", constraint_from_response_format(body.response_format))],
        ),
        arrival_time,
    )
    if body.stream:
        return generation.stream(_stream(generation, body, echo_only))
    results = await generation.collect(request)
    return JSONResponse(_response(generation, body, results, echo_only).model_dump())


def _prompt_logprobs(body: CompletionRequest) -> Optional[int]:
    """The alternatives per prompt token the engine computes: vLLM's prompt_logprobs, and an echo's logprobs."""
    counts = [body.prompt_logprobs, body.logprobs if body.echo else None]
    present = [count for count in counts if count is not None]
    return max(present) if present else None


def _echo_text(state: ServerState, body: CompletionRequest, choice: Choice) -> str:
    """The prompt as sent when it was text; token ids, and a truncated prompt, are decoded."""
    if body.truncate_prompt_tokens is not None:
        return state.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)
    if isinstance(body.prompt, str):
        return body.prompt
    if isinstance(body.prompt[0], str):
        return body.prompt[choice.prompt_index]
    return state.tokenizer.decode(choice.prompt_token_ids, skip_special_tokens=False)


def _response(
    generation: Generation, body: CompletionRequest, results: list[OutputAccumulator], echo_only: bool
) -> CompletionResponse:
    state, choices = generation.state, generation.choices
    out_choices = []
    for choice, result in zip(choices, results):
        prefix = _echo_text(state, body, choice) if body.echo else ""
        text, token_ids = ("", []) if echo_only else (result.text, list(result.token_ids))
        logprobs = None
        if body.logprobs is not None:
            entries: list[Optional[TokenLogprobs]] = [] if echo_only else list(result.logprobs or [])
            tokens = token_ids
            if body.echo:
                prompt_entries = list(result.prompt_logprobs or [])
                if len(prompt_entries) != len(choice.prompt_token_ids):
                    raise RuntimeError(
                        f"{len(prompt_entries)} prompt logprobs for {len(choice.prompt_token_ids)} prompt tokens"
                    )
                entries = prompt_entries + entries
                tokens = choice.prompt_token_ids + tokens
            logprobs = state.formatter.completion(
                entries, tokens, body.logprobs, as_ids=body.return_tokens_as_token_ids
            )
        out_choices.append(
            CompletionChoice(
                index=choice.index,
                text=prefix + text,
                logprobs=logprobs,
                finish_reason="length" if echo_only else result.finish_reason,
                stop_reason=None if echo_only else result.stop_reason,
                prompt_logprobs=None
                if body.prompt_logprobs is None
                else state.formatter.prompt(
                    result.prompt_logprobs or [], body.prompt_logprobs, body.return_tokens_as_token_ids
                ),
            )
        )
    counter = UsageCounter.of(generation.prompts, body.n)
    for choice, result in zip(choices, results):
        counter.add(choice, 0 if echo_only else len(result.token_ids), result.num_cached_tokens)
    return CompletionResponse(
        id=generation.request_id, created=now(), model=generation.model, choices=out_choices, usage=counter.usage()
    )


async def _stream(generation: Generation, body: CompletionRequest, echo_only: bool) -> AsyncIterator[bytes]:
    state, choices = generation.state, generation.choices
    request_id, model = generation.request_id, generation.model
    created = now()
    include_usage = state.config.enable_force_include_usage or (
        body.stream_options is not None and body.stream_options.include_usage
    )
    every_chunk = body.stream_options is not None and body.stream_options.continuous_usage_stats
    counter = UsageCounter.of(generation.prompts, body.n)
    started: set[int] = set()
    offsets = {choice.index: 0 for choice in choices}
    async for choice, output in generation.outputs():
        text, tokens = output.text_delta, list(output.new_token_ids)
        entries: list[Optional[TokenLogprobs]] = list(output.logprobs or [])
        if echo_only:  # (the one token generated is not part of the answer)
            text, tokens, entries = "", [], []
        if body.echo and choice.index not in started:
            text = _echo_text(state, body, choice) + text
            if body.logprobs is not None:
                prompt_entries = output.prompt_logprobs or [None] * len(choice.prompt_token_ids)
                entries, tokens = list(prompt_entries) + entries, choice.prompt_token_ids + tokens
        started.add(choice.index)
        counter.add(choice, 0 if echo_only else len(output.new_token_ids), output.num_cached_tokens)
        if not text and not output.finished and body.logprobs is None:
            continue  # nothing to say yet (text held back for a possible stop string)
        logprobs = None
        if body.logprobs is not None:
            logprobs = state.formatter.completion(
                entries, tokens, body.logprobs, offsets[choice.index], as_ids=body.return_tokens_as_token_ids
            )
            offsets[choice.index] += sum(len(t) for t in logprobs.tokens)
        chunk = CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason="length" if echo_only and output.finished else output.finish_reason,
                    stop_reason=None if echo_only else output.stop_reason,
                )
            ],
            usage=counter.choice_usage(choice) if every_chunk else None,
        )
        yield sse_event(chunk)
    if include_usage:
        yield sse_event(
            CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=counter.usage())
        )
