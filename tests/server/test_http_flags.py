"""vLLM's HTTP flags, served in process: --enable-request-id-headers, --disable-fastapi-docs, the CORS trio
(--allowed-methods, --allowed-headers, --allow-credentials), --h11-max-header-count, --middleware and
--log-error-stack."""

from __future__ import annotations

import logging

import httpx
import pytest

from server.config.server_config import ServerConfig
from server.http.user_middleware import MiddlewareError, load_middleware
from tests.server.conftest import serving

ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ServerConfig(
        served_model_name="tiny",
        enable_request_id_headers=True,
        disable_fastapi_docs=True,
        allowed_origins=[ORIGIN],
        allowed_methods=["GET", "POST"],
        allowed_headers=["Authorization", "Content-Type"],
        allow_credentials=True,
        h11_max_header_count=40,
        middleware=["tests.server.middleware_samples.MarkResponses", "tests.server.middleware_samples.mark_responses"],
        log_error_stack=True,
    )
    with serving(tiny_model_dir, config) as running:
        yield running


def test_request_ids_are_echoed_or_made(server):
    with server.client() as c:
        assert c.get("/v1/models", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
        made = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert len(made.headers["x-request-id"]) == 32
        # streamed and refused responses carry it too
        with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True}) as reply:
            assert reply.headers["x-request-id"]
        assert c.get("/v1/models/nope", headers={"X-Request-Id": "r2"}).headers["x-request-id"] == "r2"


def test_no_docs_or_schema(server):
    with server.client() as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404
        assert c.get("/v1/models").status_code == 200


def test_cors_takes_the_given_methods_headers_and_credentials(server):
    def preflight(method: str, headers: str = "content-type") -> httpx.Response:
        with server.client() as c:
            return c.options(
                "/v1/completions",
                headers={
                    "Origin": ORIGIN,
                    "Access-Control-Request-Method": method,
                    "Access-Control-Request-Headers": headers,
                },
            )

    allowed = preflight("POST")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert preflight("DELETE").status_code == 400
    assert preflight("POST", "x-custom").status_code == 400


def test_too_many_headers_is_a_431(server):
    many = {f"x-h{i}": "1" for i in range(45)}
    with server.client() as c:
        reply = c.get("/v1/models", headers=many)
        assert reply.status_code == 431 and "takes 40 at most" in reply.json()["error"]["message"]
        assert c.get("/v1/models", headers=dict(list(many.items())[:20])).status_code == 200


def test_a_header_flood_is_a_431_by_default(tiny_model_dir):
    """vLLM's default of --h11-max-header-count: 256 headers."""
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny")) as running, running.client() as c:
        assert c.get("/health", headers={f"x-h{i}": "1" for i in range(250)}).status_code == 200
        assert c.get("/health", headers={f"x-h{i}": "1" for i in range(300)}).status_code == 431


def test_the_operators_middleware_runs(server):
    with server.client() as c:
        reply = c.get("/health")
    assert reply.headers["x-marked-by"] == "class" and reply.headers["x-marked-by-function"] == "yes"


@pytest.mark.parametrize(
    "path, why",
    [
        ("tests.server.middleware_samples.NOT_MIDDLEWARE", "neither a class nor an async function"),
        ("tests.server.middleware_samples.missing", "has no 'missing'"),
        ("no_such_module_here.Thing", "cannot import"),
        ("Thing", "module.Name"),
    ],
)
def test_a_path_naming_no_middleware_is_an_error(path, why):
    with pytest.raises(MiddlewareError, match=why):
        load_middleware(path)


def test_error_responses_are_logged_with_their_traceback(server, caplog):
    with caplog.at_level(logging.INFO, logger="server.http.errors"), server.client() as c:
        reply = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert reply.status_code == 400
    logged = [record for record in caplog.records if record.name == "server.http.errors"]
    assert logged and logged[-1].exc_info is not None and "400" in logged[-1].getMessage()
