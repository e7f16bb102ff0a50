"""Operations: GET /health, /version, /metrics; HEAD /health and /metrics (monitoring probes)."""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.http.errors import ERROR_RESPONSES, APIError
from server.state import ServerState
from server.version import package_version

router = APIRouter()


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "Ready (empty body)"}, 503: ERROR_RESPONSES[503]},
)
async def health(request: Request) -> Response:
    """200 once warmed up while the engine loop is alive; 503 otherwise (and from the first stop signal on)."""
    _check_health(request.app.state.server)
    return Response(status_code=200)


@router.head(
    "/health", response_class=Response, responses={200: {"description": "Ready (no body)"}, 503: ERROR_RESPONSES[503]}
)
async def health_head(request: Request) -> Response:
    """GET /health's status, no body."""
    _check_health(request.app.state.server)
    return Response(status_code=200)


def _check_health(state: ServerState) -> None:
    if state.draining:
        raise APIError(503, "the server is shutting down")
    if not state.engine.is_alive:
        raise APIError(503, f"the engine is not running: {state.engine.error or 'stopped'}")
    if not state.ready:
        raise APIError(503, "the server is warming up")


@router.get("/version")
async def get_version() -> dict:
    return {"version": _package_version()}


@functools.cache
def _package_version() -> str:
    """Read once: the installed distribution's metadata does not change while the server runs."""
    return package_version()


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}},
        401: ERROR_RESPONSES[401],
    },
)
async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.head(
    "/metrics",
    response_class=Response,
    responses={200: {"description": "Serving metrics (no body)"}, 401: ERROR_RESPONSES[401]},
)
async def metrics_head() -> Response:
    """200 without rendering the metrics (a probe that the endpoint is up)."""
    return Response(status_code=200, media_type=CONTENT_TYPE_LATEST)
