"""End to end: `pagedserve serve --quantization gguf` on the embedded SmolLM2 GGUF: it starts, logs and
exports the quantized weights' footprint, and completes a prompt."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import server_environment
from tests.e2e.test_serve_embedded import _wait_for_line

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory, embedded_checkpoint):
    logs = tmp_path_factory.mktemp("serve-gguf")
    stdout, stderr = logs / "stdout.txt", logs / "stderr.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--quantization",
                "gguf",
                "--port",
                "0",
                "--kv-cache-memory",
                "32MiB",
                "--max-model-len",
                "256",
                "--max-num-seqs",
                "4",
            ],
            stdout=out,
            stderr=err,
            env=server_environment(),
            cwd=REPO,
        )
    try:
        printed = _wait_for_line(stdout, "curl ", process, timeout=300)
        yield printed.split(" at ", 1)[1].split("/v1", 1)[0].strip(), stderr
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)


def test_serves_with_quantized_weights(gguf_server):
    url, stderr = gguf_server
    assert "quantization gguf" in stderr.read_text()  # the footprint line at start-up
    metrics = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)}
    (sample,) = metrics["pagedserve_model_weight_bytes"].samples
    assert sample.labels["quantization"] == "gguf" and 90e6 < sample.value < 100e6
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
