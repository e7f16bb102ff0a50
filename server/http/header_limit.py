"""--h11-max-header-count: a request with more headers than this is refused with 431 before any route reads it
(vLLM's flag, a guard against header floods)."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.http.errors import error_body


class HeaderLimit:
    def __init__(self, app: ASGIApp, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        count = len(scope["headers"]) if scope["type"] == "http" else 0
        if count > self.max_headers:
            message = f"the request has {count} headers; this server takes {self.max_headers} at most"
            await JSONResponse(error_body(431, message), status_code=431)(scope, receive, send)
            return
        await self.app(scope, receive, send)
