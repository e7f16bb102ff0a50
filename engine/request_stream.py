"""One admitted request's outputs, as an async iterator on the event loop."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional, Union

from engine.outputs import RequestOutput


class RequestStream:
    """The outputs of one request that `AsyncEngine.add_requests` admitted.

    Iteration ends after the output that finishes the request; an error the
    engine delivers (it died or shut down) is raised. `aclose()` before the end
    aborts the request in the engine; after the end it only lets go.
    """

    def __init__(self, request_id: str, engine_id: str, on_close: Callable[["RequestStream", Optional[str]], None]):
        self.request_id = request_id  # the caller's id
        self.engine_id = engine_id  # unique per admission: a reused id never sees its predecessor's outputs
        self._on_close = on_close  # (stream, abort reason or None: nothing to abort) -> None, from the AsyncEngine
        self._queue: "asyncio.Queue[Union[RequestOutput, BaseException]]" = asyncio.Queue()
        self._ended = False
        self._closed = False

    @property
    def ended(self) -> bool:
        """The finishing output or an error was read: nothing is left running in the engine."""
        return self._ended

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        """Called on the event loop by the AsyncEngine with each output, or the error that ends it."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        if item.finished:
            self._ended = True
        return item

    async def aclose(self) -> None:
        """Stop listening; a request still in the engine is aborted at once."""
        self.close()

    def close(self, reason: str = "aborted") -> None:
        """`aclose()`, saying why a request still running is aborted (its last output's abort_reason); the
        first close decides."""
        if not self._closed:
            self._closed = True
            self._on_close(self, None if self._ended else reason)
