"""Server-sent events: `data: {json}\n\n` frames, errors inside a stream, `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Union

from pydantic import BaseModel

from server.errors import handle_error
from server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Union[BaseModel, dict]) -> bytes:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


async def with_error_events(events: AsyncIterator[bytes], metrics: ServerMetrics) -> AsyncIterator[bytes]:
    """Pass events through; an error after the stream started becomes an error event (the same envelope
    and failure count as the app's error handlers), then [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the client must learn the stream failed
        yield sse_event(handle_error(exc, metrics, "a stream").body())
    yield DONE
