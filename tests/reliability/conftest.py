"""Servers for the reliability tests: real uvicorn on loopback, the tiny model, limits set per test."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.config.server_config import ServerConfig
from tests.server.conftest import RunningServer, pace_engine, start_server  # noqa: F401 - re-exported
from tests.conftest import server_environment
from tests.engine.factories import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
TINY_PRESET = REPO / "configs" / "tiny.yaml"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("reliability-tiny"), "llama")


@contextlib.contextmanager
def serving(
    model_dir, config: Optional[ServerConfig] = None, *, on_engine_death=None, **engine_overrides
) -> Iterator[RunningServer]:
    """A server of its own for one test; stopped (and checked idle, unless the engine died) afterwards."""
    config = (config or ServerConfig()).model_copy(update={"served_model_name": "tiny"})
    uv, thread, running = start_server(model_dir, config, on_engine_death=on_engine_death, **engine_overrides)
    try:
        yield running
        if running.engine.error is None:
            running.wait_idle()
    finally:
        uv.should_exit = True
        thread.join(30)


def metric(base_url: str, name: str, **labels) -> float:
    """A sample's value on /metrics (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def assert_gauges_zero(server: RunningServer) -> None:
    server.wait_idle()
    for name in (
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage_ratio",
    ):
        assert metric(server.base_url, name) == 0, name
    admission = server.state.admission
    assert (admission.num_requests, admission.num_tokens) == (0, 0)


def assert_envelope(body: dict) -> dict:
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def sse_payloads(lines) -> list:
    """The `data:` payloads of an SSE stream ("[DONE]" kept as the string)."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def serve_process(
    tmp_path, *args: str, hooks: tuple[str, ...] = (), new_session: bool = False
) -> tuple[subprocess.Popen, str, Path]:
    """`pagedserve serve` on the tiny preset in a child process (through tests/reliability/serve_with_hooks.py
    when `hooks` are given); returns the process, its URL and its stderr file, once it is ready. `new_session`:
    the process leads a process group of its own, as a terminal's foreground job (`os.killpg` reaches it and
    whatever it started, never the tests)."""
    env = server_environment()
    stdout, stderr = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    command = [
        sys.executable,
        "-m",
        "tests.reliability.serve_with_hooks",
        *hooks,
        "--",
        "serve",
        "--config",
        str(TINY_PRESET),
        "--served-model-name",
        "tiny",
        *args,
    ]
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=new_session)
    deadline = time.monotonic() + 120
    while "curl " not in stdout.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"server did not start:\n{stderr.read_text()[-3000:]}")
        time.sleep(0.1)
    url = stdout.read_text().split(" at ", 1)[1].split("/v1", 1)[0]
    return process, url, stderr
