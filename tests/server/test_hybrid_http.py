"""A hybrid Mamba-2 / attention model (Granite 4.0-H) served over HTTP: the openai SDK's streamed and parallel
requests, a client that leaves mid-stream, and the same greedy answer before and after on reused state rows."""

from __future__ import annotations

import pytest

from server.config.server_config import ServerConfig
from tests.engine.test_hybrid import make_hybrid_dir
from tests.server.conftest import serving


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory):
    with serving(make_hybrid_dir(tmp_path_factory.mktemp("hybrid") / "moe"), ServerConfig(served_model_name="h")) as s:
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
