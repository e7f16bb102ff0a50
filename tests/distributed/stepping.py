"""Driving an engine by hand with an abort in the middle: what the distributed tests compare across layouts."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.engine.references import assert_idle


def tokens_with_an_abort(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, abort_at: int, abort_id: str = "r1"
) -> dict[str, list[int]]:
    """Each request's tokens (requests r0, r1, ...) when `abort_id` is aborted before step `abort_at`; the KV
    cache is empty afterwards."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    for step in range(1000):
        if step == abort_at:
            engine.abort([abort_id])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_work:
            break
    assert_idle(llm)
    return tokens
