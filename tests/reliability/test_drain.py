"""Graceful drain of a real `pagedserve serve` process: SIGTERM/SIGINT turn /health and new requests into
503s at once, in-flight streams finish (or, past --shutdown-timeout, end with an error event), exit 0."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.reliability.conftest import assert_envelope, serve_process

PACE = "0.05"  # seconds per engine step: a 60-token stream lasts 3 s or more
BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "ignore_eos": True, "stream": True, "temperature": 0}


def _stream_then_signal(url: str, process, stop: int, max_tokens: int, during_drain) -> list:
    """Open a stream, signal the process after its first chunk, run `during_drain`, read the rest."""
    events = []
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**BODY, "max_tokens": max_tokens}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    break
            process.send_signal(stop)
            during_drain()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.mark.parametrize("stop", [signal.SIGTERM])  # SIGINT takes the same handler (tests/server/test_cli.py)
def test_a_stream_in_flight_completes_and_the_process_exits_0(tmp_path, stop):
    process, url, stderr = serve_process(tmp_path, "--shutdown-timeout", "30", hooks=("--pace", PACE))
    refused = {}

    def during_drain():
        time.sleep(0.3)  # the signal is handled between two bytecodes of the server's main thread
        refused["health"] = httpx.get(f"{url}/health", timeout=10)
        refused["new"] = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 1}, timeout=10
        )

    try:
        events = _stream_then_signal(url, process, stop, 60, during_drain)
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    finally:
        process.kill()
    assert refused["health"].status_code == 503
    assert refused["new"].status_code == 503
    assert assert_envelope(refused["new"].json())["type"] == "service_unavailable_error"
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), chunks[-1]
    assert sum(len(c["choices"][0]["text"]) > 0 or c["choices"][0]["finish_reason"] is not None for c in chunks) >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"


def test_a_request_still_being_prepared_when_the_signal_comes_is_served(tmp_path):
    """A request past the server's checks but not yet queued in the engine (its grammar compiling) was not
    counted by the drain, which stopped the engine at once: the request got a 503 "the engine is not running"."""
    process, url, stderr = serve_process(tmp_path, "--shutdown-timeout", "30", hooks=("--slow-grammar", "1.5"))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "response_format": {"type": "json_object"}}
    try:
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            time.sleep(0.5)  # the request is in its 1.5 s compile
            process.send_signal(signal.SIGTERM)
            result = reply.result()
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    finally:
        process.kill()
    assert result.status_code == 200, result.text
    assert result.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_past_the_shutdown_timeout_the_stream_ends_with_an_error_event_and_exit_0(tmp_path):
    process, url, stderr = serve_process(tmp_path, "--shutdown-timeout", "1", hooks=("--pace", PACE))
    try:
        started = time.monotonic()
        events = _stream_then_signal(url, process, signal.SIGTERM, 2000 // 8, lambda: None)
        assert time.monotonic() - started < 30
        assert process.wait(timeout=60) == 0, stderr.read_text()[-3000:]
    finally:
        process.kill()
    assert events[-1] == "[DONE]"
    error = assert_envelope(events[-2])
    assert error["type"] == "service_unavailable_error"


def test_a_second_signal_exits_at_once(tmp_path):
    process, url, stderr = serve_process(tmp_path, "--shutdown-timeout", "60", hooks=("--pace", PACE))
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            with client.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 240}) as response:
                lines = response.iter_lines()  # kept open: closing it would close the connection
                next(line for line in lines if line.startswith("data: {"))
                process.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                assert process.poll() is None  # draining: the stream has 10 s left, the timeout is 60 s
                process.send_signal(signal.SIGTERM)
                assert process.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        process.kill()
