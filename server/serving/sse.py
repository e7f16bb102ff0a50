"""Server-sent events, the two framings OpenAI uses, and the one place an error inside a stream is framed.

data       `data: {json}\n\n` chunks ending with `data: [DONE]` (completions, chat); an error after the
           stream began is one data chunk with the error envelope, then [DONE]
typed      `event: <type>\ndata: {json}\n\n` events, no [DONE] (responses); an error is one `error` event
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable, NamedTuple, Union

from pydantic import BaseModel

from server.http.errors import handle_error
from server.observability.metrics import ServerMetrics

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Union[BaseModel, dict]) -> bytes:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


def sse_typed(event: dict) -> bytes:
    """`event: <type>` and `data: {json}`, as OpenAI frames the Responses stream (no `[DONE]`)."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode("utf-8")


class Framing(NamedTuple):
    """How a stream frames an error envelope, and what it ends with."""

    error: Callable[[dict], bytes]
    end: bytes


DATA_FRAMING = Framing(sse_event, DONE)


async def with_error_events(
    events: AsyncIterator[bytes], framing: Framing, metrics: ServerMetrics, log_stack: bool = False
) -> AsyncIterator[bytes]:
    """Pass events through; an error after the stream started becomes one error frame (the same envelope and
    failure count as the app's error handlers), then the stream's end."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the client must learn the stream failed
        yield framing.error(handle_error(exc, metrics, "a stream", log_stack=log_stack).body())
    if framing.end:
        yield framing.end
