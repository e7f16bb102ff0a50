"""--request-timeout: a request still waiting or running at its deadline is aborted (blocks freed), its
client gets a 504 `request_timeout` (mid-stream: an error event, then [DONE]), counted as reason="timeout"."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.config.server_config import ServerConfig
from tests.reliability.conftest import assert_envelope, assert_gauges_zero, metric, pace_engine, serving, sse_payloads

TIMEOUT = 1.0
LONG = {"model": "tiny", "prompt": [9, 8, 7], "max_tokens": 200, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # one sequence at a time: a second request waits in the queue past its deadline
    with serving(tiny_model_dir, ServerConfig(request_timeout=TIMEOUT), max_num_seqs=1) as running:
        yield running


def test_running_and_waiting_requests_time_out(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.05)  # 200 tokens take 10 s or more: far past the deadline

    async def both():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

            async def stream():
                async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as response:
                    return response.status_code, [line async for line in response.aiter_lines()]

            running = asyncio.create_task(stream())
            await asyncio.sleep(0.2)
            waiting = await client.post("/v1/completions", json=LONG)
            return await running, waiting

    (status, lines), waiting = asyncio.run(both())
    assert status == 200
    events = sse_payloads(lines)
    assert events[-1] == "[DONE]"
    assert assert_envelope(events[-2])["code"] == "request_timeout"
    assert len(events) > 3  # it streamed tokens before the deadline
    assert waiting.status_code == 504
    error = assert_envelope(waiting.json())
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert_gauges_zero(server)
    assert metric(server.base_url, "pagedserve_request_failure_total", reason="timeout") == 2
    assert metric(server.base_url, "pagedserve_request_failure_total", reason="aborted") == 0


def test_a_request_within_its_deadline_is_untouched(server):
    response = httpx.post(f"{server.base_url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
