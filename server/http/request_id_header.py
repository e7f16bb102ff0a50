"""--enable-request-id-headers: every HTTP response carries `X-Request-Id`, the one the client sent or a new one
(vLLM's flag), so a client and a proxy's log can name the same request. Plain ASGI: streamed bodies pass through
untouched."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HEADER = b"x-request-id"


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name.lower() == _HEADER), None)
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name.lower() != _HEADER]
                message = {**message, "headers": [*headers, (_HEADER, request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
