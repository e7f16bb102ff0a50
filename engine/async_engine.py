"""Runs an EngineCore on its own thread and serves asyncio callers, one output stream per request.

    event loop thread                       engine thread
    -----------------                       -------------
    add_requests() --add--> commands queue --> drain: EngineCore.add_request (validates)
         ^   ^                                 step()
         |   +-- verdict (admitted / refused) --+
         +------ outputs, call_soon_threadsafe -+

The model computes off the event loop, so HTTP stays responsive while it runs.
A request is validated once, where it is queued (EngineCore.add_request on the
engine thread); `add_requests` awaits that verdict, so a caller can refuse a
request before it answers anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, NamedTuple, Optional, Sequence, Union

import torch

from engine.attention.kv_cache import kv_cache_dtype_name
from engine.cpu_contention import ThreadGovernor
from engine.loading.model_config import ModelConfig
from engine.multimodal.inputs import MultiModalInputs
from engine.multimodal.processor import MultiModalProcessor
from engine.engine import EngineCore
from engine.errors import InvalidParameterError
from engine.lora.lora_manager import LoadedLoRA, LoRAManager, LoRAStats
from engine.lora.request import LoRAMix, LoRARequest
from engine.observer import EngineObserver
from engine.outputs import RequestOutput
from engine.request_stream import RequestStream
from engine.pooling.params import PoolingParams
from engine.pooling.pooler_config import ModelPooler
from engine.sampling.params import SamplingParams
from engine.structured.grammar_compiler import GrammarCompiler
from engine.text.tokenizer import Tokenizer
from scheduler import CacheConfig, DuplicateRequestIdError, RequestRejectedError, SchedulerStats

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an internal error or a shutdown); requests cannot be served."""


