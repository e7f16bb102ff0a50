"""vLLM's flags over what responses hold: --enable-force-include-usage (every stream ends with its usage) and
--return-tokens-as-token-ids (logprobs name tokens by id unless a request says otherwise)."""

from __future__ import annotations

import pytest

from server.config.server_config import ServerConfig
from tests.server.conftest import serving

QUESTION = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ServerConfig(served_model_name="tiny", enable_force_include_usage=True, return_tokens_as_token_ids=True)
    with serving(tiny_model_dir, config) as running:
        yield running


def test_every_stream_ends_with_its_usage(server):
    client = server.sdk()
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert all(chunk.usage is None for chunk in chunks[:-1])
    pieces = list(client.completions.create(model="tiny", prompt="hello", max_tokens=2, stream=True))
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == 2
    assert pieces[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_logprobs_name_tokens_by_id_unless_asked_not_to(server):
    client = server.sdk()
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2, logprobs=True)
    tokens = [entry.token for entry in reply.choices[0].logprobs.content]
    assert all(token.startswith("token_id:") for token in tokens)
    reply = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=2,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": False},
    )
    assert not any(entry.token.startswith("token_id:") for entry in reply.choices[0].logprobs.content)
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=1)
    assert all(token.startswith("token_id:") for token in text.choices[0].logprobs.tokens)
