"""Admission control under a burst: only 200s and 429s (each 429 with Retry-After), never a 5xx or a hang;
/health answers throughout; afterwards every gauge reads 0."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.config.server_config import ServerConfig
from tests.reliability.conftest import assert_envelope, assert_gauges_zero, metric, pace_engine, serving

BURST = 40
MAX_QUEUED = 4


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(max_queued_requests=MAX_QUEUED), max_num_seqs=2) as running:
        yield running


async def _burst_and_probe(base_url: str):
    limits = httpx.Limits(max_connections=BURST + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def one(i: int):
            body = {"model": "tiny", "prompt": [10 + i, 11, 12], "max_tokens": 8, "ignore_eos": True}
            if i % 2:
                async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    await response.aread()
                    return response
            return await client.post("/v1/completions", json=body)

        burst = asyncio.gather(*(one(i) for i in range(BURST)))
        probes = []
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as prober:
            while not burst.done():
                status = (await prober.get("/health")).status_code  # a hang ends in the client's timeout
                probes.append((status, burst.done()))  # answered while the burst was still in flight?
                await asyncio.sleep(0.02)
        return await burst, probes


def test_a_burst_gets_only_200_and_429(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.02)
    rejected_before = metric(server.base_url, "pagedserve_request_rejected_total", reason="queue_full")
    responses, probes = asyncio.run(_burst_and_probe(server.base_url))  # every call bounded by a 60 s timeout
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_QUEUED and statuses.count(429) >= 1, statuses
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            error = assert_envelope(response.json())
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
    # /health answered every probe, and answered during the overload (order, not a latency claim)
    assert probes and all(status == 200 for status, _ in probes)
    assert any(not burst_was_done for _, burst_was_done in probes)
    rejected = metric(server.base_url, "pagedserve_request_rejected_total", reason="queue_full")
    assert rejected - rejected_before == statuses.count(429)
    assert_gauges_zero(server)


def test_n_counts_as_n_sequences(server):
    body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "n": MAX_QUEUED + 1}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert assert_envelope(response.json())["param"] == "n"
    prompts = {"model": "tiny", "prompt": [[5, 6]] * 3, "max_tokens": 2, "n": 2}
    response = httpx.post(f"{server.base_url}/v1/completions", json=prompts, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
    assert_gauges_zero(server)
