"""`use_beam_search` on the generation routes, as vLLM serves it: `n` is the beam width, each prompt's choices are
its best beams, best first (engine/sampling/beam_search.py runs the search; here its steps go through the AsyncEngine as
engine requests). A choice's stream gets one output, the whole beam, when the search ends: collected, or streamed
as one chunk per choice. Closing the streams (the response ended, the client left, the deadline passed) cancels
the search and aborts its step in flight.

Beam search reads only the raw logprobs of each step, so the sampling fields that shape a sampled token
(penalties, top-k/top-p/min-p, logit_bias, stops, output masks, logprobs, structured output) would do nothing: they
are 400s naming them, never ignored. It honours `n`, `max_tokens`, `temperature` (passed to the steps, as vLLM
does), `ignore_eos`, `length_penalty`, `include_stop_str_in_output`, `priority` and `cache_salt`.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from engine.async_engine import RequestInput
from engine.sampling.beam_search import BeamSearch, BeamSearchParams
from engine.lora.request import LoRAMix
from engine.outputs import RequestMetrics, RequestOutput
from engine.request_stream import RequestStream
from engine.sampling.params import SamplingParams
from scheduler import RequestRejectedError
from server.serving.choices import Choice

if TYPE_CHECKING:
    from server.state import ServerState

# SamplingParams fields beam search does not read, at the values that mean "not used"
_IGNORED = {
    "stop": [],
    "stop_token_ids": [],
    "min_tokens": 0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "top_p": 1.0,
    "top_k": None,
    "min_p": 0.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "structured_outputs": None,
}


class BeamSearchConflictError(RequestRejectedError):
    """A field that beam search would not read."""

    def __init__(self, field: str):
        super().__init__(
            f"{field} cannot be combined with use_beam_search (a beam search does not read it)", field=field
        )


def beam_search_params(params: SamplingParams, max_tokens: int, length_penalty: float) -> BeamSearchParams:
    """The search's parameters from the request's validated sampling parameters (made without the model's sampling
    defaults: a beam search takes none of them); a field it would not read is a BeamSearchConflictError."""
    for name, unused in _IGNORED.items():
        if getattr(params, name) != unused:
            raise BeamSearchConflictError(name)
    return BeamSearchParams(
        beam_width=params.n,
        max_tokens=max_tokens,
        ignore_eos=params.ignore_eos,
        temperature=params.temperature,
        length_penalty=length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


async def start_searches(
    state: "ServerState",
    choices: Sequence[Choice],
    params: BeamSearchParams,
    *,
    priority: int,
    arrival_time: float,
    lora: Optional[LoRAMix],
    cache_salt: Optional[str],
    on_running: Callable[[str], None],
) -> list[RequestStream]:
    """One search per prompt (its choices are its beams, in order), each a task; the choices' streams, in order,
    once every search's first step is in the engine. A search refused there (a RequestRejectedError: the prompt
    leaves no room, an unknown adapter) cancels them all and is raised, as a refused request is. `on_running`
    (a choice's request id) once its search's first step is done: it no longer waits in the queue, though its
    stream's one output comes only at the end."""
    by_prompt: dict[int, list[Choice]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice)
    streams: list[RequestStream] = []
    started: list[asyncio.Future] = []
    for beams in by_prompt.values():
        tasks: list[asyncio.Task] = []  # this search's, once made

        def cancel(_stream: RequestStream, _reason: Optional[str], tasks: list[asyncio.Task] = tasks) -> None:
            for task in tasks:
                task.cancel()  # (a finished task ignores it)

        own = [RequestStream(choice.request_id, f"{choice.request_id}#beams", cancel) for choice in beams]
        started.append(asyncio.get_running_loop().create_future())
        search = _search(state, beams, own, params, priority, arrival_time, lora, cache_salt, started[-1], on_running)
        tasks.append(asyncio.create_task(search))
        state.beam_searches.add(tasks[-1])  # (a graceful drain waits for it: between steps no request runs)
        tasks[-1].add_done_callback(state.beam_searches.discard)
        streams += own
    try:
        await asyncio.gather(*started)
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _search(
    state: "ServerState",
    beams: Sequence[Choice],
    streams: Sequence[RequestStream],
    params: BeamSearchParams,
    priority: int,
    arrival_time: float,
    lora: Optional[LoRAMix],
    cache_salt: Optional[str],
    started: asyncio.Future,
    on_running: Callable[[str], None],
) -> None:
    """`started` is settled once the first step is in the engine (or was refused)."""
    engine = state.engine
    prompt = beams[0].prompt_token_ids
    # (steps until the context ends, as far as the KV cache holds it: a later step would be refused; at least one:
    # a prompt that leaves no room is refused there, as any request is)
    room = max(engine.max_sequence_len - len(prompt), 1)
    search = BeamSearch(prompt, params, engine.tokenizer.eos_token_ids, room)
    first_token_time = None
    try:
        step = 0
        while not search.done:
            inputs = [
                RequestInput(f"{beams[0].request_id}-step{step}-beam{i}", tokens, search.step_params, lora, cache_salt)
                for i, tokens in enumerate(search.pending())
            ]
            try:
                step_streams = await engine.add_requests(inputs, priority=priority)
            except BaseException as exc:
                if not started.done():
                    started.set_exception(exc)
                raise
            if not started.done():
                started.set_result(None)
            reads = [asyncio.ensure_future(_next_tokens(s)) for s in step_streams]
            try:
                tops = await asyncio.gather(*reads)
            finally:  # (one beam's failure leaves the others' reads waiting on streams about to close)
                for read in reads:
                    read.cancel()
                for s in step_streams:
                    await s.aclose()
            search.advance(tops)
            if first_token_time is None:
                first_token_time = time.monotonic()
                for choice in beams:
                    on_running(choice.request_id)
            step += 1
        tokenizer = engine.tokenizer
        best = search.result(lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip))
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - handed to the choices' streams, which raise it
        if started.done() and started.exception() is exc:
            return  # (refused at the start: start_searches raises it)
        for stream in streams:
            stream.put(exc)
        return
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time, arrival_time, first_token_time, now, now)
    for i, stream in enumerate(streams):
        beam = best[min(i, len(best) - 1)]  # (fewer beams than n only where the vocabulary has fewer tokens)
        output = beam.tokens[len(prompt) :]
        text = beam.text or ""
        stream.put(
            RequestOutput(
                request_id=stream.request_id,
                new_token_ids=output,
                text_delta=text,
                text=text,
                finish_reason=beam.finish_reason,
                stop_reason=beam.stop_reason,
                num_prompt_tokens=len(prompt),
                num_output_tokens=len(output),
                num_cached_tokens=0,
                metrics=metrics,
            )
        )


async def _next_tokens(stream: RequestStream) -> list[tuple[int, float]]:
    """The best next tokens a one-token step request found, (token, raw logprob) best first."""
    top: list[tuple[int, float]] = []
    async for output in stream:
        if output.error is not None:
            raise RuntimeError(output.error)
        if output.logprobs:
            top = output.logprobs[0].top
    return top
