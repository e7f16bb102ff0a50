"""A real uvicorn server on a free loopback port, serving the tiny random model."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import httpx
import openai
import pytest
import uvicorn

from engine.async_engine import AsyncEngine
from server.app import create_app
from server.config.server_config import ServerConfig
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import make_llm
from tests.ports import free_port


@dataclass
class RunningServer:
    base_url: str
    engine: AsyncEngine
    model_name: str
    api_key: str | None = None
    state: object = None  # the app's ServerState
    app: object = None  # the FastAPI app

    def client(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60, **kwargs)

    def sdk(self) -> openai.OpenAI:
        """The openai SDK on this server (no retries: a failure shows as it is)."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60
        )

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is left in the engine and every KV block is free."""
        core = self.engine.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = core.stats()
            if stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle after {timeout} s: {core.stats()}")


def pace_engine(server: RunningServer, monkeypatch, seconds_per_step: float) -> None:
    """Make every engine step of `server` last at least `seconds_per_step` (for the test's duration),
    so that a test's timing does not depend on how fast this machine runs the tiny model."""
    runner = server.engine.engine.runner
    execute = runner.execute

    def slow_execute(scheduler_output):
        time.sleep(seconds_per_step)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", slow_execute)


def start_server(model_dir, server_config: ServerConfig, *, on_engine_death=None, **engine_overrides):
    engine = AsyncEngine(make_llm(model_dir, **engine_overrides).engine)
    return serve_engine(engine, server_config, on_engine_death=on_engine_death)


@contextlib.contextmanager
def serving(model_dir, server_config: ServerConfig, **engine_overrides) -> Iterator[RunningServer]:
    """`start_server` for a `with` block (or a fixture's yield): stopped when it ends."""
    uv, thread, running = start_server(model_dir, server_config, **engine_overrides)
    try:
        yield running
    finally:
        uv.should_exit = True
        thread.join(30)


def serve_engine(engine: AsyncEngine, server_config: ServerConfig, *, on_engine_death=None):
    """uvicorn serving `engine` on a free loopback port, in a thread: (uvicorn server, thread, RunningServer)."""
    port = free_port()
    app = create_app(engine, server_config.model_copy(update={"port": port}), on_engine_death=on_engine_death)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    keys = server_config.api_keys
    running = RunningServer(
        f"http://127.0.0.1:{port}",
        engine,
        app.state.server.served_model_names[0],
        keys[0] if keys else None,
        app.state.server,
        app,
    )
    return server, thread, running


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("server-tiny"), "llama")


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The shared server (no auth). Tests must leave it idle."""
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"))
    yield running
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(autouse=True)
def leaves_engine_idle(request):
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()


def prompt_text(server: RunningServer, **body) -> str:
    """The text of the prompt /tokenize renders from `body` (its tokens read back through /detokenize)."""
    with server.client() as c:
        reply = c.post("/tokenize", json=body)
        assert reply.status_code == 200, reply.text
        return c.post("/detokenize", json={"tokens": reply.json()["tokens"]}).json()["prompt"]
