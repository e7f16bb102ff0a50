"""Operator middleware for --middleware's tests, by import path: a class and an async function, each marking
the responses it sees."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class MarkResponses:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-marked-by", b"class")]}
            await send(message)

        await self.app(scope, receive, marked if scope["type"] == "http" else send)


async def mark_responses(request, call_next):
    response = await call_next(request)
    response.headers["x-marked-by-function"] = "yes"
    return response


NOT_MIDDLEWARE = 3
