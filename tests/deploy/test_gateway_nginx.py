"""The gateway: a real nginx (Debian's, a plain process on 127.0.0.1) running the shipped deploy/nginx/
configuration (addresses and /tmp paths rewritten) in front of two real `pagedserve serve` replicas:
least-connections balancing, SSE streamed through unbuffered, the per-key rate limit's 429 in OpenAI's
envelope with Retry-After, JSON access logs, and a replica stopped mid-run failing over new requests only."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.deploy.tools import DEPLOY, require_binary, start_replicas, stop, wait_for_port
from tests.ports import free_port

pytestmark = pytest.mark.timeout(300)

NGINX = DEPLOY / "nginx"
LONG = {"max_tokens": 1500, "ignore_eos": True, "temperature": 0}  # a stream of seconds, caught in flight
REPLICA_FLAGS = ("--max-model-len", "2048", "--num-kv-blocks", "2048")


@pytest.fixture(scope="module")
def replicas(deploy_model_dir, tmp_path_factory):
    started = start_replicas(deploy_model_dir, tmp_path_factory.mktemp("gateway-replicas"), *REPLICA_FLAGS)
    yield started
    for replica in started:
        stop(replica.process)


def render_config(work: Path, port: int, upstreams: list[int]) -> Path:
    """deploy/nginx/nginx.conf with its listen address, replica addresses and paths made local."""
    text = (NGINX / "nginx.conf").read_text()
    servers = re.findall(r"server (\S+) ", text)
    assert servers == ["pagedserve:8000", "pagedserve-2:8000"]
    for server, upstream in zip(servers, upstreams):
        text = text.replace(f"server {server} ", f"server 127.0.0.1:{upstream} ")
    text = text.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    directives = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    assert set(re.findall(r"(/(?:etc|tmp|var)/\S*?)[^/]*;", directives)) == {"/etc/nginx/pagedserve/", "/tmp/"}
    # /tmp first: the checkout itself may lie under /tmp
    text = text.replace("/tmp/", f"{work}/").replace("/etc/nginx/pagedserve/", f"{NGINX}/")
    path = work / "nginx.conf"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def gateway(replicas, tmp_path_factory):
    binary = require_binary("nginx", "nginx")
    work = tmp_path_factory.mktemp("nginx")
    port = free_port()
    config = render_config(work, port, [replica.port for replica in replicas])
    check = subprocess.run(
        [binary, "-t", "-p", str(work), "-c", str(config)], capture_output=True, text=True, timeout=30, check=False
    )
    assert check.returncode == 0, check.stderr
    access, errors = work / "access.log", work / "error.log"
    with access.open("w") as out, errors.open("w") as err:
        process = subprocess.Popen(
            [binary, "-p", str(work), "-c", str(config), "-g", "daemon off;"], stdout=out, stderr=err
        )
    try:
        wait_for_port(port, process, 30, errors)
        yield f"http://127.0.0.1:{port}", access
    finally:
        stop(process, signal.SIGQUIT)  # nginx's graceful stop


def access_log(path: Path) -> list[dict]:
    """Every line must be one JSON object (escape=json)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def new_entries(path: Path, before: int, count: int, timeout: float = 10) -> list[dict]:
    """The access log's entries after the first `before`, once there are `count` of them (nginx logs a
    request just after answering it)."""
    deadline = time.monotonic() + timeout
    while len(entries := access_log(path)[before:]) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return entries


def completion(client: httpx.Client, key: str, **extra) -> httpx.Response:
    return client.post(
        "/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, **extra},
    )


def test_requests_are_spread_over_both_replicas(gateway, replicas):
    url, log = gateway
    before = len(access_log(log))
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(6):
            assert completion(client, "balance").status_code == 200
    upstreams = [entry["upstream_addr"] for entry in new_entries(log, before, 6)]
    assert len(upstreams) == 6
    assert set(upstreams) == {f"127.0.0.1:{replica.port}" for replica in replicas}


def _events(stream):
    """The stream's `data:` lines, one iterator for the whole stream (dropping a partly read iterator
    would close the connection: the server would see the client go away)."""
    return (line for line in stream.iter_lines() if line.startswith("data: "))


