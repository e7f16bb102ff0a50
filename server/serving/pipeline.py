"""The one serving pipeline every generation route goes through (and, by `start_pooling`, every pooling route:
embeddings, classify, score, rerank).

A route translates its protocol into a GenerationRequest, hands it to `start_generation`, and writes the
Generation it gets back in its protocol: collected into one response, or as a stream of events. Between the
two, in this order and only here:

    check       the server takes requests, the model (or LoRA adapter, or mix of adapters: serving/lora_adapters.py)
                is served, no refused or unknown field
                (serving/checks.py, the refused fields' table in serving/unsupported.py)
    constrain   at most one source of an output grammar (response_format, structured_outputs, tools)
    room        the request fits the queue (400 if never, 429 if not now), before any tokenizing
    render      the prompt's token ids (and a vision-language model's images: fetched, serving/media.py, and processed
                with the text), off the event loop (serving/prompts.py)
    admit       sampling parameters, one engine request per choice (prompts x n), places in the queue,
                queued in the engine all or none; a refusal is a 400 naming the route's own field
    answer      the choices' outputs interleaved under the request's deadline; the streams closed, aborting
                what still runs, however the response ends (serving/streams.py); an error inside a stream
                framed once (serving/sse.py)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Mapping, Optional, Sequence

from fastapi import Request
from pydantic import BaseModel

from engine.async_engine import RequestInput
from engine.sampling.beam_search import BeamSearchParams
from engine.errors import LoRANotFoundError
from engine.lora.request import LoRAMix
from engine.outputs import OutputAccumulator, RequestOutput
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams
from engine.request_stream import RequestStream
from engine.structured import StructuredOutputs
from scheduler import RequestRejectedError
from server.http.errors import bad_request, rejection_error
from server.openai.protocol import SamplingFields
from server.serving.beam_search import beam_search_params, start_searches
from server.serving.checks import (
    check_extra_fields,
    check_fields,
    check_priority,
    check_queue_room,
    check_server_and_model,
)
from server.serving.choices import Choice, plan_choices
from server.serving.constraints import constraint_from_extras
from server.serving.lora_adapters import adapter_not_found
from server.serving.prompts import Prompt
from server.serving.request_guard import RequestGuard
from server.serving.sampling_params import make_sampling_params
from server.serving.sse import DATA_FRAMING, Framing, with_error_events
from server.serving.streams import ChoicesStreamingResponse, collect_or_cancel, stream_choices
from server.serving.unsupported import Unsupported, refuse_unsupported

if TYPE_CHECKING:
    from server.state import ServerState

logger = logging.getLogger(__name__)

Constraint = tuple[StructuredOutputs, str]  # the grammar and the request field it came from


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One generation request, whatever route it came by, in the pipeline's terms."""

    body: SamplingFields  # the sampling fields every route shares
    request_id: str
    prompt: Prompt
    max_tokens: Optional[int]
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    unsupported: Mapping[str, Unsupported] = field(default_factory=dict)  # the route's refused fields
    # The route's sources of an output grammar, (source as the route names it, constraint): its format field
    # first, then its tools; the vLLM extras (structured_outputs, guided_*) go between, on every route.
    constraints: Sequence[tuple[str, Optional[Constraint]]] = ()
    field_names: Mapping[str, str] = field(default_factory=dict)  # engine field -> the route's name for it


@dataclass(frozen=True, kw_only=True)
class PoolingRequest:
    """One pooling (embeddings) request in the pipeline's terms: each of its prompts is one engine request,
    answered by one choice."""

    body: BaseModel  # the route's request (its unknown fields: logged, or refused under --strict-params)
    model: Optional[str]
    request_id: str
    prompt: Prompt
    params: PoolingParams
    priority: int = 0
    cache_salt: Optional[str] = None
    field_names: Mapping[str, str] = field(default_factory=dict)  # engine field -> the route's name for it
    api: str = "Embeddings API"  # what the refusal of a model that does none of `tasks` says it does not serve
    tasks: tuple[str, ...] = ("embed",)  # what a pooling model must do to serve it: "embed", "classify"


