"""100 clients that give up after a fraction of a second: nothing leaks, a fresh request is served at once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.reliability.conftest import assert_gauges_zero, pace_engine, serving

NUM_CLIENTS = 100


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as running:
        yield running


async def _storm(base_url: str) -> int:
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=NUM_CLIENTS)
    async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:

        async def impatient(i: int) -> bool:
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(3, 500) for _ in range(rng.randrange(1, 40))],
                "max_tokens": 200,
                "ignore_eos": True,
                "stream": i % 2 == 0,
            }
            patience = rng.uniform(0.05, 0.5)  # the whole request's, streamed or not (httpx's read timeout
            # would only bound the gaps between a stream's chunks)

            async def read() -> None:
                async with client.stream("POST", "/v1/completions", json=body, timeout=5) as response:
                    async for _ in response.aiter_bytes():
                        pass

            try:
                await asyncio.wait_for(read(), patience)
            except asyncio.TimeoutError:
                return True
            return False

        timeouts = await asyncio.gather(*(impatient(i) for i in range(NUM_CLIENTS)))
        return sum(timeouts)


def test_a_cancellation_storm_leaves_nothing_behind(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.02)  # 200 tokens take 4 s or more: every client gives up first
    timed_out = asyncio.run(_storm(server.base_url))
    assert timed_out > NUM_CLIENTS // 2
    started = time.monotonic()
    fresh = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2}, timeout=5
    )
    assert fresh.status_code == 200 and time.monotonic() - started < 5
    assert_gauges_zero(server)  # running, waiting, KV usage and the admission counts: 0 within 10 s
