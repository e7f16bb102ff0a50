"""A deliberately tiny KV pool: 16 concurrent long requests all complete through preemption, each greedy
output identical to the same request run alone, and the pool is empty afterwards."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.reliability.conftest import assert_gauges_zero, metric, serving

NUM = 16
MAX_TOKENS = 60
NUM_BLOCKS = 48  # x 4 tokens: about three of the 16 requests fit at once


def _body(i: int) -> dict:
    return {
        "model": "tiny",
        "prompt": [20 + i, 30 + i, 40 + i, 50 + i, 60 + i],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # batch-invariant kernels: a request's greedy tokens do not depend on what shares its batch
    with serving(tiny_model_dir, num_blocks=NUM_BLOCKS, batch_invariant=True) as running:
        yield running


def test_preempted_requests_complete_with_their_solo_outputs(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        alone = [client.post("/v1/completions", json=_body(i)).json()["choices"][0]["text"] for i in range(NUM)]
    preemptions_before = metric(server.base_url, "pagedserve_num_preemptions_total")
    queries_before = metric(server.base_url, "pagedserve_prefix_cache_queries_total")
    hits_before = metric(server.base_url, "pagedserve_prefix_cache_hits_total")

    async def together():
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=120, limits=httpx.Limits(max_connections=NUM)
        ) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json=_body(i)) for i in range(NUM)))

    responses = asyncio.run(together())
    assert [r.status_code for r in responses] == [200] * NUM
    assert [r.json()["choices"][0]["text"] for r in responses] == alone
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in responses)
    assert metric(server.base_url, "pagedserve_num_preemptions_total") > preemptions_before
    # The prefix-cache counters count each request's prompt once, as vLLM does: a resumed request's lookup of
    # its own recomputed prompt and output is no prompt served from the cache (it would inflate the hit rate).
    assert metric(server.base_url, "pagedserve_prefix_cache_queries_total") - queries_before == NUM * 5
    assert metric(server.base_url, "pagedserve_prefix_cache_hits_total") - hits_before <= NUM * 4
    assert_gauges_zero(server)


def test_a_prompt_the_whole_cache_cannot_hold_is_refused_naming_the_prompt(server):
    """The pool holds 192 tokens, max_model_len 256: a longer prompt (the chat one: about 200 tokens) never fits,
    whatever max_tokens is. The 400 names the prompt (chat: messages), not a max_tokens the client may not even
    have sent."""
    client = server.sdk()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 200, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert "200" in info.value.message and "192 tokens" in info.value.message
    messages = [{"role": "user", "content": " ".join(["hello"] * 62)}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages)  # no max_tokens: the rest of the context
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    # asking too much beside a prompt that fits is max_tokens' fault, as before
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 100, max_tokens=100)
    assert info.value.param == "max_tokens"
    assert_gauges_zero(server)
