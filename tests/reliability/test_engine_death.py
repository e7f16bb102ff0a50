"""The engine loop dies: every waiting client gets an error at once, /health and new requests get 503,
and `pagedserve serve` exits non-zero within seconds (so a supervisor restarts it)."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.reliability.conftest import assert_envelope, pace_engine, serve_process, serving, sse_payloads

DEATH_TOKEN = 77


def test_waiting_clients_get_errors_and_new_requests_503(tiny_model_dir, monkeypatch):
    deaths = []
    with serving(tiny_model_dir, on_engine_death=deaths.append) as server:
        pace_engine(server, monkeypatch, 0.05)
        runner = server.engine.engine.runner
        execute = runner.execute

        def dying(scheduler_output):
            if server.engine.engine.num_steps >= 8:  # once the clients below are all waiting
                raise RuntimeError("injected engine loop failure")
            return execute(scheduler_output)

        async def clients():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as client:

                async def stream():
                    body = {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 200, "ignore_eos": True, "stream": True}
                    async with client.stream("POST", "/v1/completions", json=body) as response:
                        return response.status_code, [line async for line in response.aiter_lines()]

                async def plain():
                    body = {"model": "tiny", "prompt": [3, 4, 6], "max_tokens": 200, "ignore_eos": True}
                    return await client.post("/v1/completions", json=body)

                return await asyncio.gather(stream(), plain())

        monkeypatch.setattr(runner, "execute", dying)
        started = time.monotonic()
        (status, lines), plain = asyncio.run(clients())
        assert time.monotonic() - started < 20  # nobody hangs
        assert status == 200
        events = sse_payloads(lines)
        assert events[-1] == "[DONE]"
        assert assert_envelope(events[-2])["type"] == "service_unavailable_error"
        assert plain.status_code == 503 and assert_envelope(plain.json())
        deadline = time.monotonic() + 5
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(deaths) == 1 and "injected" in str(deaths[0])
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 503
        again = httpx.post(
            f"{server.base_url}/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1}, timeout=10
        )
        assert again.status_code == 503


def test_serve_exits_non_zero_when_the_engine_loop_dies(tmp_path):
    process, url, stderr = serve_process(tmp_path, hooks=("--die-on-token", str(DEATH_TOKEN)))
    try:
        response = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": [DEATH_TOKEN], "max_tokens": 4}, timeout=30
        )
        assert response.status_code == 503
        assert process.wait(timeout=15) == 1, stderr.read_text()[-3000:]
    finally:
        process.kill()
    assert "the engine loop died" in stderr.read_text()
