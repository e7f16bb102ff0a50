"""A client that goes away aborts its requests: the engine empties and every KV block comes back.

Each test proves the requests were really running (engine stats, or the 499 the server logged),
that none of them finished (no new `length` success), and that the server still serves afterwards.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import pace_engine

MODEL = "tiny"
LONG = 200  # tokens: seconds of generation on the tiny model, far longer than any test step
NUM_STREAMS = 4


def prompt_ids(length: int, start: int) -> list[int]:
    return list(range(start, start + length))


def counter(server, name: str, **labels: str) -> float:
    """A sample of the shared server's /metrics (0 when absent)."""
    with server.client() as http:
        text = http.get("/metrics").text
    wanted = {"model_name": MODEL, **labels}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return sample.value
    return 0.0


def successes(server) -> float:
    return counter(server, "pagedserve_request_success_total", finished_reason="length")


def assert_gauges_reach_zero(server, timeout: float = 5.0) -> None:
    """Through /metrics, as a monitoring system sees it: nothing running or waiting, no KV in use."""
    names = ("pagedserve_num_requests_running", "pagedserve_num_requests_waiting", "pagedserve_kv_cache_usage_ratio")
    deadline = time.monotonic() + timeout
    while True:
        values = {name: counter(server, name) for name in names}
        if not any(values.values()):
            return
        assert time.monotonic() < deadline, f"not idle {timeout} s after the clients left: {values}"
        time.sleep(0.05)


def assert_still_serves(server) -> None:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        response = client.completions.create(
            model=MODEL, prompt=prompt_ids(5, 60), max_tokens=3, extra_body={"ignore_eos": True}
        )
    assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 3


def engine_load(server) -> tuple[int, float]:
    stats = server.engine.engine.stats()
    return stats.num_running + stats.num_waiting, stats.kv_cache_usage


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_streams_closed_after_first_chunk_are_aborted(server):
    before = successes(server)

    async def scenario() -> tuple[int, float]:
        async with async_client(server) as client:
            streams = await asyncio.gather(
                *(
                    client.completions.create(
                        model=MODEL,
                        prompt=prompt_ids(8, 20 + 10 * i),
                        max_tokens=LONG,
                        stream=True,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(NUM_STREAMS)
                )
            )
            for stream in streams:
                first = await anext(aiter(stream))
                assert first.choices[0].finish_reason is None
            load = engine_load(server)  # every stream has its first chunk and is still open
            await asyncio.gather(*(stream.close() for stream in streams))
        return load

    in_flight, kv_usage = asyncio.run(scenario())
    assert in_flight == NUM_STREAMS and kv_usage > 0
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    assert successes(server) == before  # aborted, none ran to max_tokens
    assert_still_serves(server)
    assert successes(server) == before + 1


def test_non_streaming_clients_that_time_out_are_aborted(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.01)  # 200 tiny-model steps can take under the 0.3 s timeout
    before_success = successes(server)
    before_499 = counter(server, "pagedserve_http_requests_total", route="/v1/completions", status="499")
    errors: list[BaseException] = []

    def impatient(i: int) -> None:
        body = {"model": MODEL, "prompt": prompt_ids(8, 200 + 10 * i), "max_tokens": LONG, "ignore_eos": True}
        try:
            with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.3)) as http:
                http.post("/v1/completions", json=body)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    threads = [threading.Thread(target=impatient, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(errors) == 3 and all(isinstance(e, httpx.ReadTimeout) for e in errors), errors
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    # the server saw each disconnect and cancelled the work (499), and none of it finished
    deadline = time.monotonic() + 5
    while counter(server, "pagedserve_http_requests_total", route="/v1/completions", status="499") < before_499 + 3:
        assert time.monotonic() < deadline, "the server did not notice the clients leaving"
        time.sleep(0.05)
    assert counter(server, "pagedserve_http_requests_total", route="/v1/completions", status="499") == before_499 + 3
    assert successes(server) == before_success
    assert_still_serves(server)


def test_chat_stream_with_three_choices_closed_early_is_aborted(server):
    before = successes(server)

    async def scenario() -> tuple[int, float]:
        async with async_client(server) as client:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a long story"}],
                n=3,
                max_tokens=LONG,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:  # the role chunks come first; wait for generated text
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            load = engine_load(server)
            await stream.close()
        return load

    in_flight, kv_usage = asyncio.run(scenario())
    assert in_flight == 3 and kv_usage > 0  # the three choices run as three engine requests
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    assert successes(server) == before
    assert_still_serves(server)


@pytest.mark.parametrize("stream", [False, True])
def test_client_gone_before_first_token_leaves_nothing(server, stream):
    """Closing at once (no chunk read) must abort as well: the request may still be queued."""
    before = successes(server)
    body = {"model": MODEL, "prompt": prompt_ids(40, 300), "max_tokens": LONG, "ignore_eos": True, "stream": stream}
    try:
        with (
            httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.05)) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            response.close()
    except httpx.ReadTimeout:
        pass
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    assert successes(server) == before


def http_requests(server, route: str) -> float:
    """pagedserve_http_requests_total for `route`, summed over status codes."""
    with server.client() as http:
        text = http.get("/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedserve_http_requests_total" and sample.labels.get("route") == route
    )


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_stream_whose_client_left_before_the_headers_is_aborted(server, monkeypatch, route):
    """The request is queued, but the client is gone before the response starts: the body never runs,
    and the response itself must abort the choices (they used to run to max_tokens for nobody)."""
    pace_engine(server, monkeypatch, 0.1)  # 30 tokens would take 3 s
    runner = server.engine.engine.runner
    execute, steps = runner.execute, []

    def counting_execute(scheduler_output):
        steps.append(sum(1 for rid in scheduler_output.num_scheduled_tokens if rid.startswith("left-early")))
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", counting_execute)
    before_requests = http_requests(server, route)
    body = {"model": MODEL, "max_tokens": 30, "stream": True, "ignore_eos": True, "n": 3, "request_id": "left-early"}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"})
    if route == "/v1/responses":  # one output, its own names
        body = {
            "model": MODEL,
            "input": "Hi",
            "max_output_tokens": 30,
            "stream": True,
            "ignore_eos": True,
            "request_id": "left-early",
        }
    payload = json.dumps(body).encode()
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
    deadline = time.monotonic() + 10
    while http_requests(server, route) == before_requests:  # the server has handled (and logged) it
        assert time.monotonic() < deadline, "the server never logged the request"
        time.sleep(0.02)
    server.wait_idle(timeout=20)
    assert_gauges_reach_zero(server)
    # aborted within a few steps, not run for all 30 tokens
    assert sum(1 for n in steps if n) < 10, steps
