"""Soak: mixed traffic against a real `pagedserve serve` for N minutes, then the figures that matter.

    python scripts/soak.py --minutes 10                 # the embedded model (configs/default.yaml)
    python scripts/soak.py --minutes 2 --serve-args "--model /path/to/ckpt --max-num-seqs 8"

Traffic: streaming and not, /v1/completions and /v1/chat/completions, random prompt and output
lengths, 10% of clients disconnecting early, and every 60 s a burst past the queue bound (429s are
expected there). Printed: requests served, errors by kind, p50/p99 latency, the server's RSS after
warm-up and at the end, KV usage once idle, the exit status after SIGTERM. Not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SERVE_ARGS = "--config configs/default.yaml --kv-cache-memory 256MiB --max-num-seqs 8 --max-queued-requests 16"
WORDS = "the of and to in is was it for on with as his that by at from this be not are or which an".split()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def start_server(serve_args: str, logs: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    keep = {"PAGEDSERVE_CACHE_DIR"}  # the converted model and the built kernels, where this machine keeps them
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_") or k in keep}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra_env)
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    command = [sys.executable, "-m", "server.cli", "serve", "--port", "0", *shlex.split(serve_args)]
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=REPO)
    deadline = time.monotonic() + 600
    while "curl " not in stdout.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{stderr.read_text()[-3000:]}")
        time.sleep(0.2)
    return process, stdout.read_text().split(" at ", 1)[1].split("/v1", 1)[0]


class Tally:
    def __init__(self):
        self.kinds: Counter = Counter()
        self.latencies: list[float] = []

    def add(self, kind: str, seconds: float | None = None) -> None:
        self.kinds[kind] += 1
        if seconds is not None:
            self.latencies.append(seconds)


def random_body(rng: random.Random, model: str, stream: bool) -> tuple[str, dict]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 200)))
    common = {
        "model": model,
        "max_tokens": rng.randint(1, 48),
        "stream": stream,
        "temperature": rng.choice([0, 0.7, 1.0]),
    }
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": words}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": words}]}


async def one_request(
    client: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally, disconnect: bool
) -> None:
    route, body = random_body(rng, model, stream=rng.random() < 0.5)
    started = time.monotonic()

    async def call() -> None:
        async with client.stream("POST", route, json=body) as response:
            raw = (await response.aread()).decode()
        status = response.status_code
        if status == 200 and body["stream"]:
            errors = [e for e in raw.split("\n") if e.startswith('data: {"error"')]
            kind = f"stream error event ({json.loads(errors[0][6:])['error']['type']})" if errors else "200"
            if not raw.rstrip().endswith("data: [DONE]"):
                kind = "stream without [DONE]"
        else:
            kind = str(status)
        tally.add(kind, time.monotonic() - started if kind == "200" else None)

    if disconnect:
        try:
            await asyncio.wait_for(call(), rng.uniform(0.05, 1.0))
            return
        except asyncio.TimeoutError:
            tally.add("client disconnect (intended)")
            return
    try:
        await call()
    except httpx.HTTPError as exc:
        tally.add(f"transport error ({type(exc).__name__})")


async def traffic(
    url: str, model: str, minutes: float, workers: int, burst: int, tally: Tally, on_warm, on_sample
) -> None:
    end = time.monotonic() + minutes * 60
    warm_at = time.monotonic() + min(60.0, minutes * 6)  # RSS "at start": after a minute of traffic
    limits = httpx.Limits(max_connections=workers + burst + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                await one_request(client, rng, model, tally, disconnect=rng.random() < 0.10)

        async def bursts() -> None:
            rng = random.Random(12345)
            while time.monotonic() + 60 < end:
                await asyncio.sleep(60)
                await asyncio.gather(*(one_request(client, rng, model, tally, False) for _ in range(burst)))

        async def warm_marker() -> None:
            await asyncio.sleep(max(warm_at - time.monotonic(), 0))
            on_warm()

        async def sampler() -> None:
            while time.monotonic() < end:
                on_sample()
                await asyncio.sleep(min(60.0, max(minutes * 6, 5.0)))

        await asyncio.gather(*(worker(i) for i in range(workers)), bursts(), warm_marker(), sampler())


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            key = sample.name + "".join(f",{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            values[key] = sample.value
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--workers", type=int, default=12, help="clients sending back to back")
    parser.add_argument("--burst", type=int, default=48, help="requests in each burst (past the queue bound)")
    parser.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS)
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the server (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )
    args = parser.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
    process, url = start_server(args.serve_args, logs, dict(item.split("=", 1) for item in args.server_env))
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    rss = {"ready": rss_bytes(process.pid)}
    timeline: list[tuple[float, int]] = []
    tally = Tally()
    started = time.monotonic()
    try:
        asyncio.run(
            traffic(
                url,
                model,
                args.minutes,
                args.workers,
                args.burst,
                tally,
                lambda: rss.__setitem__("warm", rss_bytes(process.pid)),
                lambda: timeline.append((time.monotonic() - started, rss_bytes(process.pid))),
            )
        )
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            metrics = scrape(url)
            if (
                metrics.get("pagedserve_num_requests_running", 1)
                == metrics.get("pagedserve_num_requests_waiting", 1)
                == 0
            ):
                break
            time.sleep(0.5)
        rss["end"] = rss_bytes(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            status = process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            status = "killed after 120 s"
    latencies = sorted(tally.latencies)
    warm = rss.get("warm", rss["ready"])
    five_xx = sum(n for kind, n in tally.kinds.items() if kind.startswith("5"))
    print(f"soak: {elapsed / 60:.1f} min against {model} ({args.serve_args})")
    print(f"requests sent: {sum(tally.kinds.values())}, served (200, complete): {tally.kinds['200']}")
    print("outcomes: " + ", ".join(f"{kind}: {n}" for kind, n in sorted(tally.kinds.items())))
    if latencies:
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
        print(f"latency of served requests: p50 {statistics.median(latencies):.2f} s, p99 {p99:.2f} s")
    print(
        f"server RSS: {rss['ready'] / 2**20:.0f} MiB when ready, {warm / 2**20:.0f} MiB after warm-up, "
        f"{rss['end'] / 2**20:.0f} MiB at the end ({(rss['end'] - warm) / warm * 100:+.1f}% since warm-up)"
    )
    print("server RSS over time: " + ", ".join(f"{t / 60:.1f} min {b / 2**20:.0f} MiB" for t, b in timeline))
    print(
        f"at the end: KV usage {metrics.get('pagedserve_kv_cache_usage_ratio')}, running "
        f"{metrics.get('pagedserve_num_requests_running')}, waiting {metrics.get('pagedserve_num_requests_waiting')}, "
        f"preemptions {metrics.get('pagedserve_num_preemptions_total')}, "
        f"rejected (queue_full) {metrics.get('pagedserve_request_rejected_total,reason=queue_full', 0)}"
    )
    print(f"5xx: {five_xx}; exit status after SIGTERM: {status}; server logs in {logs}")
    return 0 if five_xx == 0 and metrics.get("pagedserve_kv_cache_usage_ratio") == 0 and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
