"""Server-sent events: `data: {json}\n\n` frames, errors inside a stream, `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Union

from pydantic import BaseModel

from engine.async_engine import EngineDeadError
from scheduler import RequestRejectedError
from server.errors import APIError, error_body

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Union[BaseModel, dict]) -> bytes:
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=False)
    else:
        text = json.dumps(payload, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


async def with_error_events(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Pass events through; an error after the stream started becomes an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except APIError as exc:
        yield sse_event(exc.body())
    except RequestRejectedError as exc:
        yield sse_event(error_body(400, exc.message, param=exc.param, code=exc.code))
    except EngineDeadError as exc:
        yield sse_event(error_body(503, str(exc)))
    except Exception as exc:  # noqa: BLE001 - the client must learn the stream failed
        logger.exception("stream failed")
        yield sse_event(error_body(500, f"internal error: {type(exc).__name__}"))
    yield DONE
