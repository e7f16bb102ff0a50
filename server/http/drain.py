"""Graceful drain: stop taking work, let in-flight requests finish, then stop the engine.

SIGTERM / SIGINT --> state.draining: /health 503, new generation requests 503 (the listener stays open,
                     so a load balancer reads the 503 and stops sending)
                 --> in-flight requests run on, up to `timeout` seconds (those still being rendered or having
                     their grammar compiled too: they are queued in the engine, then run)
                 --> the engine stops: what is left ends with an error event (503), then [DONE]
                 --> the HTTP server exits (status 0)
a second signal  --> the process exits at once (128 + the signal)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from server.state import ServerState

logger = logging.getLogger(__name__)

POLL_S = 0.05


async def drain(state: "ServerState", timeout: float) -> int:
    """Refuse new work, wait up to `timeout` s for in-flight requests (a beam search's between its steps too),
    then stop the engine (failing what is left). Returns how many engine requests and beam searches were still
    running when the time ran out."""
    state.draining = True
    engine = state.engine
    deadline = time.monotonic() + timeout
    while (engine.num_requests or state.preparing or state.beam_searches) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)  # (preparing: not queued yet; beam searches: between two steps)
    remaining = engine.num_requests + state.preparing + len(state.beam_searches)
    if remaining:
        logger.warning("shutdown timeout (%g s) reached: aborting %d request(s)", timeout, remaining)
    await engine.shutdown()
    return remaining


class GracefulShutdown:
    """The signal handler that replaces uvicorn's: the first SIGTERM/SIGINT drains, then asks the HTTP
    server to exit (`request_exit`); a second one exits the process at once."""

    def __init__(self, state: "ServerState", timeout: float, request_exit: Callable[[], None]):
        self.state = state
        self.timeout = timeout
        self.request_exit = request_exit
        self.signals: list[int] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._task: Optional[asyncio.Task] = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop to drain on (the server's, once it is ready)."""
        self._loop = loop

    def handle_signal(self, sig: int, frame=None) -> None:
        """Runs on the main thread (which runs the event loop) between two bytecodes."""
        self.signals.append(sig)
        if len(self.signals) > 1:
            logger.warning("second stop signal: exiting now")
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(128 + sig)
        self.state.draining = True
        if self._loop is None:  # not serving yet: nothing to drain
            self.request_exit()
            return
        logger.info("stop signal: draining (up to %g s for in-flight requests)", self.timeout)
        self._loop.call_soon_threadsafe(self._start)

    def _start(self) -> None:
        self._task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await drain(self.state, self.timeout)
        finally:
            self.request_exit()
