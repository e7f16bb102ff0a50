"""/health answers while the engine is saturated: model compute never blocks the event loop.

Two loads, each 16 long streaming completions (a full batch of configs/tiny.yaml):
  - the real thing: the tiny model computing flat out on the CPU; every probe must answer 200
    within a second (a hang detector, not a latency claim: this suite runs on loaded machines);
  - steps stretched to STEP_STALL (a sleep inside the model runner, the way a GPU step waits on its
    kernels with the GIL released): were a step ever run on the event loop, probes landing during a
    step would wait for most of it, so every probe must stay under half a step. The margin is wide
    (a loaded 2-core machine was seen at ~140 ms per probe) so that only a blocked loop fails it.
Latency is measured client-side on a kept-alive connection. /health's latency as such is a
benchmark's business, not this test's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx

from tests.server.conftest import pace_engine

MODEL = "tiny"
NUM_STREAMS = 16  # configs/tiny.yaml's max_num_seqs: a full batch
PROMPT_LEN = 8  # 16 prompts x 8 tokens = 128 = max_num_batched_tokens: one step prefills them all
LONG = 256 - PROMPT_LEN  # 16 x 256 tokens overflow the 1024-token KV cache: preemption joins in
PROBE_WINDOW = 1.0  # seconds of probing, cut short should a request finish
MIN_PROBES = 20  # probes answered while all 16 requests were unfinished
PROBE_INTERVAL = 0.01
STEP_STALL = 1.0  # seconds a stalled step lasts


class StreamingLoad:
    """NUM_STREAMS long streaming completions read by their own event loop thread until `stop()`
    closes them (the clients go away, which aborts the requests)."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self.chunks = [0] * NUM_STREAMS
        self.errors: list[BaseException] = []
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def __enter__(self) -> StreamingLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load's client did not stop"
        self._loop.close()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=NUM_STREAMS)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60, limits=limits) as client:
            tasks = [asyncio.create_task(self._consume(client, i)) for i in range(NUM_STREAMS)]
            await self._stop.wait()
            for task in tasks:  # leaving the `stream` context closes the connection
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _consume(self, client: httpx.AsyncClient, i: int) -> None:
        start = 20 + PROMPT_LEN * i
        body = {
            "model": MODEL,
            "prompt": list(range(start, start + PROMPT_LEN)),
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        self.chunks[i] += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)


def probe_health_under_load(server, min_steps: int, budget: float, window: float = PROBE_WINDOW) -> None:
    core = server.engine.engine
    with server.client() as http:
        assert http.get("/health").status_code == 200  # opens the connection the probes reuse
        with StreamingLoad(server.base_url) as load:
            deadline = time.monotonic() + 30
            while not (core.num_unfinished_requests == NUM_STREAMS and all(load.chunks)):
                assert time.monotonic() < deadline and not load.errors, f"load did not start: {load.errors}"
                time.sleep(0.01)
            steps_before = core.num_steps
            latencies, statuses = [], []
            window_end = time.monotonic() + window
            while time.monotonic() < window_end and core.num_unfinished_requests == NUM_STREAMS:
                started = time.perf_counter()
                response = http.get("/health")
                latencies.append(time.perf_counter() - started)
                statuses.append(response.status_code)
                time.sleep(PROBE_INTERVAL)
            steps_during = core.num_steps - steps_before
    assert not load.errors, load.errors
    assert statuses == [200] * len(statuses)
    slow = [round(t * 1000, 1) for t in latencies if t >= budget]
    assert not slow, (
        f"/health over {budget * 1000:.0f} ms under load: {slow} ms "
        f"({len(slow)} of {len(latencies)} probes, {steps_during} engine steps)"
    )
    # the probes overlapped the compute: nothing had finished and the engine kept stepping
    assert len(latencies) >= MIN_PROBES, f"only {len(latencies)} probes before a request finished"
    assert steps_during >= min_steps, steps_during
    server.wait_idle()


def test_health_stays_fast_while_the_model_computes(server):
    probe_health_under_load(server, min_steps=10, budget=1.0)


def test_health_stays_fast_while_each_step_outlasts_the_budget(server, monkeypatch):
    pace_engine(server, monkeypatch, STEP_STALL)
    probe_health_under_load(server, min_steps=2, budget=STEP_STALL / 2, window=2.5 * STEP_STALL)
