"""POST /v1/responses with the real openai SDK (tiny random model): text, instructions, message lists, text.format,
function tools and their follow-up turn, max_output_tokens, and the refusals. Streaming is in
test_responses_stream.py."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import pace_engine

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
PARAMS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "tags", "score"],
    "additionalProperties": False,
}


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_twin(server, messages: list[dict], **kwargs):
    """The chat completion of the same conversation: the Responses route must render and sample as chat does."""
    return sdk(server).chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_string_input_gives_a_message_item(server):
    response = sdk(server).responses.create(model=MODEL, input="Hello there", max_output_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.status in ("completed", "incomplete")
    assert (response.completed_at is not None) == (response.status == "completed")
    assert response.temperature == 0 and response.top_p == 1.0  # what it ran with: top_p the default
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    twin = chat_twin(server, [{"role": "user", "content": "Hello there"}], max_tokens=12)
    assert response.output_text == twin.choices[0].message.content
    usage = response.usage
    assert usage.input_tokens == twin.usage.prompt_tokens
    assert usage.output_tokens == twin.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_are_the_system_message(server):
    client = sdk(server)
    response = client.responses.create(
        model=MODEL, instructions="Answer in French.", input="Hi", max_output_tokens=10, temperature=0
    )
    twin = chat_twin(
        server, [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}], max_tokens=10
    )
    assert response.instructions == "Answer in French."
    assert response.usage.input_tokens == twin.usage.prompt_tokens
    assert response.output_text == twin.choices[0].message.content
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    assert plain.usage.input_tokens < response.usage.input_tokens


def test_message_list_with_input_text_parts(server):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Another?"},
    ]
    response = sdk(server).responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)
    twin = chat_twin(
        server,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ],
        max_tokens=10,
    )
    assert response.usage.input_tokens == twin.usage.prompt_tokens
    assert response.output_text == twin.choices[0].message.content


def test_max_output_tokens_gives_incomplete(server):
    response = sdk(server).responses.create(
        model=MODEL, input="Count.", max_output_tokens=5, extra_body={"ignore_eos": True}
    )
    assert response.status == "incomplete" and response.completed_at is None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5 and response.max_output_tokens == 5
    assert response.output[0].status == "incomplete"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_text_format_json_schema_validates(server, temperature):
    response = sdk(server).responses.create(
        model=MODEL,
        input="Describe it.",
        max_output_tokens=200,
        temperature=temperature,
        extra_body={"seed": 3},
        text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema"


def test_text_format_json_object(server):
    response = sdk(server).responses.create(
        model=MODEL,
        input="JSON please.",
        max_output_tokens=150,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(response.output_text), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_tool_choice_gives_function_call_items(server, tool_choice):
    response = sdk(server).responses.create(
        model=MODEL,
        input="What's the weather?",
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 2},
    )
    assert response.status == "completed" and response.output
    for item in response.output:
        assert item.type == "function_call"
        assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.status == "completed"
        jsonschema.validate(json.loads(item.arguments), PARAMS[item.name])
    if isinstance(tool_choice, dict):
        assert [item.name for item in response.output] == ["get_time"]
    assert response.tools[0].name == "get_weather"


class Forecast(pydantic.BaseModel):
    summary: str = pydantic.Field(max_length=10)


@pytest.mark.parametrize("stream", [False, True])
def test_text_format_beside_a_forced_call_is_taken(server, stream):
    """instructor's RESPONSES_TOOLS mode sends its output type as text.format beside the tool it names in
    tool_choice (OpenAI and vLLM take both): the call is the output. It was a 400 ("text.format and tool_choice
    required or named each constrain the output; use one.")."""
    client = sdk(server)
    kwargs = dict(
        model=MODEL,
        input="What's the weather?",
        text_format=Forecast,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 2},
    )
    if stream:
        with client.responses.stream(**kwargs) as events:
            for _ in events:
                pass
            response = events.get_final_response()
    else:
        response = client.responses.parse(**kwargs)
    assert response.status == "completed" and response.output_parsed is None
    assert [item.type for item in response.output] == ["function_call"]
    assert response.output[0].name == "get_time"
    jsonschema.validate(json.loads(response.output[0].arguments), PARAMS["get_time"])
    assert response.text.format.type == "json_schema"


