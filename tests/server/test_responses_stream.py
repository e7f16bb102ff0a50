"""Streamed /v1/responses with the real openai SDK (tiny random model): the typed events in OpenAI's order,
numbered, reassembling to the non-streamed output; function-call argument events; an error mid-stream; and a
client that leaves mid-stream aborts its request (the KV cache empties)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.server.conftest import pace_engine
from tests.server.test_disconnect import assert_gauges_reach_zero, assert_still_serves, engine_load, successes
from tests.server.test_responses import MODEL, SCHEMA, TIME, WEATHER, sdk

TEXT_ORDER = re.compile(
    r"created in_progress output_item\.added content_part\.added (output_text\.delta )+"
    r"output_text\.done content_part\.done output_item\.done (completed|incomplete)"
)
CALL_ORDER = re.compile(
    r"created in_progress (output_item\.added (function_call_arguments\.delta )+"
    r"function_call_arguments\.done output_item\.done )+completed"
)
JSON_FORMAT = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}


def order(events) -> str:
    """The event types without their `response.` prefix, space-separated; the numbering checked first."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return " ".join(e.type.removeprefix("response.") for e in events)


@pytest.mark.parametrize(
    "body",
    [
        {"max_output_tokens": 5},
        {"max_output_tokens": 100, "tools": [WEATHER], "tool_choice": "required"},
        {"max_output_tokens": 200, "text": JSON_FORMAT},
    ],
    ids=["text", "function_call", "json_schema"],
)
def test_shapes_validate_against_the_sdk_models(server, body):
    """Validated, not just constructed (the SDK builds its objects without checking): every required field."""
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    body = {"model": MODEL, "input": "Hi", "temperature": 0, **body}
    with server.client() as http:
        Response.model_validate(http.post("/v1/responses", json=body).json())
        with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            events = [
                adapter.validate_python(json.loads(line[6:])) for line in r.iter_lines() if line.startswith("data: ")
            ]
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_stream_events_reassemble_to_the_non_streamed_text(server):
    client = sdk(server)
    kwargs = dict(model=MODEL, input="Describe it.", max_output_tokens=200, temperature=0, text=JSON_FORMAT)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert TEXT_ORDER.fullmatch(order(events)), order(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[-1].response.status == "completed" == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    item = events[2].item
    assert item.id.startswith("msg_") and item.status == "in_progress" and final.output[0].id == item.id
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {item.id}
    assert events[0].response.id == final.id and final.id.startswith("resp_")


def test_stream_cut_by_max_output_tokens_ends_incomplete(server):
    client = sdk(server)
    kwargs = dict(model=MODEL, input="Count.", max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert TEXT_ORDER.fullmatch(order(events)), order(events)
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage.output_tokens == 6
    assert last.response.output[0].status == "incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == last.response.output_text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_streamed_function_call_reassembles(server, tool_choice):
    client = sdk(server)
    kwargs = dict(
        model=MODEL,
        input="Weather?",
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_output_tokens=200,
        temperature=0,
    )
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert CALL_ORDER.fullmatch(order(events)), order(events)
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert all(i.type == "function_call" and i.id.startswith("fc_") and i.call_id.startswith("call_") for i in added)
    streamed = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            streamed[e.item_id] = streamed.get(e.item_id, "") + e.delta
        if e.type == "response.function_call_arguments.done":
            assert e.arguments == streamed[e.item_id]
    calls = [(i.name, json.loads(streamed[i.id])) for i in added]
    assert calls == [(i.name, json.loads(i.arguments)) for i in whole.output]
    assert calls == [(i.name, json.loads(i.arguments)) for i in final.output]


def test_an_error_mid_stream_is_an_error_event(server, monkeypatch):
    """--request-timeout passes while the response streams: the SDK raises the error event's envelope."""
    pace_engine(server, monkeypatch, 0.02)
    monkeypatch.setattr(server.state, "config", server.state.config.model_copy(update={"request_timeout": 0.5}))
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for event in sdk(server).responses.create(
            model=MODEL, input="Go", max_output_tokens=200, stream=True, extra_body={"ignore_eos": True}
        ):
            seen.append(event.type)
    assert "response.output_text.delta" in seen and "response.completed" not in seen
    assert raised.value.body["code"] == "request_timeout"
    server.wait_idle()


def test_error_event_shape(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.02)
    monkeypatch.setattr(server.state, "config", server.state.config.model_copy(update={"request_timeout": 0.5}))
    body = {"model": MODEL, "input": "Go", "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    with server.client() as http, http.stream("POST", "/v1/responses", json=body) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    error = frames[-1]
    assert error["type"] == "error" and error["code"] == "request_timeout" and error["message"]
    assert error["sequence_number"] == len(frames) - 1 and error["error"]["code"] == "request_timeout"
    server.wait_idle()


def test_client_leaving_mid_stream_aborts(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.03)  # 200 tokens: seconds, far longer than the test needs
    before = successes(server)
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 200, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.base_url, timeout=30) as http,
        http.stream("POST", "/v1/responses", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break
        in_flight, kv_usage = engine_load(server)
        if in_flight != 1 or kv_usage == 0:  # (seen once in CI, not reproduced since): how the response ended
            stats = server.engine.engine.stats()
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
            last = rest[-1] if rest else {}
            ended = {k: last.get("response", {}).get(k) for k in ("status", "incomplete_details", "error")}
            pytest.fail(
                f"the request left the engine by its first delta: {stats}, successes +{successes(server) - before}, "
                f"then {len(rest)} events, the last {last.get('type')} {ended}"
            )
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    assert successes(server) == before  # aborted, not run to max_output_tokens
    assert_still_serves(server)


def test_a_non_streamed_client_that_times_out_is_aborted(server, monkeypatch):
    pace_engine(server, monkeypatch, 0.03)  # 200 tokens: 6 s at least
    before = successes(server)
    body = {"model": MODEL, "input": "Go on", "max_output_tokens": 200, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/responses", json=body)
    assert_gauges_reach_zero(server)
    server.wait_idle(timeout=1)
    assert successes(server) == before  # aborted, not run to max_output_tokens


def _forced_tool_output(server, prompt: str, regex: str):
    """tool_choice auto with the model's output forced by `regex`: the non-streamed response, and the streamed
    one's events and final response."""
    client = sdk(server)
    kwargs = dict(
        model=MODEL,
        input=prompt,
        tools=[WEATHER, TIME],
        max_output_tokens=150,
        temperature=0,
        extra_body={"guided_regex": regex},
    )
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return whole, events, final


def test_streamed_auto_call_after_text_is_the_non_streamed_one(server):
    """tool_choice auto, text and then a hermes call (forced by a regex): the streamed output items are the
    non-streamed ones, a message with the text and the function call."""
    regex = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    whole, events, final = _forced_tool_output(server, "Time?", regex)

    def items(response):
        return [
            ("message", i.content[0].text) if i.type == "message" else (i.type, i.name, i.arguments)
            for i in response.output
        ]

    assert items(whole) == [("message", "Sure."), ("function_call", "get_time", '{"zone": "UTC"}')]
    assert items(final) == items(whole)
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["message", "function_call"]


def test_streamed_calls_without_arguments_each_get_theirs(server):
    """Two hermes calls with no arguments (forced by a regex): each call's "{}" comes before the next call's
    item opens, so each function_call item streams its own arguments; they were "" and "{}{}"."""
    regex = r'<tool_call>\n\{"name": "get_time"\}\n</tool_call>\n<tool_call>\n\{"name": "get_weather"\}\n</tool_call>'
    whole, events, final = _forced_tool_output(server, "Time and weather?", regex)
    calls = [("function_call", "get_time", "{}"), ("function_call", "get_weather", "{}")]
    assert [(i.type, i.name, i.arguments) for i in whole.output] == calls
    assert [(i.type, i.name, i.arguments) for i in final.output] == calls
    assert CALL_ORDER.fullmatch(order(events))
    done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert done == ["{}", "{}"]
