"""From an OpenAI request to engine requests: sampling parameters, prompts, and the choices' streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Optional, Sequence

from fastapi import Request
from fastapi.responses import StreamingResponse

from engine.async_engine import AsyncEngine, RequestInput
from engine.outputs import OutputAccumulator, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling.parallel import fan_out
from engine.sampling.params import SamplingParams
from engine.structured import StructuredOutputs
from server.errors import APIError, bad_request
from server.request_guard import RequestGuard, RequestTimeoutError
from server.rejections import CONTEXT_LENGTH_EXCEEDED
from server.protocol import PromptTokensDetails, SamplingFields, Usage
from server.structured_request import STRUCTURED_EXTRAS
from server.disconnect import cancel_on_disconnect

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
    extra = sorted(set(request.model_extra or {}) - STRUCTURED_EXTRAS)
    if not extra:
        return
    if strict:
        raise bad_request(f"Unrecognized request argument(s): {', '.join(extra)}.", param=extra[0],
                          code="unknown_parameter")
    shown = ", ".join(repr(name[:40]) for name in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    logger.warning("ignoring unrecognized request field(s): %s", shown)  # names only, cut short: never values


# vLLM request extras this server does not implement: refused by name, never ignored.
UNIMPLEMENTED_EXTRAS = frozenset({
    "guided_decoding_backend", "guided_whitespace_pattern", "chat_template", "chat_template_kwargs",
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
    check_max_logprobs(request, state.config.max_logprobs)
    if request.priority != 0 and state.engine.scheduling_policy != "priority":
        raise bad_request("priority needs a server started with --scheduling-policy priority.", param="priority")
    return model


def check_max_logprobs(request: SamplingFields, limit: int) -> None:
    """Alternatives per token past --max-logprobs: a 400 naming the field (completions' `logprobs`, chat's
    `top_logprobs`; chat's boolean `logprobs` is not a count)."""
    for name in ("logprobs", "top_logprobs"):
        value = getattr(request, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise bad_request(f"{name} {value} is more than this server allows (--max-logprobs {limit}).",
                              param=name)


def check_stream_options(request: SamplingFields) -> None:
    options = request.stream_options
    if options is None:
        return
    if not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")


def continuous_usage(request: SamplingFields) -> bool:
    """`stream_options.continuous_usage_stats`: every chunk carries the usage of its choice so far (vLLM's)."""
    return request.stream_options is not None and request.stream_options.continuous_usage_stats


_DEFAULTED_WHEN_NULL = frozenset({"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                  "repetition_penalty"})


def make_sampling_params(request: SamplingFields, *, max_tokens: Optional[int], logprobs: Optional[int] = None,
                         prompt_logprobs: Optional[int] = None,
                         structured_outputs: Optional[StructuredOutputs] = None) -> SamplingParams:
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
        "structured_outputs": structured_outputs,
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
    per_choice: dict[int, int] = field(default_factory=dict)  # choice index -> its completion tokens so far

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], n: int) -> "UsageCounter":
        return cls(sum(len(p) for p in prompts), n)

    def add(self, choice: Choice, num_tokens: int, num_cached_tokens: int) -> None:
        self.completion_tokens += num_tokens
        self.per_choice[choice.index] = self.per_choice.get(choice.index, 0) + num_tokens
        if choice.index % self.n == 0:
            self.cached_tokens[choice.prompt_index] = num_cached_tokens

    def choice_usage(self, choice: Choice) -> Usage:
        """One choice's usage so far (a chunk's, under continuous_usage_stats): its prompt, its tokens."""
        prompt_tokens = len(choice.prompt_token_ids)
        completion_tokens = self.per_choice.get(choice.index, 0)
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))


PROMPT_CHARS_MARGIN = 4  # normalizers may fold characters: refuse only far beyond what could fit


