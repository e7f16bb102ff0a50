"""Runs an EngineCore on its own thread and serves asyncio callers, one output stream per request.

    event loop thread                    engine thread
    -----------------                    -------------
    generate() --add--> commands queue --> drain, add/abort
        ^                                  step()
        |  call_soon_threadsafe(outputs)   |
        +----------------------------------+

The model computes off the event loop, so HTTP stays responsive while it runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Sequence, Union

from engine.engine import EngineCore
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from scheduler import RequestRejectedError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an internal error or a shutdown); requests cannot be served."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


@dataclass(slots=True)
class _Abort:
    request_ids: list[str]


_Command = Union[_Add, _Abort, None]  # None stops the loop


class AsyncEngine:
    """Thread-safe front of an EngineCore for asyncio code (the HTTP server)."""

    def __init__(self, engine: EngineCore, on_step: Optional[Callable[[int], None]] = None,
                 on_output: Optional[Callable[[RequestOutput], None]] = None):
        self.engine = engine
        self.on_step = on_step  # called on the engine thread with each step's token count
        self.on_output = on_output  # called on the event loop for every output, abort outputs included
        self._commands: "queue.SimpleQueue[_Command]" = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # by engine request id
        self._live: dict[str, str] = {}  # caller's request id -> engine request id
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
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    @property
    def error(self) -> Optional[BaseException]:
        return self._error

    # ------------------------------------------------------------------ requests

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRejectedError now for a request that can never be served."""
        _check_one_sequence(params)
        request = self.engine.make_request("check", prompt_token_ids, params)
        self.engine.scheduler.check_request(request)

    def request_id_in_use(self, request_id: str) -> bool:
        return request_id in self._live

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: Optional[float] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Closing the iterator (a client
        that went away) aborts the request in the engine at once."""
        if not self.is_alive or self._stopping:
            raise EngineDeadError(f"the engine is not running: {self._error or 'stopped'}")
        _check_one_sequence(params)
        # Validated once, by EngineCore.add_request on the engine thread; a refusal is this stream's error.
        # (Callers that must refuse before answering, like the server, call check_request first.)
        if request_id in self._live:
            raise RequestRejectedError(f"request id {request_id!r} is already in use", param="request_id")
        # A unique engine id per call: a reused id never receives a late output of its predecessor.
        engine_id = f"{request_id}#{next(self._serial)}"
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[engine_id] = stream
        self._live[request_id] = engine_id
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(_Add(engine_id, list(prompt_token_ids), params, priority, arrival))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(engine_id, None)
            self._live.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort([engine_id]))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by the ids given to `generate`."""
        engine_ids = [self._live[r] for r in request_ids if r in self._live]
        self._commands.put(_Abort(engine_ids))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished_requests
                if not self._drain(block):
                    return
                if engine.has_unfinished_requests:
                    self._publish(engine.step())
                    if self.on_step is not None and engine.last_step_num_tokens:
                        self.on_step(engine.last_step_num_tokens)
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
            if isinstance(command, _Abort):
                self._publish(self.engine.abort(command.request_ids))
                continue
            try:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                        arrival_time=command.arrival_time, priority=command.priority)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone, never the loop
                if not isinstance(exc, RequestRejectedError):
                    logger.exception("could not add request %s", command.request_id)
                self._deliver(command.request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _deliver(self, request_id: str, item) -> None:
        self._loop.call_soon_threadsafe(self._dispatch_one, request_id, item)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        streams = self._streams
        on_output = self.on_output
        for output in outputs:
            if on_output is not None:
                on_output(output)
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _dispatch_one(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(item)

    def _fail_all(self, error: BaseException) -> None:
        def fail() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fail)


def _check_one_sequence(params: SamplingParams) -> None:
    if params.n != 1:
        raise RequestRejectedError("one sequence per request: fan n > 1 out with parallel_sampling.fan_out",
                                   param="n")
