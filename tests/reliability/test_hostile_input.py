"""Hostile input: each gets a 4xx naming what is wrong, never a 500 and never a hang; big bodies are
refused (413) before they are parsed, chunked uploads included; long prompts before they are tokenized."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from server.config.server_config import ServerConfig
from tests.reliability.conftest import assert_envelope, assert_gauges_zero, metric, serving

LIMIT = 1 << 20  # --max-request-body for these tests


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(max_request_body=LIMIT)) as running:
        yield running


JSON = {"content-type": "application/json"}
CASES = [
    # name, route, raw body, headers, status, param, words in the message
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', JSON, 400, None, "UTF-8"),
    ("not json", "/v1/chat/completions", b'{"messages": [', JSON, 400, None, "not valid JSON"),
    ("an array", "/v1/completions", b"[1, 2, 3]", JSON, 400, None, "JSON object, not an array"),
    ("null", "/v1/chat/completions", b"null", JSON, 400, None, "JSON object, not null"),
    (
        "deep nesting",
        "/v1/completions",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        JSON,
        400,
        None,
        "nested too deeply",
    ),
    ("text/plain", "/v1/completions", b'{"prompt": "hi"}', {"content-type": "text/plain"}, 415, None, "Content-Type"),
    (
        "form",
        "/v1/chat/completions",
        b"a=b",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        None,
        "application/json",
    ),
    (
        "many prompts",
        "/v1/completions",
        json.dumps({"prompt": ["a"] * 5000}).encode(),
        JSON,
        400,
        "prompt",
        "--max-queued-requests",
    ),
    (
        "many stop strings",
        "/v1/completions",
        json.dumps({"prompt": "a", "stop": [f"s{i}" for i in range(3000)]}).encode(),
        JSON,
        400,
        "stop",
        "at most",
    ),
    ("out of vocabulary", "/v1/completions", b'{"prompt": [1, 2, 100000]}', JSON, 400, "prompt", "vocabulary"),
    ("negative token id", "/v1/completions", b'{"prompt": [[1, -3]]}', JSON, 400, "prompt", "vocabulary"),
    ("NaN", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', JSON, 400, "temperature", "finite"),
    (
        "Infinity",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a"}], "top_p": Infinity}',
        JSON,
        400,
        "top_p",
        "finite",
    ),
    (
        "overflowing float",
        "/v1/completions",
        b'{"prompt": "a", "presence_penalty": 1e999}',
        JSON,
        400,
        "presence_penalty",
        "finite",
    ),
    (
        "NaN logit bias",
        "/v1/completions",
        b'{"prompt": "a", "logit_bias": {"5": NaN}}',
        JSON,
        400,
        "logit_bias",
        "finite",
    ),
    (
        "an integer of 5000 digits",
        "/v1/completions",
        b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}",
        JSON,
        400,
        None,
        "more digits than Python reads",
    ),
    ("empty prompt", "/v1/completions", b'{"prompt": ""}', JSON, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", b'{"prompt": []}', JSON, 400, "prompt", "empty"),
    ("empty messages", "/v1/chat/completions", b'{"messages": []}', JSON, 400, "messages", "empty"),
    ("oov logit bias", "/v1/completions", b'{"prompt": "a", "logit_bias": {"999999": 1}}', JSON, 400, "logit_bias", ""),
    ("bad detokenize", "/detokenize", b'{"tokens": [99999999]}', JSON, 400, "tokens", "vocabulary"),
]


@pytest.mark.parametrize("name,route,body,headers,status,param,words", CASES, ids=[c[0] for c in CASES])
def test_hostile_bodies_get_a_4xx_naming_the_problem(server, name, route, body, headers, status, param, words):
    response = httpx.post(f"{server.base_url}{route}", content=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = assert_envelope(response.json())
    assert error["param"] == param, error
    assert words in error["message"], error


def test_a_body_over_the_limit_is_413_before_it_is_parsed(server):
    body = json.dumps({"model": "tiny", "prompt": "a " * LIMIT}).encode()
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=JSON, timeout=30)
    assert response.status_code == 413
    error = assert_envelope(response.json())
    assert error["code"] == "request_too_large"
    assert error["message"] == (
        f"the request body is {len(body)} bytes; this server accepts at most {LIMIT} bytes (--max-request-body)."
    )


def test_a_chunked_upload_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(40):
            yield b"a " * 32768  # 64 KiB a chunk, no Content-Length
        yield b'"}'

    response = httpx.post(f"{server.base_url}/v1/completions", content=chunks(), headers=JSON, timeout=30)
    assert response.status_code == 413
    error = assert_envelope(response.json())
    assert error["code"] == "request_too_large"
    assert error["message"] == (
        f"the request body is more than {LIMIT} bytes; this server accepts at most {LIMIT} bytes (--max-request-body)."
    )


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(server):
    text = "a " * (LIMIT // 3)  # ~700k characters, within the body limit; the context is 256 tokens
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=30)
    assert response.status_code == 400
    error = assert_envelope(response.json())
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "characters" in error["message"]  # the pre-check's refusal, not the tokenized prompt's
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]}, timeout=30
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert "characters" in chat.json()["error"]["message"]


def test_tokenizing_a_large_text_does_not_block_the_event_loop(server):
    """/tokenize has no context bound: ~1 MB of text tokenizes for a second or more, on a worker thread, while
    /health keeps answering. On the event loop no probe would be answered while it ran, and one would wait out
    all of it: several probes answered, none near the whole request's time (the bound leaves a loaded machine's
    scheduling its margin: one probe of 0.72 s in a 1.4 s request failed a bound of half)."""
    text = "hello world, this is a test. " * (LIMIT // 32)
    done = threading.Event()
    result = {}

    def tokenize():
        started = time.monotonic()
        result["response"] = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}, timeout=60)
        result["seconds"] = time.monotonic() - started
        done.set()

    thread = threading.Thread(target=tokenize)
    probes = []
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        client.get("/health")
        thread.start()
        while not done.is_set():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            probes.append(time.monotonic() - started)
            time.sleep(0.01)
    thread.join()
    assert result["response"].status_code == 200 and result["response"].json()["count"] > 100_000
    assert len(probes) >= 3
    assert max(probes) < 0.8 * max(result["seconds"], 1.0)


def test_bodies_refused_before_parsing_count_as_rejected_requests(server):
    """The body guard's refusals (invalid JSON, a Content-Type not JSON, a body over the limit) are rejected
    requests in pagedserve_request_failure_total, as a 400 from a field's validation is (they were not counted)."""
    url = f"{server.base_url}/v1/completions"
    before = metric(server.base_url, "pagedserve_request_failure_total", reason="rejected")
    assert httpx.post(url, content=b'{"prompt": ', headers=JSON, timeout=30).status_code == 400
    assert httpx.post(url, content=b'{"prompt": "a"}', headers={"content-type": "text/plain"}).status_code == 415
    too_large = json.dumps({"prompt": "a " * LIMIT}).encode()
    assert httpx.post(url, content=too_large, headers=JSON, timeout=30).status_code == 413
    assert httpx.post(url, json={"prompt": "a", "max_tokens": -1}, timeout=30).status_code == 400  # validation
    after = metric(server.base_url, "pagedserve_request_failure_total", reason="rejected")
    assert after - before == 4


def test_nothing_is_left_behind(server):
    assert_gauges_zero(server)
