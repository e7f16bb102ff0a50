"""End to end: `pagedserve serve --quantization gguf` on the embedded SmolLM2 GGUF: it starts, logs and
exports the quantized weights' footprint, and completes a prompt, with the base and with a llama.cpp LoRA
adapter (`--enable-lora --lora-modules NAME=FILE.gguf`) whose deltas are added beside the Q4_1 products."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import server_environment
from tests.e2e.test_serve_embedded import _wait_for_line

REPO = Path(__file__).resolve().parents[2]


def write_smollm_adapter(path: Path) -> Path:
    """A random rank-4 llama.cpp LoRA adapter over SmolLM2-135M's attn_v and ffn_down (numpy only: no model
    loaded to make it), large enough to change its greedy text."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 4.0)
    for layer in range(30):
        for part, (width, out) in {"attn_v": (576, 192), "ffn_down": (1536, 576)}.items():
            writer.add_tensor(f"blk.{layer}.{part}.weight.lora_a", rng.normal(0, width**-0.5, (4, width)).astype("f4"))
            writer.add_tensor(f"blk.{layer}.{part}.weight.lora_b", rng.normal(0, 0.1, (out, 4)).astype("f4"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory, embedded_checkpoint):
    logs = tmp_path_factory.mktemp("serve-gguf")
    adapter = write_smollm_adapter(logs / "smol-lora.gguf")
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
                "--enable-lora",
                "--lora-modules",
                f"smol={adapter}",
                "--max-lora-rank",
                "8",
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


def test_a_gguf_lora_adapter_over_the_quantized_base(gguf_server):
    url, _ = gguf_server
    logprobs = {}
    for model in ("SmolLM2-135M-Instruct", "smol"):
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{url}/v1/completions", json={**body, "logprobs": 1}, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        logprobs[model] = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    # the deltas reach the output, in the prefill and in the decode step (which, with an adapter, is not the
    # fused native one: that one adds no deltas)
    for base, adapted in zip(logprobs["SmolLM2-135M-Instruct"], logprobs["smol"], strict=True):
        assert abs(adapted - base) > 1e-3, logprobs
    models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert {"id": "smol", "parent": "SmolLM2-135M-Instruct"}.items() <= next(
        m for m in models if m["id"] == "smol"
    ).items()
