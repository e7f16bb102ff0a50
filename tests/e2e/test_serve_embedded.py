"""End to end: `pagedserve serve --config configs/default.yaml` (what `make serve` runs) on the
embedded SmolLM2, driven by the real openai SDK and scraped like Prometheus would."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import server_environment

REPO = Path(__file__).resolve().parents[2]


def _wait_for_line(path: Path, needle: str, process: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if needle in text:
            return text
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"server did not print {needle!r}")


@pytest.fixture(scope="module")
def embedded_server(tmp_path_factory, embedded_checkpoint):
    logs = tmp_path_factory.mktemp("serve")
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    env = server_environment()
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--config",
                "configs/default.yaml",
                "--port",
                "0",
                "--kv-cache-memory",
                "256MiB",
                "--max-num-seqs",
                "8",
            ],
            stdout=out,
            stderr=err,
            env=env,
            cwd=REPO,
        )
    try:
        printed = _wait_for_line(stdout, "curl ", process, timeout=300)
        url = printed.split(" at ", 1)[1].split("/v1", 1)[0].strip()
        yield url, printed, stderr
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def test_ready_banner_and_capacity_log(embedded_server):
    url, printed, stderr = embedded_server
    assert url.startswith("http://127.0.0.1:")
    assert "curl " in printed and "/v1/" in printed
    assert "tokens" in stderr.read_text()  # the KV capacity in tokens is logged at start-up
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_openai_sdk_chat_and_completion(embedded_server):
    url, _, _ = embedded_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    # "What is the capital of France?" alone opens with a near tie (0.08 nats in fp32 between "The" and "L",
    # below bf16's logit resolution): this wording leads every token by 0.86+ nats in fp32 and bf16
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 16 and chat.usage.prompt_tokens > 10
    stream = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert "5" in text


def test_metrics_after_traffic(embedded_server):
    url, _, _ = embedded_server
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = (("finished_reason", "length"), ("model_name", "SmolLM2-135M-Instruct"))
    successes = sum(v for (name, lbl), v in samples.items() if name == "pagedserve_request_success_total")
    assert successes >= 2
    assert samples.get(("pagedserve_kv_cache_usage_ratio", (("model_name", "SmolLM2-135M-Instruct"),))) == 0
    assert samples.get(("pagedserve_request_success_total", labels), 0) >= 1
