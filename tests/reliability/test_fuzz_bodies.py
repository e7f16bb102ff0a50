"""Hypothesis-generated bodies for both generation routes: never a 5xx, every error in the envelope,
every stream well framed; the engine is idle afterwards."""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import assert_envelope, assert_gauges_zero, serving

EXAMPLES = 200  # per route

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-5, 600), max_size=12)
SAMPLING = {
    "model": st.sampled_from(["tiny", "other", ""]) | values,
    "max_tokens": st.integers(-2, 6) | values,
    "n": st.integers(-1, 3) | values,
    "temperature": st.floats(-1, 3) | values,
    "top_p": st.floats(-0.5, 1.5) | values,
    "top_k": st.integers(-2, 50) | values,
    "stop": st.lists(st.text(max_size=4), max_size=5) | st.text(max_size=4) | values,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | values,
    "seed": st.integers(-(2**65), 2**65) | values,
    "logit_bias": st.dictionaries(st.integers(-3, 600).map(str), st.floats(-200, 200), max_size=3) | values,
    "stop_token_ids": token_ids | values,
    "presence_penalty": st.floats(-3, 3) | values,
    "min_tokens": st.integers(-1, 8) | values,
    "ignore_eos": st.booleans() | values,
    "priority": st.integers(-2, 2) | values,
}
PROMPTS = st.one_of(
    st.text(max_size=40), st.lists(st.text(max_size=10), max_size=3), token_ids, st.lists(token_ids, max_size=3), values
)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | values,
        "content": st.text(max_size=30) | values,
    }
)
COMPLETION = st.fixed_dictionaries(
    {},
    optional={"prompt": PROMPTS, "echo": st.booleans() | values, "logprobs": st.integers(-1, 6) | values, **SAMPLING},
)
CHAT = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(MESSAGE, max_size=3) | values,
        "logprobs": st.booleans() | values,
        "top_logprobs": st.integers(-1, 6),
        "max_completion_tokens": st.integers(-1, 6) | values,
        **SAMPLING,
    },
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as running:
        yield running


def _encode(body: dict) -> bytes:
    """JSON as a client may send it: NaN and Infinity literals included (Python's json does that)."""
    return json.dumps(body).encode()


def _check(client: httpx.Client, route: str, body: dict) -> None:
    with client.stream("POST", route, content=_encode(body), headers={"content-type": "application/json"}) as response:
        raw = response.read().decode()
    assert response.status_code < 500, (body, raw)
    if response.status_code >= 400:
        assert_envelope(json.loads(raw))
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in raw.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", raw[-500:]
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                error = assert_envelope(payload)
                assert error["type"] != "internal_server_error", payload
    else:
        assert "choices" in json.loads(raw)


@pytest.mark.parametrize("route,bodies", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_generated_bodies_never_cause_a_5xx(server, route, bodies):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(body=bodies)
        def run(body):
            _check(client, route, body)

        run()
    assert_gauges_zero(server)


def test_non_finite_floats_are_valid_json_for_python_clients():
    assert b"NaN" in _encode({"x": math.nan})
