"""Security defaults: no key and no prompt or completion text in the logs at the default level (info);
--metrics-require-auth puts /metrics behind the API key."""

from __future__ import annotations

import logging

import httpx
import pytest

from server.config.server_config import ServerConfig
from tests.reliability.conftest import serving

KEY = "sk-very-secret-key-0042"
SECRET_TEXT = "zebra-confidential-prompt"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(api_keys=[KEY], metrics_require_auth=True)) as running:
        yield running


def test_metrics_need_the_key_with_metrics_require_auth(server):
    assert httpx.get(f"{server.base_url}/metrics", timeout=10).status_code == 401
    scraped = httpx.get(f"{server.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert scraped.status_code == 200 and "pagedserve_" in scraped.text
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200  # probes stay open


def test_no_key_and_no_text_in_the_logs_at_the_default_level(server, caplog):
    auth = {"Authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.INFO):
        with httpx.Client(base_url=server.base_url, timeout=30, headers=auth) as client:
            done = client.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": SECRET_TEXT,
                    "max_tokens": 8,
                    "temperature": 0,
                    "unknown_field_x": SECRET_TEXT,
                },
            )
            completion = done.json()["choices"][0]["text"]
            client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": SECRET_TEXT}], "max_tokens": 4, "stream": True},
            )
            client.post("/v1/completions", json={"prompt": SECRET_TEXT, "max_tokens": 100000})  # a 400
            client.post("/v1/completions", json={"prompt": SECRET_TEXT, "n": 0})  # a 400 on n
            client.post("/tokenize", json={"prompt": SECRET_TEXT})
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": SECRET_TEXT},
            headers={"Authorization": "Bearer wrong-" + KEY},
            timeout=10,
        )
    server.wait_idle()
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert KEY not in logged
    assert SECRET_TEXT not in logged
    assert completion.strip() == "" or completion not in logged