@dataclass(slots=True)
class Generation:
    """An admitted request: its choices, their engine streams, and its places in the queue and deadline.
    Either `collect` it or `stream` it; both close the streams and release the guard however they end."""

    state: "ServerState"
    model: str
    request_id: str
    prompts: list[list[int]]
    choices: list[Choice]
    streams: list[RequestStream]
    guard: RequestGuard

    @property
    def num_prompt_tokens(self) -> int:
        """Its prompts' tokens, each counted once (a pooling response's usage)."""
        return sum(len(prompt) for prompt in self.prompts)

    def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come (for a streamed response's events)."""
        return stream_choices(self.choices, self.streams, guard=self.guard, interval=self.state.config.stream_interval)

    async def collect(self, request: Request) -> list[OutputAccumulator]:
        """Every choice's whole output, in the choices' order (all aborted if the client leaves first)."""
        return await collect_or_cancel(request, self.choices, self.streams, self.guard)

    def stream(self, events: AsyncIterator[bytes], framing: Framing = DATA_FRAMING) -> ChoicesStreamingResponse:
        """The SSE response sending `events`; an error after it began is one error frame."""
        return ChoicesStreamingResponse(
            with_error_events(events, framing, self.state.metrics, self.state.config.log_error_stack),
            self.streams,
            self.guard,
        )


async def start_generation(state: "ServerState", request: GenerationRequest, arrival_time: float) -> Generation:
    """Check, constrain, render and admit `request`; `arrival_time` (time.monotonic) is when the route received it,
    so queue time and time to first token include rendering and tokenizing."""
    state.preparing += 1  # with the draining check below, in one step of the event loop: a drain waits for it
    try:
        return await _prepare_and_admit(state, request, arrival_time)
    finally:
        state.preparing -= 1  # admitted (the engine counts it now) or refused


async def start_pooling(state: "ServerState", request: PoolingRequest, arrival_time: float) -> Generation:
    """Check, render and admit a pooling request: its Generation's outputs carry the pooled vectors (embeddings,
    class scores). A model that does none of the request's tasks refuses it (400)."""
    state.preparing += 1  # (as start_generation's)
    try:
        return await _prepare_and_admit_pooling(state, request, arrival_time)
    finally:
        state.preparing -= 1


async def _prepare_and_admit_pooling(state: "ServerState", request: PoolingRequest, arrival_time: float) -> Generation:
    model, lora = check_server_and_model(state, request.model)
    pooler = state.engine.pooler
    if pooler is None or pooler.task not in request.tasks:
        does = "served for generation" if pooler is None else f"a pooling model that does {pooler.task}"
        raise bad_request(
            f"The model {model!r} does not support the {request.api}: it is {does} "
            f"(this API needs one that does {' or '.join(request.tasks)}; --runner pooling, --convert).",
            param="model",
        )
    check_extra_fields(request.body, state.config.strict_params, known=frozenset())
    check_priority(state, request.priority)
    check_queue_room(state, request.prompt.count, request.prompt.param)
    rendered = await request.prompt.render(state)
    if any(images is not None for images in rendered.multi_modal):
        raise bad_request("a pooling request takes no images.", param=request.prompt.param)
    prompts = rendered.token_ids
    choices = [
        Choice(i, request.request_id if len(prompts) == 1 else f"{request.request_id}-{i}", i, prompt, request.params)
        for i, prompt in enumerate(prompts)
    ]
    try:
        streams, guard = await _admit(state, choices, request.priority, arrival_time, lora, request.cache_salt)
    except LoRANotFoundError as exc:
        raise adapter_not_found(exc, "model") from None
    except RequestRejectedError as exc:
        raise rejection_error(exc, request.field_names) from None
    return Generation(state, model, request.request_id, prompts, choices, streams, guard)


async def _prepare_and_admit(state: "ServerState", request: GenerationRequest, arrival_time: float) -> Generation:
    body = request.body
    model, lora = check_server_and_model(state, body.model, body.lora)
    if state.engine.pooler is not None:
        raise bad_request(
            f"The model {model!r} is served for pooling: it generates no text; use /v1/embeddings (an embedding "
            "model), /classify (a classifier), /score or /rerank.",
            param="model",
        )
    refuse_unsupported(body, request.unsupported)
    check_fields(body, state)
    extras = ("structured_outputs / guided_*", constraint_from_extras(body))
    constraint = _one_constraint([*request.constraints[:1], extras, *request.constraints[1:]])
    check_queue_room(
        state, request.prompt.count * max(body.n, 1), request.prompt.param if request.prompt.count > 1 else "n"
    )
    rendered = await request.prompt.render(state)
    prompts = rendered.token_ids
    if body.use_beam_search and any(images is not None for images in rendered.multi_modal):
        raise bad_request("use_beam_search takes no images.", param="use_beam_search")
    names = {"beam_width": "n", **request.field_names}
    if constraint is not None:
        names["structured_outputs"] = constraint[1]
    if body.length_penalty != 1.0 and not body.use_beam_search:
        raise bad_request("length_penalty applies to use_beam_search only.", param="length_penalty")
    try:
        params = make_sampling_params(
            body,
            max_tokens=request.max_tokens,
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
            structured_outputs=None if constraint is None else constraint[0],
            # (a beam search takes none of the model's sampling defaults: it reads raw logprobs)
            defaults=None if body.use_beam_search else state.engine.default_sampling,
        )
        choices = plan_choices(request.request_id, prompts, params, rendered.multi_modal)
        if body.use_beam_search:
            max_tokens = request.max_tokens or state.engine.max_model_len  # (BeamSearch stops where the context does)
            beams = beam_search_params(params, max_tokens, body.length_penalty)
            streams, guard = await _admit(
                state, choices, body.priority, arrival_time, lora, body.cache_salt, beam_search=beams
            )
        else:
            streams, guard = await _admit(state, choices, body.priority, arrival_time, lora, body.cache_salt)
    except LoRANotFoundError as exc:  # unloaded since the check above
        raise adapter_not_found(exc, "model" if body.lora is None else "lora") from None
    except RequestRejectedError as exc:  # named as the route spells its fields
        raise rejection_error(exc, names) from None
    return Generation(state, model, request.request_id, prompts, choices, streams, guard)


def _one_constraint(found: Sequence[tuple[str, Optional[Constraint]]]) -> Optional[Constraint]:
    present = [(source, constraint) for source, constraint in found if constraint is not None]
    if len(present) > 1:
        sources = [source for source, _ in present]  # the ones this request set
        raise bad_request(
            f"{', '.join(sources[:-1])} and {sources[-1]} each constrain the output; use one.", param=present[1][1][1]
        )
    return present[0][1] if present else None


async def _admit(
    state: "ServerState",
    choices: Sequence[Choice],
    priority: int,
    arrival_time: float,
    lora: Optional[LoRAMix],
    cache_salt: Optional[str],
    beam_search: Optional[BeamSearchParams] = None,
) -> tuple[list[RequestStream], RequestGuard]:
    """Take the choices' places in the queue (429 when full), then queue them in the engine, all or none,
    with their LoRA adapters (None: the base model); with `beam_search`, start each prompt's search instead (its
    steps queue in the engine as they come, serving/beam_search.py). The guard returned holds the places and the
    deadline."""
    ticket = state.admission.admit([c.request_id for c in choices], [len(c.prompt_token_ids) for c in choices])
    if state.config.enable_log_requests:
        _log_request(choices)
    timeout = state.config.request_timeout
    guard = RequestGuard(ticket, None if timeout is None else arrival_time + timeout, timeout or 0.0)
    if beam_search is not None:
        try:
            searches = await start_searches(
                state,
                choices,
                beam_search,
                priority=priority,
                arrival_time=arrival_time,
                lora=lora,
                cache_salt=cache_salt,
                on_running=guard.started,
            )
        except BaseException:
            ticket.release()
            raise
        return searches, guard
    inputs = [
        RequestInput(choice.request_id, choice.prompt_token_ids, choice.params, lora, cache_salt, choice.multi_modal)
        for choice in choices
    ]
    try:
        streams = await state.engine.add_requests(inputs, priority=priority, arrival_time=arrival_time)
    except BaseException:
        ticket.release()
        raise
    return streams, guard


def _log_request(choices: Sequence[Choice]) -> None:
    """One info line per request (--enable-log-requests): ids, token counts and sampling settings. Never its
    text: no prompt, no stop strings, no logit_bias keys."""
    if not isinstance(choices[0].params, SamplingParams):  # a pooling request's: its inputs and their lengths
        logger.info(
            "request %s: %d pooled input(s), prompt tokens %s",
            choices[0].request_id,
            len(choices),
            ",".join(str(len(choice.prompt_token_ids)) for choice in choices),
        )
        return
    params = choices[0].sampling
    prompts = {choice.prompt_index: len(choice.prompt_token_ids) for choice in choices}
    logger.info(
        "request %s: %d choice(s), prompt tokens %s, max_tokens %s, temperature %g, top_p %g, top_k %s, "
        "seed %s, logprobs %s, %d stop string(s)",
        choices[0].request_id,
        len(choices),
        ",".join(map(str, prompts.values())),
        params.max_tokens,
        params.temperature,
        params.top_p,
        params.top_k,
        params.seed,
        params.logprobs,
        len(params.stop),
    )