class RequestInput(NamedTuple):
    """One sequence to generate (or with PoolingParams, one prompt to pool): the caller's request id, the prompt's
    token ids, its parameters (n == 1)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: Union[SamplingParams, PoolingParams]
    lora: Optional[LoRAMix] = None  # the LoRA adapters it runs with (None: the base model)
    cache_salt: Optional[str] = None  # vLLM's: only requests with the same salt share cached blocks
    multi_modal: Optional[MultiModalInputs] = None  # the prompt's images (the model's processor made both)


@dataclass(slots=True)
class _Add:
    """Requests to queue together, all or none; `admitted` receives the verdict."""

    engine_ids: list[str]
    inputs: list[RequestInput]
    priority: int
    arrival_time: float
    admitted: asyncio.Future
    grammars: dict[tuple, "xgrammar.CompiledGrammar"]  # by constraint key: compiled before queuing


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]
    reason: str = "aborted"


@dataclass(slots=True)
class _Fail:
    """A part of the engine outside this process failed (a tensor-parallel worker): the loop fails with it."""

    error: BaseException


@dataclass(slots=True)
class _Wake:
    """Something for the loop to do that is not a request (an adapter load begun): wakes an idle loop."""


_Command = Union[_Add, _Abort, _Fail, _Wake, None]  # None stops the loop


class AsyncEngine:
    """Thread-safe front of an EngineCore for asyncio code (the HTTP server).

    Besides requests, it answers what a front end needs to know of the engine
    (model, context length, dtype, attention backend, tokenizer, KV cache, stats)
    through read-only properties, so callers never reach into the core.
    """

    def __init__(self, engine: EngineCore, governor: Optional[ThreadGovernor] = None):
        self.engine = engine
        self._governor = governor  # adapts the engine thread's CPU team between steps (None: fixed)
        self.observer = EngineObserver()  # tells nobody until `observe`
        self._commands: "queue.SimpleQueue[_Command]" = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # by engine request id
        self._live: dict[str, str] = {}  # caller's request id -> engine request id
        self._admissions: set[asyncio.Future] = set()  # verdicts not yet given
        self._serial = itertools.count()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self.engine.on_failure(lambda error: self._commands.put(_Fail(error)))  # wakes an idle loop
        self._thread.start()

    def observe(self, observer: EngineObserver) -> None:
        """Report the engine's events to `observer` from now on (one at a time: the server's metrics)."""
        self.observer = observer
        self.engine.observe(observer)

    async def shutdown(self) -> None:
        """Stop the engine thread (every request ends). The EngineCore stays as it is: whoever built it
        releases its memory (`EngineCore.shutdown()`), since another AsyncEngine may serve it next."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within 30 s")

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def _started_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that consumes outputs (set by `start`, before the engine thread runs)."""
        assert self._loop is not None, "the engine was not started"
        return self._loop

    @property
    def error(self) -> Optional[BaseException]:
        """What stopped the engine loop, when it failed (None while it runs and after a plain shutdown)."""
        return self._error

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished or closed, plus batches awaiting their verdict."""
        return len(self._streams) + len(self._admissions)

    # ------------------------------------------------------------------ what the engine serves

    @property
    def model_name(self) -> str:
        """The checkpoint (or the name it was built with) that the engine serves."""
        return self.engine.model_name

    @property
    def model_source(self) -> str:
        """The checkpoint as given: the embedded model's name, a path or a hub id (whatever name it is served
        under)."""
        return self.engine.model_source

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (its generation_config.json's), for requests that leave them unset."""
        return self.engine.default_sampling

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens at most, as resolved against the model."""
        return self.engine.max_model_len

    @property
    def max_sequence_len(self) -> int:
        """Prompt plus output tokens one sequence can reach: max_model_len, or fewer where the whole KV cache
        holds fewer."""
        return self.engine.max_sequence_len

    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts are 0..vocab_size - 1."""
        return self.engine.vocab_size

    @property
    def dtype(self) -> str:
        """The weights' and activations' dtype, e.g. "bfloat16"."""
        return str(self.engine.model_dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype(self) -> str:
        """The dtype the KV cache stores as `--kv-cache-dtype` names it (auto is the model's), e.g. "bfloat16",
        "fp8" (vLLM's cache_config_info label says the same)."""
        return kv_cache_dtype_name(self.engine.runner.kv_cache.spec.dtype)

    @property
    def quantization(self) -> str:
        """The weights' storage: "none", "gguf", "int8", "int4", "awq" or "gptq"."""
        return self.engine.quantization

    @property
    def weight_bytes(self) -> int:
        """Memory the model's weights take."""
        return self.engine.weight_bytes

    @property
    def device(self) -> torch.device:
        """Where the model runs: `cpu`, or `cuda` / `cuda:N` (no index: the current CUDA device)."""
        return self.engine.runner.device

    @property
    def attention_backend(self) -> str:
        """The attention backend in use: "cpu", "torch", "flash" or "triton"."""
        return self.engine.runner.backend.name

    @property
    def cuda_graphs(self) -> str:
        """What runs as CUDA graphs: "off", or the decode batch sizes captured."""
        return self.engine.runner.cuda_graphs

    @property
    def pooler(self) -> Optional[ModelPooler]:
        """A pooling model's pooler (it serves embeddings, and generates nothing); None for a generative model."""
        return self.engine.pooler

    @property
    def media_path(self) -> Optional[Path]:
        """The folder whose files requests may name as images (--allowed-local-media-path); None: none."""
        return self.engine.config.model.media_path

    @property
    def processor(self) -> Optional[MultiModalProcessor]:
        """A vision-language model's processor (prompts with images: thread-safe, for the server's worker threads);
        None for a text model, or one served without images."""
        return self.engine.processor

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints (thread-safe, cached); `add_requests` compiles a request's
        off the event loop and the engine thread."""
        return self.engine.grammar_compiler

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def scheduling_policy(self) -> str:
        """The order of admission: "fcfs", or "priority" (requests may then carry a priority)."""
        return self.engine.scheduler.scheduler_config.policy

    @property
    def max_num_seqs(self) -> int:
        """Requests in the running batch at most."""
        return self.engine.scheduler.scheduler_config.max_num_seqs

    @property
    def kv_cache_config(self) -> CacheConfig:
        """The KV pool's layout, with `num_blocks` resolved (treat as read-only)."""
        return self.engine.scheduler.cache_config

    def stats(self) -> SchedulerStats:
        """Queue lengths, KV usage, preemptions and prefix-cache counters, now."""
        return self.engine.stats()

    # ------------------------------------------------------------------ requests

    async def add_requests(
        self, inputs: Sequence[RequestInput], *, priority: int = 0, arrival_time: Optional[float] = None
    ) -> list[RequestStream]:
        """Queue sequences together and return their output streams once the engine admitted all of them.

        Raises (queuing none of them) a RequestRejectedError for the first one that can never be
        served, or EngineDeadError. `arrival_time` (time.monotonic) is when the caller received the
        request, so queue time and time to first token include what it did before; default now.
        Close every stream returned (`aclose`), which aborts a request still running.
        """
        self._check_can_add(inputs)
        grammars = await self._compile_grammars(inputs)
        self._check_can_add(inputs)  # again: the engine may have stopped, or the ids been taken, meanwhile
        streams = [
            RequestStream(item.request_id, f"{item.request_id}#{next(self._serial)}", self._close) for item in inputs
        ]
        for stream in streams:
            self._streams[stream.engine_id] = stream
            self._live[stream.request_id] = stream.engine_id
        admitted = self._started_loop.create_future()
        self._admissions.add(admitted)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(_Add([s.engine_id for s in streams], list(inputs), priority, arrival, admitted, grammars))
        try:
            await admitted
        except asyncio.CancelledError:  # the caller went away: the requests may be in by now
            self._commands.put(_Abort([s.engine_id for s in streams]))
            for stream in streams:
                self._forget(stream)
            raise
        except BaseException:
            for stream in streams:
                self._forget(stream)
            raise
        finally:
            self._admissions.discard(admitted)
        return streams

    def _check_can_add(self, inputs: Sequence[RequestInput]) -> None:
        if not self.is_alive or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self._error or 'stopped'}")
        seen: set[str] = set()
        for item in inputs:
            if item.request_id in self._live or item.request_id in seen:
                raise DuplicateRequestIdError(item.request_id)
            seen.add(item.request_id)

    async def _compile_grammars(self, inputs: Sequence[RequestInput]) -> dict[tuple, "xgrammar.CompiledGrammar"]:
        """Compile the inputs' output grammars on a worker thread before they are queued, by constraint key: a
        slow schema never stalls the engine's batch. They travel with the requests (the compiler's cache may
        drop them before the engine thread makes the requests, with many distinct grammars in flight).
        An uncompilable one is an InvalidParameterError (a RequestRejectedError) naming structured_outputs."""
        constraints = {
            item.params.structured_outputs.key: item.params.structured_outputs
            for item in inputs
            if isinstance(item.params, SamplingParams) and item.params.structured_outputs is not None
        }
        compile_ = self.engine.grammar_compiler.compile
        return {key: await asyncio.to_thread(compile_, constraint) for key, constraint in constraints.items()}

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: Union[SamplingParams, PoolingParams],
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
        lora: Optional[LoRAMix] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes (one `add_requests` stream; with PoolingParams one
        output, its embedding). Closing the
        iterator (a client that went away) aborts the request in the engine at once."""
        (stream,) = await self.add_requests(
            [RequestInput(request_id, prompt_token_ids, params, lora)], priority=priority, arrival_time=arrival_time
        )
        async with contextlib.aclosing(stream):
            async for output in stream:
                yield output

    # ------------------------------------------------------------------ LoRA adapters

    @property
    def lora_manager(self) -> Optional[LoRAManager]:
        """The engine's adapters (None unless LoRA is enabled); its methods are thread-safe."""
        return self.engine.lora_manager

    def _lora(self) -> LoRAManager:
        if self.engine.lora_manager is None:
            raise InvalidParameterError("lora", "needs an engine started with LoRA enabled (--enable-lora)")
        return self.engine.lora_manager

    async def add_lora(self, request: LoRARequest) -> LoadedLoRA:
        """Load and register an adapter: the engine thread reads it in slices between its steps (the step loop
        goes on meanwhile; see LoRAManager.advance_loads), or this call's worker thread when the loop does not
        run. Raises LoRAAdapterError / LoRARankError (400) for a directory that cannot be served."""
        manager = self._lora()
        if not self.is_alive:
            return await asyncio.to_thread(manager.add_lora, request)
        future = manager.begin_load(request)
        self._commands.put(_Wake())
        return await asyncio.wrap_future(future)

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter (later requests naming it are refused; running ones finish); False if unknown."""
        return self._lora().remove_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.engine.lora_manager is None else self.engine.lora_manager.list_loras()

    def lora_stats(self) -> Optional[LoRAStats]:
        """The adapters of running and waiting requests (the lora_requests_info gauge); None without LoRA."""
        return None if self.engine.lora_manager is None else self.engine.lora_manager.stats()

    # ------------------------------------------------------------------ aborts

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by the ids given to `add_requests`."""
        engine_ids = [self._live[r] for r in request_ids if r in self._live]
        self._commands.put(_Abort(engine_ids))

    def _close(self, stream: RequestStream, abort_reason: Optional[str]) -> None:
        self._forget(stream)
        if abort_reason is not None:
            self._commands.put(_Abort([stream.engine_id], abort_reason))

    def _forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.engine_id, None)
        if self._live.get(stream.request_id) == stream.engine_id:
            del self._live[stream.request_id]

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain(block=not engine.has_work):
                    return
                if engine.has_work:
                    self._publish(engine.step())
                    if engine.last_step_num_tokens:
                        self.observer.on_step(engine.last_step_num_tokens)
                    if self._governor is not None:
                        self._governor.after_step()
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the waiting clients
            logger.exception("engine loop failed")
            self._error = exc
            self._fail_all(EngineDeadError(f"the engine loop failed: {exc!r}"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; waits for one when idle. False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is None:
                self.engine.abort(self.engine.unfinished_request_ids())
                self._fail_all(EngineDeadError("the engine is shutting down"))
                return False
            if isinstance(command, _Fail):
                raise command.error
            if isinstance(command, _Wake):
                continue
            if isinstance(command, _Abort):
                self._publish(self.engine.abort(command.request_ids, command.reason))
                continue
            self._add(command)

    def _add(self, command: _Add) -> None:
        """Queue a batch, all or none, and send the verdict back to `add_requests`."""
        added: list[str] = []
        try:
            for engine_id, item in zip(command.engine_ids, command.inputs):
                constraint = item.params.structured_outputs if isinstance(item.params, SamplingParams) else None
                self.engine.add_request(
                    engine_id,
                    item.prompt_token_ids,
                    item.params,
                    arrival_time=command.arrival_time,
                    priority=command.priority,
                    grammar=None if constraint is None else command.grammars[constraint.key],
                    lora=item.lora,
                    cache_salt=item.cache_salt,
                    multi_modal=item.multi_modal,
                )
                added.append(engine_id)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone, never the loop
            if not isinstance(exc, RequestRejectedError):
                logger.exception("could not add request %s", command.engine_ids[len(added)])
            self.engine.abort(added)  # their abort outputs are nobody's: the caller never had them
            self._started_loop.call_soon_threadsafe(_settle, command.admitted, exc)
            return
        self._started_loop.call_soon_threadsafe(_settle, command.admitted, None)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._started_loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        on_output = self.observer.on_output
        for output in outputs:
            on_output(output)
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
                if output.finished:  # the id is free again, even if the caller never reads this output
                    self._forget(stream)

    def _fail_all(self, error: BaseException) -> None:
        def fail() -> None:
            for stream in self._streams.values():
                stream.put(error)
            for admitted in self._admissions:
                _settle(admitted, error)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail)


def _settle(admitted: asyncio.Future, error: Optional[BaseException]) -> None:
    """On the event loop: give an admission its verdict, unless its caller already left."""
    if admitted.done():
        return
    if error is None:
        admitted.set_result(None)
    else:
        admitted.set_exception(error)