def test_function_call_output_follow_up_turn(server):
    call = {
        "type": "function_call",
        "call_id": "call_7",
        "name": "get_weather",
        "arguments": '{"city": "Oslo", "days": 2}',
    }
    result = {"type": "function_call_output", "call_id": "call_7", "output": '{"temp": 3}'}
    items = [{"role": "user", "content": "Weather in Oslo?"}, call, result]
    response = sdk(server).responses.create(
        model=MODEL, input=items, tools=[WEATHER], max_output_tokens=8, temperature=0
    )
    assert response.status in ("completed", "incomplete") and response.output
    chat_tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    twin = chat_twin(
        server,
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_7",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_7", "content": '{"temp": 3}'},
        ],
        tools=chat_tools,
        max_tokens=8,
    )
    assert response.usage.input_tokens == twin.usage.prompt_tokens


def test_vllm_extras_constrain_as_on_chat(server):
    response = sdk(server).responses.create(
        model=MODEL,
        input="A code:",
        max_output_tokens=20,
        temperature=1.0,
        extra_body={"guided_regex": "[A-Z]{3}[0-9]{2}", "seed": 1},
    )
    assert re.fullmatch("[A-Z]{3}[0-9]{2}", response.output_text) and response.status == "completed"


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError):
        sdk(server).responses.create(model="gpt-4o", input="Hi", max_output_tokens=2)


def test_created_at_is_when_the_request_came(server, monkeypatch):
    """30 steps of at least 100 ms: created_at is the second the request came in, not the one the response was
    written in, 3 s later (incomplete, so without a completed_at to compare it with)."""
    pace_engine(server, monkeypatch, 0.1)
    sent = time.time()
    response = sdk(server).responses.create(
        model=MODEL, input="Hi", max_output_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert time.time() - sent >= 3
    assert int(sent) <= response.created_at <= int(sent) + 1


def test_store_is_answered_false(server):
    response = sdk(server).responses.create(
        model=MODEL, input="Hi", max_output_tokens=1, store=True, metadata={"k": "v"}
    )
    assert response.model_extra["store"] is False and response.metadata == {"k": "v"}


@pytest.mark.parametrize(
    "call",
    [
        lambda client, id_: client.responses.retrieve(id_),
        lambda client, id_: client.responses.delete(id_),
        lambda client, id_: client.responses.cancel(id_),
        lambda client, id_: client.responses.input_items.list(id_),
    ],
    ids=["retrieve", "delete", "cancel", "input_items"],
)
def test_a_created_response_is_not_stored_and_the_404_says_so(server, call):
    """(These paths were not routed: a bare "Not Found" that did not tell a stateless server from a wrong URL.)"""
    client = sdk(server)
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError) as raised:
        call(client, response.id)
    error = raised.value.body
    assert error["param"] == "response_id" and response.id in error["message"] and "stores no" in error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"truncation": "auto"}, "truncation"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(server, body, param):
    with server.client() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 5, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "unsupported_parameter"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "name": "f", "parameters": {"not": {}}}], "tool_choice": "required"},
            "tools[0].parameters",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "[0-9]+"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"guided_regex": "[0-9]+", "text": {"format": {"type": "json_object"}}}, "guided_regex"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        # as the Responses API spells them, not as the chat path does (messages[0].tool_calls[0]..., .function.name)
        (
            {
                "input": [
                    {"role": "user", "content": "Hi"},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                ]
            },
            "input[1].arguments",
        ),
        ({"tools": [TIME, TIME]}, "tools[1].name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ],
)
def test_bad_values_are_400s_naming_the_field(server, body, param):
    with server.client() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert '"function": {' not in r.json()["error"]["message"]  # (chat's shape of a named tool_choice)


def test_a_tool_choice_of_no_kind_shows_the_responses_shape(server):
    with server.client() as http:
        r = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "tools": [WEATHER], "tool_choice": "any"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert '{"type": "function", "name": ...}' in r.json()["error"]["message"]


@pytest.mark.parametrize("reasoning", [{}, {"effort": None}, {"effort": None, "summary": None}])
def test_a_reasoning_object_that_asks_for_nothing_is_taken(server, reasoning):
    """Agent SDKs send `reasoning: {}` or one of nulls by default: that asks for nothing, so it is not refused
    (a set effort still is, above)."""
    with server.client() as http:
        r = http.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, "reasoning": reasoning}
        )
    assert r.status_code == 200, r.text
