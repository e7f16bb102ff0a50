"""API keys: `Authorization: Bearer <key>` on /v1/*, /tokenize and /detokenize; /health and /metrics
open; CORS preflights pass; keys never reach the server's logs."""

from __future__ import annotations

import contextlib
import logging

import httpx
import openai
import pytest

from server.config.server_config import ServerConfig
from tests.server.conftest import start_server

KEY1 = "k1-Qm7vX2pLr9"
KEY2 = "k2-Tz4wN8cHs3"
WRONG = "k3-not-a-key-Jd5"

PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
    ),
    ("POST", "/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 2, "temperature": 0}),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
]
IDS = [path for _, path, _ in PROTECTED]


@pytest.fixture(scope="module")
def auth_server(tiny_model_dir):
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(api_keys=[KEY1, KEY2], served_model_name="tiny"))
    yield running
    running.wait_idle()
    uv.should_exit = True
    thread.join(30)


def client(server, authorization: str | None = None) -> httpx.Client:
    headers = {} if authorization is None else {"Authorization": authorization}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=60)


def send(c: httpx.Client, method: str, path: str, body) -> httpx.Response:
    return c.request(method, path, json=body) if body is not None else c.request(method, path)


def assert_401(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "authentication_error",
            "param": None,
            "code": None,
        }
    }
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=IDS)
def test_missing_key_is_401(auth_server, method, path, body):
    with client(auth_server) as c:
        assert_401(send(c, method, path, body))


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=IDS)
def test_both_keys_work(auth_server, method, path, body):
    for key in (KEY1, KEY2):
        with client(auth_server, f"Bearer {key}") as c:
            response = send(c, method, path, body)
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "authorization",
    [
        f"Bearer {WRONG}",
        f"Basic {KEY1}",
        f"Token {KEY1}",
        KEY1,
        "Bearer",
        f"Bearer {KEY1}x",
        f"Bearer {KEY1[:-1]}",
        f"Bearer {KEY1} {KEY2}",
    ],
    ids=["wrong-key", "basic", "token", "bare", "no-key", "longer", "prefix", "two-keys"],
)
def test_wrong_key_or_scheme_is_401(auth_server, authorization):
    with client(auth_server, authorization) as c:
        for method, path, body in PROTECTED:
            assert_401(send(c, method, path, body))


def test_scheme_is_case_insensitive(auth_server):
    with client(auth_server, f"bearer {KEY2}") as c:
        assert c.get("/v1/models").status_code == 200


def test_health_and_metrics_stay_open(auth_server):
    with client(auth_server) as c:
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics")
        assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
        # an unknown /v1 route is not revealed without a key
        assert_401(c.get("/v1/nothing-here"))
    with client(auth_server, f"Bearer {KEY1}") as c:
        assert c.get("/v1/nothing-here").status_code == 404


def test_cors_preflight_passes_without_a_key(auth_server):
    origin = "http://localhost:3000"
    with client(auth_server) as c:
        response = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] in ("*", origin)
        assert "POST" in response.headers["access-control-allow-methods"]
        assert "authorization" in response.headers["access-control-allow-headers"].lower()
        # a browser can read the 401 of a cross-origin request
        refused = c.get("/v1/models", headers={"Origin": origin})
        assert_401(refused)
        assert refused.headers["access-control-allow-origin"] in ("*", origin)
    with client(auth_server, f"Bearer {KEY1}") as c:
        allowed = c.get("/v1/models", headers={"Origin": origin})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] in ("*", origin)


def test_openai_sdk(auth_server):
    good = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=KEY2, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list()] == ["tiny"]
    out = good.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3
    chunks = list(
        good.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"

    bad = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key=WRONG, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert info.value.status_code == 401
    assert info.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


_SERVER_LOGGERS = ("server", "engine", "scheduler", "uvicorn", "fastapi", "starlette")


@contextlib.contextmanager
def capture_all_logs(caplog):
    """Every log record at DEBUG, uvicorn's own (non-propagating) loggers included."""
    uvicorn_loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access", "uvicorn.error")]
    saved = [(lg, lg.level) for lg in uvicorn_loggers]
    for lg in uvicorn_loggers[:2]:  # uvicorn.error propagates into "uvicorn"
        lg.addHandler(caplog.handler)
    for lg in uvicorn_loggers:
        lg.setLevel(logging.DEBUG)
    try:
        with caplog.at_level(logging.DEBUG):
            yield
    finally:
        for lg in uvicorn_loggers[:2]:
            lg.removeHandler(caplog.handler)
        for lg, level in saved:
            lg.setLevel(level)


def test_keys_never_logged(auth_server, caplog):
    with capture_all_logs(caplog):
        with client(auth_server, f"Bearer {KEY1}") as c:
            assert c.get("/v1/models").status_code == 200
            ok = c.post(
                "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "unknown_field": True}
            )  # logs a warning
            assert ok.status_code == 200
            assert (
                c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "temperature": -1}).status_code
                == 400
            )
        with client(auth_server, f"Bearer {KEY2}") as c:
            assert c.post("/v1/completions", json={"model": "nope", "prompt": "Hello"}).status_code == 404
            assert (
                c.post(
                    "/v1/completions", json={"model": "tiny", "prompt": "Hello", "stream": True, "max_tokens": 2}
                ).status_code
                == 200
            )
        with client(auth_server, f"Bearer {WRONG}") as c:
            assert c.post("/v1/completions", json={"model": "tiny", "prompt": "Hello"}).status_code == 401
        with client(auth_server, f"Basic {KEY1}") as c:
            assert c.get("/v1/models").status_code == 401
        auth_server.wait_idle()
    records = [r for r in caplog.records if r.name.split(".")[0] in _SERVER_LOGGERS]
    assert any(r.name.startswith("uvicorn") for r in records), "the access log was not captured"
    assert any("unknown_field" in r.getMessage() for r in records), "the server's own log was not captured"
    for record in records:
        text = record.getMessage() + (record.exc_text or "") + repr(record.args)
        for secret in (KEY1, KEY2, WRONG):
            assert secret not in text, (record.name, text)


def test_auth_and_counting_are_pure_asgi_middleware(server):
    """No BaseHTTPMiddleware (which passes every streamed chunk through a task and a memory stream)."""
    from starlette.middleware.base import BaseHTTPMiddleware

    from server.http.auth_metrics import AuthAndMetrics

    classes = [m.cls for m in server.app.user_middleware]
    assert AuthAndMetrics in classes and BaseHTTPMiddleware not in classes
