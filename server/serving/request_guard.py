"""What the server holds for one generation request besides its engine streams: its places in the
admission queue (given back on the first output or at the end) and its deadline (--request-timeout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from engine.request_stream import RequestStream
from server.serving.admission import Ticket
from server.http.errors import APIError


class RequestTimeoutError(APIError):
    """A request still waiting or running at --request-timeout: aborted, its client told with a 504."""

    def __init__(self, timeout: float):
        super().__init__(
            504,
            f"the request did not finish within {timeout:g} s (--request-timeout); it was aborted.",
            code="request_timeout",
        )


@dataclass(slots=True)
class RequestGuard:
    """What the server holds for one generation request: its places in the queue and its deadline."""

    ticket: Optional[Ticket]
    deadline: Optional[float]  # time.monotonic
    timeout: float = 0.0

    def started(self, request_id: str) -> None:
        if self.ticket is not None:
            self.ticket.started(request_id)

    def release(self) -> None:
        if self.ticket is not None:
            self.ticket.release()

    def timed_out(self, streams: Sequence[RequestStream]) -> None:
        """Abort what still runs, for its deadline (its last output's abort_reason says "timeout")."""
        for stream in streams:
            stream.close("timeout")
