"""From an OpenAI request to engine requests: sampling parameters, prompts, and the choices' streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence

from fastapi.responses import StreamingResponse

from engine.async_engine import AsyncEngine, RequestInput
from engine.outputs import OutputAccumulator, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling.parallel import fan_out
from engine.sampling.params import SamplingParams
from server.errors import APIError, bad_request
from server.protocol import PromptTokensDetails, SamplingFields, Usage

if TYPE_CHECKING:
    from server.state import ServerState

logger = logging.getLogger(__name__)


def check_model(requested: Optional[str], served: Sequence[str]) -> str:
    """The served model name for the request; 404 for an unknown one."""
    if requested is None or requested in served:
        return served[0]
    raise APIError(404, f"The model {requested!r} does not exist; this server serves {', '.join(map(repr, served))}.",
                   param="model", code="model_not_found")


def check_extra_fields(request: SamplingFields, strict: bool) -> None:
    """Fields nobody defines: logged and accepted, or 400 under --strict-params."""
    extra = sorted(request.model_extra or {})
    if not extra:
        return
    if strict:
        raise bad_request(f"Unrecognized request argument(s): {', '.join(extra)}.", param=extra[0],
                          code="unknown_parameter")
    logger.warning("ignoring unrecognized request field(s): %s", ", ".join(extra))


# vLLM request extras this server does not implement: refused by name, never ignored.
UNIMPLEMENTED_EXTRAS = frozenset({
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "chat_template", "chat_template_kwargs",
    "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "use_beam_search", "length_penalty",
    "prompt_logprobs", "return_tokens_as_token_ids", "documents", "mm_processor_kwargs", "lora_request",
    "kv_transfer_params", "vllm_xargs", "cache_salt", "response_format",
})


def check_common(request: SamplingFields, state: "ServerState") -> str:
    """The checks every generation route makes first; returns the served model name."""
    if state.draining or not state.engine.is_alive:
        raise APIError(503, "the server is shutting down" if state.draining
                       else f"the engine is not running: {state.engine.error or 'stopped'}")
    model = check_model(request.model, state.served_model_names)
    unimplemented = sorted(UNIMPLEMENTED_EXTRAS & set(request.model_extra or {}))
    if unimplemented:
        raise bad_request(f"{', '.join(unimplemented)} is not supported by this server.", param=unimplemented[0],
                          code="unsupported_parameter")
    check_extra_fields(request, state.config.strict_params)
    check_stream_options(request)
    if request.priority != 0 and state.engine.scheduling_policy != "priority":
        raise bad_request("priority needs a server started with --scheduling-policy priority.", param="priority")
    return model


def check_stream_options(request: SamplingFields) -> None:
    options = request.stream_options
    if options is None:
        return
    if not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
    if options.continuous_usage_stats:
        raise bad_request("stream_options.continuous_usage_stats is not supported.",
                          param="stream_options", code="unsupported_parameter")


_DEFAULTED_WHEN_NULL = frozenset({"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"})


def make_sampling_params(request: SamplingFields, *, max_tokens: Optional[int], logprobs: Optional[int] = None,
                         prompt_logprobs: Optional[int] = None) -> SamplingParams:
    """SamplingParams from the request's fields; a bad value is a 400 naming its field."""
    values = {
        "n": request.n,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "logit_bias": request.logit_bias,
        "seed": request.seed,
        "max_tokens": max_tokens,
        "min_tokens": request.min_tokens,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": request.ignore_eos,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "skip_special_tokens": request.skip_special_tokens,
        "spaces_between_special_tokens": request.spaces_between_special_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }
    # An unset (null) field takes SamplingParams' default; for the others None is the default.
    kwargs = {k: v for k, v in values.items() if v is not None or k not in _DEFAULTED_WHEN_NULL}
    return SamplingParams(**kwargs)  # a RequestRejectedError becomes a 400 in the app's handler


@dataclass(slots=True)
class Choice:
    """One engine request behind a response choice."""

    index: int
    request_id: str
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


def plan_choices(request_id: str, prompts: list[list[int]], params: SamplingParams) -> list[Choice]:
    """Choice `prompt_index * n + i` is child i of prompt `prompt_index` (OpenAI's numbering)."""
    choices = []
    for prompt_index, prompt in enumerate(prompts):
        base = request_id if len(prompts) == 1 else f"{request_id}-p{prompt_index}"
        for i, (child_id, child_params) in enumerate(fan_out(base, params)):
            choices.append(Choice(prompt_index * params.n + i, child_id, prompt_index, prompt, child_params))
    return choices


@dataclass(slots=True)
class UsageCounter:
    """A response's token usage, streamed or not: every prompt once, every choice's completion tokens,
    the cached prompt tokens of each prompt's first choice."""

    prompt_tokens: int
    n: int
    completion_tokens: int = 0
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> cached tokens

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], n: int) -> "UsageCounter":
        return cls(sum(len(p) for p in prompts), n)

    def add(self, choice: Choice, num_tokens: int, num_cached_tokens: int) -> None:
        self.completion_tokens += num_tokens
        if choice.index % self.n == 0:
            self.cached_tokens[choice.prompt_index] = num_cached_tokens

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))


async def start_choices(engine: AsyncEngine, choices: Sequence[Choice], priority: int,
                        arrival_time: float) -> list[RequestStream]:
    """Queue every choice in the engine, all or none; their streams in the same order. A choice that can
    never be served refuses the whole request (a RequestRejectedError, a 400) before anything runs.
    `arrival_time` is when the route received the request."""
    inputs = [RequestInput(choice.request_id, choice.prompt_token_ids, choice.params) for choice in choices]
    return await engine.add_requests(inputs, priority=priority, arrival_time=arrival_time)


async def stream_choices(choices: Sequence[Choice],
                         streams: Sequence[RequestStream]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Interleave the outputs of every choice as they come. Ending or closing this iterator closes every
    stream, which aborts the choices still running."""
    try:
        if len(choices) == 1:  # nothing to interleave: read the engine's stream directly
            async for output in streams[0]:
                yield choices[0], output
            return
        async with contextlib.aclosing(_interleave(choices, streams)) as items:
            async for item in items:
                yield item
    finally:
        await close_streams(streams)


class ChoicesStreamingResponse(StreamingResponse):
    """An SSE response that owns its choices' engine streams: whenever the response ends (sent,
    failed, or never started because the client left before the headers went out) it closes them,
    aborting the choices still running. A plain StreamingResponse whose body generator never
    starts would leave them to run to max_tokens for nobody."""

    def __init__(self, content: AsyncIterator[bytes], streams: Sequence[RequestStream]):
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_streams(self._streams)  # never suspends: completes even when cancelled


async def close_streams(streams: Sequence[RequestStream]) -> None:
    """Let go of every stream, aborting the choices still running (closing twice is harmless)."""
    for stream in streams:
        await stream.aclose()


async def _interleave(choices: Sequence[Choice],
                      streams: Sequence[RequestStream]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((choice, output))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)
            return
        queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(choice, stream)) for choice, stream in zip(choices, streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_choices(choices: Sequence[Choice], streams: Sequence[RequestStream]) -> list[OutputAccumulator]:
    results = {choice.request_id: OutputAccumulator() for choice in choices}
    async for choice, output in stream_choices(choices, streams):
        results[choice.request_id].add(output)
    return list(results.values())
