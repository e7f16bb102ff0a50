"""tool_choice "required" on the embedded SmolLM2 behind a real server on 127.0.0.1, with the openai SDK: the
README's weather call ends after one call when parallel_tool_calls is false, and streamed, its arguments arrive in
pieces as they are generated."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server.config.server_config import ServerConfig
from tests.server.conftest import start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = dict(
    model="smol",
    messages=[{"role": "user", "content": "Weather in Oslo?"}],
    tools=[WEATHER],
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=0,
    max_tokens=60,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(embedded_checkpoint):
    uv, thread, running = start_server(
        embedded_checkpoint.path,
        ServerConfig(served_model_name="smol"),
        block_size=16,
        num_blocks=64,
        max_model_len=1024,
    )
    yield openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    uv.should_exit = True
    thread.join(30)


def test_one_call_without_parallel_calls(client):
    reply = client.chat.completions.create(**ASK)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and reply.usage.completion_tokens < 40
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_streamed_arguments_arrive_in_pieces(client):
    whole = client.chat.completions.create(**ASK).choices[0].message.tool_calls[0]
    pieces, names = [], []
    for chunk in client.chat.completions.create(stream=True, **ASK):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                names.append(delta.function.name)
            elif delta.function.arguments:
                pieces.append(delta.function.arguments)
    assert names == ["get_weather"] and len(pieces) >= 3, pieces
    assert "".join(pieces) == whole.function.arguments