def check_prompt_chars(state: "ServerState", num_chars: int, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose length in characters alone proves it cannot fit: no token
    covers more than the vocabulary's longest entry (times a margin for normalizers)."""
    per_token = state.tokenizer.max_token_chars
    if per_token is None:
        return
    limit = state.max_model_len * per_token * PROMPT_CHARS_MARGIN
    if num_chars > limit:
        raise APIError(400, f"The prompt has {num_chars} characters; this model's maximum context length is "
                            f"{state.max_model_len} tokens, which never hold more than {limit} characters. "
                            f"Shorten the prompt.", param=param, code=CONTEXT_LENGTH_EXCEEDED)


def check_queue_room(state: "ServerState", num_sequences: int, param: str) -> None:
    """Before any work: 400 for a request that could never be queued, 429 when the queue is full now."""
    state.admission.check_size(num_sequences, param)
    state.admission.precheck(num_sequences)


async def start_generation(state: "ServerState", choices: Sequence[Choice], priority: int,
                           arrival_time: float) -> tuple[list[RequestStream], RequestGuard]:
    """Take the choices' places in the queue (429 when full), then queue them in the engine. The guard
    returned holds the places and the deadline; release it once the streams are closed."""
    ticket = state.admission.admit([c.request_id for c in choices], [len(c.prompt_token_ids) for c in choices])
    if state.config.enable_log_requests:
        log_request(choices)
    timeout = state.config.request_timeout
    guard = RequestGuard(ticket, None if timeout is None else arrival_time + timeout, timeout or 0.0)
    try:
        streams = await start_choices(state.engine, choices, priority, arrival_time)
    except BaseException:
        ticket.release()
        raise
    return streams, guard


def log_request(choices: Sequence[Choice]) -> None:
    """One info line per request (--enable-log-requests): ids, token counts and sampling settings. Never its
    text: no prompt, no stop strings, no logit_bias keys."""
    params = choices[0].params
    prompts = {choice.prompt_index: len(choice.prompt_token_ids) for choice in choices}
    logger.info("request %s: %d choice(s), prompt tokens %s, max_tokens %s, temperature %g, top_p %g, top_k %s, "
                "seed %s, logprobs %s, %d stop string(s)", choices[0].request_id, len(choices),
                ",".join(map(str, prompts.values())), params.max_tokens, params.temperature, params.top_p,
                params.top_k, params.seed, params.logprobs, len(params.stop))


async def start_choices(engine: AsyncEngine, choices: Sequence[Choice], priority: int,
                        arrival_time: float) -> list[RequestStream]:
    """Queue every choice in the engine, all or none; their streams in the same order. A choice that can
    never be served refuses the whole request (a RequestRejectedError, a 400) before anything runs.
    `arrival_time` is when the route received the request."""
    inputs = [RequestInput(choice.request_id, choice.prompt_token_ids, choice.params) for choice in choices]
    return await engine.add_requests(inputs, priority=priority, arrival_time=arrival_time)


async def stream_choices(choices: Sequence[Choice], streams: Sequence[RequestStream], *,
                         guard: Optional[RequestGuard] = None) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Interleave the outputs of every choice as they come. Ending or closing this iterator closes every
    stream, which aborts the choices still running. With a `guard`, each choice's first output frees its
    place in the queue, and passing the deadline raises RequestTimeoutError (504)."""
    if len(choices) == 1:  # nothing to interleave: read the engine's stream directly
        items: AsyncIterator = _single(choices[0], streams[0])
    else:
        items = _interleave(choices, streams)
    try:
        async with contextlib.aclosing(items):
            while True:
                try:
                    choice, output = await _next(items, None if guard is None else guard.deadline)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    guard.timed_out(streams)
                    raise RequestTimeoutError(guard.timeout) from None
                if guard is not None:
                    guard.started(choice.request_id)
                if output.error is not None:
                    raise GenerationFailedError(output.error)
                yield choice, output
    finally:
        await close_streams(streams)
        if guard is not None:
            guard.release()


async def _next(items: AsyncIterator, deadline: Optional[float]):
    if deadline is None:
        return await items.__anext__()
    return await asyncio.wait_for(items.__anext__(), max(deadline - time.monotonic(), 0.0))


async def _single(choice: Choice, stream: RequestStream) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    async for output in stream:
        yield choice, output


class GenerationFailedError(APIError):
    """The engine failed this request alone (its sampling or its text); the other requests go on."""

    def __init__(self, reason: str):
        super().__init__(500, f"generating this completion failed: {reason}", code="generation_failed")


class ChoicesStreamingResponse(StreamingResponse):
    """An SSE response that owns its choices' engine streams: whenever the response ends (sent,
    failed, or never started because the client left before the headers went out) it closes them,
    aborting the choices still running. A plain StreamingResponse whose body generator never
    starts would leave them to run to max_tokens for nobody."""

    def __init__(self, content: AsyncIterator[bytes], streams: Sequence[RequestStream], guard: RequestGuard):
        super().__init__(content, media_type="text/event-stream")
        self._streams = streams
        self._guard = guard

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_streams(self._streams)  # never suspends: completes even when cancelled
            self._guard.release()


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


async def collect_choices(choices: Sequence[Choice], streams: Sequence[RequestStream],
                          guard: Optional[RequestGuard] = None) -> list[OutputAccumulator]:
    results = {choice.request_id: OutputAccumulator() for choice in choices}
    async for choice, output in stream_choices(choices, streams, guard=guard):
        results[choice.request_id].add(output)
    return list(results.values())


async def collect_or_cancel(request: Request, choices: Sequence[Choice], streams: Sequence[RequestStream],
                            guard: RequestGuard) -> list[OutputAccumulator]:
    """A non-streamed response's results: every choice collected (all aborted if the client leaves first),
    then the streams closed and the guard released, whatever happened."""
    try:
        return await cancel_on_disconnect(request, collect_choices(choices, streams, guard))
    finally:
        await close_streams(streams)
        guard.release()
