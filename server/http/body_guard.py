"""The request body guard: size (413), content type (415), UTF-8 and a JSON object (400), before the route.

    client --body--> BodyGuard: Content-Length > limit? -> 413 (the body is read and dropped)
                                 chunks add up past the limit? -> 413 (chunked uploads too)
                                 Content-Type not JSON? -> 415
                                 not UTF-8 / not JSON / nested too deep / a number too long / not an object? -> 400
                                 a string with a lone UTF-16 surrogate (a "\ud800" escape)? -> 400
                     --the same bytes, replayed--> the app (FastAPI parses them again)

A pure ASGI middleware: it sees the raw byte stream, so a 20 MB body costs a
read, never a parse. Only methods with a body (POST, PUT, PATCH) are checked, the
JSON checks only on the routes that read a JSON body.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Callable, Collection, Optional, Union

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.auth_metrics import route_path
from server.http.errors import error_body

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_PARSE_OFF_LOOP = 256 * 1024  # bodies above this are decoded and parsed on a worker thread
_DRAIN_FACTOR = 16  # an over-limit body is read and dropped up to this many limits, then the connection closes
# valid UTF-8 encodes no surrogate: the body text has one only as such an escape (a pair of them is one character)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class BodyRefused(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class BodyGuard:
    """Refuse bodies over `max_bytes` and bodies that are not one JSON object; `on_refusal(status)` counts them."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        json_paths: Collection[str] = (),
        on_refusal: Optional[Callable[[int], None]] = None,
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.json_paths = frozenset(json_paths)  # routes whose body must be one JSON object
        self.on_refusal = on_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client went away while sending
            if route_path(scope) in self.json_paths:
                await _check_json_object(body, Headers(scope=scope))
        except BodyRefused as refusal:
            if self.on_refusal is not None:
                self.on_refusal(refusal.status)
            await _send_error(send, refusal)
            return
        if b"content-type" not in dict(scope["headers"]):  # curl without -H: read as JSON all the same
            # in place, not a copy: the router marks the route it matched on this scope, and the metrics
            # middleware outside reads it there (a copy counted every such request as route "unmatched")
            scope["headers"] = [*scope["headers"], (b"content-type", b"application/json")]
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> Optional[bytes]:
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise BodyRefused(400, "the Content-Length header is not a number.")
            if int(declared) > self.max_bytes:
                await _drop_body(receive, self.max_bytes * _DRAIN_FACTOR)
                raise _too_large(int(declared), self.max_bytes)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drop_body(receive, self.max_bytes * (_DRAIN_FACTOR - 1))
                raise _too_large(None, self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(size: Optional[int], limit: int) -> BodyRefused:
    """`size`: the declared Content-Length; None for a chunked upload, whose size is known only past the limit."""
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return BodyRefused(
        413,
        f"the request body is {what}; this server accepts at most {limit} bytes (--max-request-body).",
        code="request_too_large",
    )


async def _drop_body(receive: Receive, budget: int) -> None:
    """Read what is left of the body and drop it, so the client reads the 413 rather than a reset."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request":
            return
        budget -= len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _check_json_object(body: bytes, headers: Headers) -> None:
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type and media_type != "application/json" and not media_type.endswith("+json"):
        raise BodyRefused(
            415, f"the Content-Type header is {media_type!r}; send application/json.", code="unsupported_media_type"
        )
    if len(body) > _PARSE_OFF_LOOP:
        await asyncio.to_thread(_parse_object, body)
    else:
        _parse_object(body)


def _parse_object(body: bytes) -> None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyRefused(400, f"the request body is not valid UTF-8 (byte {exc.start}).") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BodyRefused(
            400, f"the request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise BodyRefused(400, "the request body's JSON is nested too deeply.") from None
    except ValueError:  # an integer literal past Python's int_max_str_digits (4300 digits by default)
        raise BodyRefused(
            400, "the request body holds an integer with more digits than Python reads (4300 by default)."
        ) from None
    if not isinstance(value, dict):
        raise BodyRefused(400, f"the request body must be a JSON object, not {_json_kind(value)}.")
    if _SURROGATE_ESCAPE.search(text):
        found = _lone_surrogate(value)
        if found is not None:  # no tokenizer, grammar or UTF-8 output can take it (it was a 500 at the tokenizer)
            path, in_key = found
            where = f"a key of {path or 'the body'}" if in_key else path
            raise BodyRefused(
                400,
                f"{where} holds a lone UTF-16 surrogate (a \\u escape in D800-DFFF): not Unicode text.",
                param=path or None,
            )


def _lone_surrogate(value: object) -> Optional[tuple[str, bool]]:
    """Where in `value` the first string with a lone surrogate is: its path (`messages[0].content`), and whether
    it is a key of that object. (A walk with its own stack, as json.loads may take deeper nesting than Python's
    recursion limit on some versions; each place is a link to its parent's, spelled out only when found.)"""
    Place = Optional[tuple[object, Union[str, int]]]  # (the parent's place, this key or index)

    def spelled(place: Place) -> str:
        parts: list[str] = []
        while place is not None:
            place, step = place  # type: ignore[assignment]
            parts.append(f"[{step}]" if isinstance(step, int) else f".{step}")
        text = "".join(reversed(parts))
        return text[1:] if text.startswith(".") else text

    stack: list[tuple[object, Place]] = [(value, None)]
    while stack:
        item, place = stack.pop()
        if isinstance(item, str):
            if not _is_text(item):
                return spelled(place), False
        elif isinstance(item, dict):
            if not all(_is_text(key) for key in item):
                return spelled(place), True
            stack.extend((child, (place, key)) for key, child in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((item[i], (place, i)) for i in range(len(item) - 1, -1, -1))
    return None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the connection's own messages (a disconnect, later)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_error(send: Send, refusal: BodyRefused) -> None:
    payload = json.dumps(error_body(refusal.status, refusal.message, param=refusal.param, code=refusal.code))
    data = payload.encode()
    await send(
        {
            "type": "http.response.start",
            "status": refusal.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": data})
