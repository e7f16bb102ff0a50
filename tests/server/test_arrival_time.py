"""Arrival time is stamped when the route receives the request, so queue time and time to first token
include tokenization and chat template rendering (DESIGN.md's metrics, vLLM's definitions).

Deterministic: the tokenizer records when it is called, and the request's arrival must not come after
that; no latency threshold is involved.
"""

from __future__ import annotations

import time

import pytest

from engine.text.tokenizer import Tokenizer

CASES = [
    ("/v1/completions", {"prompt": "Once upon a time"}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}, "render_chat"),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 2}, "render_chat"),
]


@pytest.mark.parametrize("path, body, step", CASES, ids=["completions", "chat", "responses"])
def test_arrival_precedes_prompt_processing(server, monkeypatch, path, body, step):
    started: list[float] = []  # when the route began turning the request into token ids
    original = getattr(Tokenizer, step)

    def timed(self, *args, **kwargs):
        started.append(time.monotonic())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, step, timed)
    outputs = []
    observe = server.engine.observer.on_output
    monkeypatch.setattr(server.engine.observer, "on_output", lambda output: (outputs.append(output), observe(output)))

    with server.client() as c:
        response = c.post(
            path, json={"model": "tiny", "temperature": 0, **({"max_tokens": 2} if "input" not in body else {}), **body}
        )
    assert response.status_code == 200, response.text
    (final,) = [output for output in outputs if output.finished]
    metrics = final.metrics
    assert started, f"Tokenizer.{step} was not called"
    assert metrics.arrival_time <= started[0]
    # hence the request's queue time and TTFT span the prompt processing too
    assert metrics.queue_time >= metrics.first_scheduled_time - started[0]
    assert metrics.time_to_first_token >= metrics.first_token_time - started[0]
