"""A hybrid Mamba-2 / attention model (Granite 4.0-H) served over HTTP: the openai SDK's streamed and parallel
requests, a client that leaves mid-stream, and the same greedy answer before and after on reused state rows; a
chat's next turn served from the prefix cache (the first turn's recurrent states restored), its answer the one a
cold server gives."""

from __future__ import annotations

import pytest

from server.config.server_config import ServerConfig
from tests.engine.test_hybrid import make_hybrid_dir
from tests.server.conftest import serving


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_hybrid_dir(tmp_path_factory.mktemp("hybrid") / "moe")


@pytest.fixture(scope="module")
def hybrid_server(hybrid_dir):
    with serving(hybrid_dir, ServerConfig(served_model_name="h")) as s:
        yield s


def test_hybrid_model_streams_and_leaves_nothing_behind(hybrid_server):
    sdk = hybrid_server.sdk()
    messages = [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]
    want = sdk.chat.completions.create(model="h", messages=messages, max_tokens=12, temperature=0)
    assert want.usage.completion_tokens == 12
    stream = sdk.chat.completions.create(model="h", messages=messages, max_tokens=40, temperature=0, stream=True)
    for i, _ in enumerate(stream):  # a client that leaves after a few chunks
        if i == 3:
            stream.close()
            break
    hybrid_server.wait_idle()
    both = sdk.chat.completions.create(model="h", messages=messages, max_tokens=12, temperature=0, n=2)
    assert [choice.message.content for choice in both.choices] == [want.choices[0].message.content] * 2
    streamed = sdk.chat.completions.create(model="h", messages=messages, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == want.choices[0].message.content
    hybrid_server.wait_idle()


def test_a_chats_next_turn_hits_the_prefix_cache(hybrid_server, hybrid_dir):
    sdk = hybrid_server.sdk()
    messages = [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence about animals."},
        {"role": "user", "content": "What does the quick brown fox do?"},
    ]
    first = sdk.chat.completions.create(model="h", messages=messages, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the lazy dog?"},
    ]
    second = sdk.chat.completions.create(model="h", messages=messages, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < second.usage.prompt_tokens  # (to a block boundary)
    hybrid_server.wait_idle()
    with serving(hybrid_dir, ServerConfig(served_model_name="h"), enable_prefix_caching=False) as server:
        again = server.sdk().chat.completions.create(model="h", messages=messages, max_tokens=16, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].message.content == second.choices[0].message.content