def test_least_connections_and_streaming_through_the_proxy(gateway, replicas):
    """While a long stream holds one replica, the next stream goes to the other; events reach the client
    while the replica is still generating (nginx does not buffer the stream)."""
    url, _ = gateway
    body = {"model": "tiny", "prompt": "once upon a time", "stream": True, **LONG}
    with (
        httpx.Client(base_url=url, timeout=120) as first_client,
        httpx.Client(base_url=url, timeout=120) as second_client,
    ):
        with first_client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200 and first.headers["content-type"].startswith("text/event-stream")
            first_events = _events(first)
            assert json.loads(next(first_events)[6:])["choices"][0]["text"] is not None
            running = [replica.metric("pagedserve_num_requests_running") for replica in replicas]
            assert sorted(running) == [0, 1], "the first event arrived before the request finished"
            busy = running.index(1)
            with second_client.stream("POST", "/v1/completions", json=body) as second:
                second_events = _events(second)
                next(second_events)
                running = [replica.metric("pagedserve_num_requests_running") for replica in replicas]
                assert running == [1, 1], "least_conn sends the second stream to the idle replica"
                rest = list(second_events)
            events = list(first_events)
    assert events[-1] == "data: [DONE]" and rest[-1] == "data: [DONE]"
    chunks = [json.loads(event[6:]) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) >= LONG["max_tokens"] // 2, "a long stream came through as many events"
    assert replicas[busy].metric("pagedserve_num_requests_running") == 0


def test_rate_limit_answers_429_in_the_openai_envelope(gateway):
    url, log = gateway
    with httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_connections=60)) as client:

        def models(_):
            return client.get("/v1/models", headers={"Authorization": "Bearer burst-key"})

        with ThreadPoolExecutor(60) as pool:
            replies = list(pool.map(models, range(60)))
        statuses = [reply.status_code for reply in replies]
        assert set(statuses) == {200, 429}, statuses
        assert statuses.count(200) >= 21, statuses  # the burst of 20 (+1) passes, and what 10 r/s refills meanwhile
        limited = next(reply for reply in replies if reply.status_code == 429)
        assert limited.headers["retry-after"] == "1"
        assert limited.headers["content-type"] == "application/json"
        error = limited.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert set(error) == {"message", "type", "param", "code"} and error["param"] is None
        # per key: another key (and the health check) pass at once
        assert client.get("/v1/models", headers={"Authorization": "Bearer another-key"}).status_code == 200
        assert client.get("/health").status_code == 200
        # /metrics is per replica: not through the gateway
        metrics = client.get("/metrics")
        assert metrics.status_code == 404 and metrics.json()["error"]["type"] == "not_found_error"
    entries = access_log(log)
    assert any(entry["status"] == 429 and entry["rate_limited"] == "yes" for entry in entries)
    assert all("burst-key" not in json.dumps(entry) for entry in entries), "keys are never logged"


def test_a_stopped_replica_fails_over_new_requests_only(gateway, replicas):
    """SIGTERM to the replica serving a stream: the stream (already under way) ends normally, and every
    request after it is served by the other replica, none failing."""
    url, log = gateway
    body = {"model": "tiny", "prompt": "a long story", "stream": True, **LONG}
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            events = _events(stream)
            next(events)
            running = [replica.metric("pagedserve_num_requests_running") for replica in replicas]
            assert sorted(running) == [0, 1]
            doomed, survivor = replicas[running.index(1)], replicas[running.index(0)]
            stopper = threading.Thread(target=stop, args=(doomed.process, signal.SIGTERM))
            stopper.start()
            events = list(events)
        stopper.join(timeout=90)
        assert doomed.process.poll() is not None, "the stopped replica exited"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"

        before = len(access_log(log))
        for index in range(6):
            reply = completion(client, "after-stop", seed=index)
            assert reply.status_code == 200, reply.text
        after = new_entries(log, before, 6)
        assert [entry["status"] for entry in after] == [200] * 6
        # the last upstream of each request is the survivor (a first try at the stopped one is retried)
        assert {entry["upstream_addr"].split(", ")[-1] for entry in after} == {f"127.0.0.1:{survivor.port}"}

        # with no replica left, nginx answers 503 in the envelope
        stop(survivor.process)
        reply = completion(client, "after-stop")
        assert reply.status_code == 503 and reply.headers["retry-after"] == "5"
        assert reply.json()["error"]["type"] == "service_unavailable_error"
