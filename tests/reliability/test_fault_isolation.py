"""A fault in one request (NaN logits, its sampling, its text) fails that request alone: its client gets an
error, every other request completes with the tokens it would have had, the engine keeps running."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.reliability.conftest import assert_envelope, assert_gauges_zero, metric, serving, sse_payloads

POISON = "poison"  # request_id prefix of the request the injector breaks
PROMPTS = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
MAX_TOKENS = 12


class Injector:
    """The engine's test-only FaultInjector: breaks the request whose id starts with POISON."""

    def __init__(self, kind: str):
        self.kind = kind

    def on_logits(self, logits, request_ids):
        for row, request_id in enumerate(request_ids):
            if request_id.startswith(POISON):
                if self.kind == "nan":
                    logits[row, 7] = float("nan")
                elif self.kind == "sampling":
                    raise RuntimeError("injected sampling failure")

    def on_detokenize(self, request_id):
        if self.kind == "detokenize" and request_id.startswith(POISON):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir) as running:
        yield running


def _body(prompt, **extra):
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, **extra}


async def _run_all(base_url: str, stream_poison: bool, temperature: float):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:

        async def healthy(prompt):
            return (await client.post("/v1/completions", json=_body(prompt))).json()

        async def poisoned():
            body = {**_body([40, 41, 42], request_id=f"{POISON}-1", stream=stream_poison), "temperature": temperature}
            if not stream_poison:
                return await client.post("/v1/completions", json=body)
            async with client.stream("POST", "/v1/completions", json=body) as response:
                return sse_payloads([line async for line in response.aiter_lines()])

        return await asyncio.gather(poisoned(), *(healthy(p) for p in PROMPTS))


@pytest.mark.parametrize(
    "kind,stream,temperature",
    [("nan", False, 0.0), ("nan", True, 1.0), ("sampling", True, 0.0), ("detokenize", False, 0.0)],
)
def test_a_fault_in_one_request_fails_it_alone(server, kind, stream, temperature):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        alone = [client.post("/v1/completions", json=_body(p)).json()["choices"][0]["text"] for p in PROMPTS]
    errors_before = metric(server.base_url, "pagedserve_request_failure_total", reason="error")
    core = server.engine.engine
    core.fault_injector = Injector(kind)
    try:
        poisoned, *others = asyncio.run(_run_all(server.base_url, stream, temperature))
    finally:
        core.fault_injector = None
    if stream:
        assert poisoned[-1] == "[DONE]"
        error = assert_envelope(poisoned[-2])
    else:
        assert poisoned.status_code == 500
        error = assert_envelope(poisoned.json())
    assert error["code"] == "generation_failed" and error["type"] == "internal_server_error"
    assert [o["choices"][0]["text"] for o in others] == alone
    assert all(o["usage"]["completion_tokens"] == MAX_TOKENS for o in others)
    assert server.engine.is_alive
    assert metric(server.base_url, "pagedserve_request_failure_total", reason="error") == errors_before + 1
    assert_gauges_zero(server)


def test_nonfinite_rows_are_exact_including_overflowing_sums():
    import warnings

    import torch

    from engine.runner.fault_isolation import _nonfinite_rows

    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[1.0, nan, 2.0], [-inf, 0.0, 1.0], [1.0, 2.0, 3.0], [3e38, 3e38, -1.0], [inf, -inf, 0.0]])
    expected = [True, True, False, False, True]  # row 3 sums to inf, yet every entry is finite
    for dtype in (torch.float32, torch.bfloat16):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an overflowing or non-finite sum is what the check looks for
            found = _nonfinite_rows(logits.to(dtype))
        assert found is not None and found.tolist() == expected
        assert _nonfinite_rows(logits[2:4].to(dtype)) is None  # all finite: nothing made
