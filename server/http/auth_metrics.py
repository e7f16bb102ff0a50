"""API-key authentication and per-route request counting, as a pure ASGI middleware.

Starlette's `BaseHTTPMiddleware` (what `@app.middleware("http")` installs) runs the app in a task
and passes every chunk of a streamed response through a memory stream; this class only watches the
response's start message for its status, so a streamed token costs nothing here.
"""

from __future__ import annotations

import hmac
from typing import Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.errors import error_body
from server.observability.metrics import ServerMetrics


class AuthAndMetrics:
    """Refuses requests to `prefixes` without a valid `Authorization: Bearer <key>` (when keys are set) with
    a 401 in the OpenAI envelope, and counts every response by route template and status."""

    def __init__(
        self,
        app: ASGIApp,
        keys: Sequence[bytes],
        prefixes: tuple[str, ...],
        metrics: ServerMetrics,
        routes: Sequence[BaseRoute] = (),
    ):
        self.app = app
        self.keys = list(keys)
        self.prefixes = prefixes
        self.metrics = metrics
        self.routes = list(routes)  # the app's routes, for a response given before the router ran

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (
            self.keys
            and scope["method"] != "OPTIONS"
            and route_path(scope).startswith(self.prefixes)
            and not authorized(Headers(scope=scope), self.keys)
        ):
            response = JSONResponse(
                error_body(401, "Invalid or missing API key (send Authorization: Bearer <key>)."),
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await response(scope, receive, send)
            self.metrics.observe_http("unmatched", 401)
            return
        status = 500  # if the app fails before it starts a response

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.metrics.observe_http(self.route_template(scope), status)

    def route_template(self, scope: Scope) -> str:
        """The path template of the route that answered (the router marks it on the scope), else of the route the
        request would have reached: the body guard answers before the router runs (413, 415, a body that is not a
        JSON object). "unmatched" when no route takes the path and method."""
        route = scope.get("route")  # set by the router once a route matched
        if route is not None:
            return getattr(route, "path", "unmatched")
        for candidate in self.routes:
            if candidate.matches(scope)[0] is Match.FULL:
                return getattr(candidate, "path", "unmatched")
        return "unmatched"


def authorized(headers: Headers, keys: Sequence[bytes]) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode()
    matched = False
    for key in keys:  # compare against every key: constant time in which key matched
        matched |= hmac.compare_digest(presented, key)
    return matched


def route_path(scope: Scope) -> str:
    """The path the routes match: without the `root_path` (--root-path) that uvicorn puts in front of it
    (as Starlette's router strips it), so a prefix never takes a route out of authentication."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path
