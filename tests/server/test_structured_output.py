"""Structured output and tool calling over HTTP with the real openai SDK (tiny random model)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from server.openai.tools.calls import plan_tools
from server.openai.tools.parsers import parse_tool_calls

USER = [{"role": "user", "content": "Give me the data."}]
WEATHER = {
    "type": "function",
    "function": {
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
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class Point(BaseModel):
    x: int = Field(ge=0, le=50)
    label: str = Field(max_length=6)


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def _final_choice(client: openai.OpenAI, stream: bool, call, **kwargs):
    """The first choice as the SDK's stream helper accumulates it (every event read), or as `call` returns it."""
    if not stream:
        return call(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as events:
        for _ in events:
            pass
        return events.get_final_completion().choices[0]


def _valid_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_parse_with_a_pydantic_model(server):
    completion = sdk(server).chat.completions.parse(
        model="tiny", messages=USER, response_format=Point, max_tokens=100, temperature=1.0, seed=4
    )
    assert isinstance(completion.choices[0].message.parsed, Point)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_guided_json(server, stream):
    client = sdk(server)
    schema = {
        "type": "object",
        "properties": {"v": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3}},
        "required": ["v"],
        "additionalProperties": False,
    }
    for extra in (
        {"response_format": {"type": "json_object"}},
        {"extra_body": {"guided_json": schema}},
        {"extra_body": {"structured_outputs": {"json": schema}}},
    ):
        if stream:
            chunks = client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=150, temperature=0, stream=True, **extra
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = (
                client.chat.completions.create(model="tiny", messages=USER, max_tokens=150, temperature=0, **extra)
                .choices[0]
                .message.content
            )
        value = json.loads(text)
        assert isinstance(value, dict)
        if "extra_body" in extra:
            jsonschema.validate(value, schema)


def test_completions_take_response_format_as_chat_does(server):
    """vLLM's completions take `response_format` too (json_object, json_schema), constrained as chat's."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    out = sdk(server).completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=60,
        temperature=1.0,
        seed=1,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), schema)
    with server.client() as c:
        bad = {"model": "tiny", "prompt": "x", "response_format": {"type": "yaml"}}
        assert c.post("/v1/completions", json=bad).json()["error"]["param"] == "response_format.type"


def test_completions_take_guided_choice_and_regex(server):
    client = sdk(server)
    out = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
    )
    assert out.choices[0].text in ("left", "right") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, temperature=1.0, extra_body={"guided_regex": "[A-Z]{3}[0-9]{2}"}
    )
    assert len(out.choices[0].text) == 5


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_choice_constrains_to_valid_calls(server, tool_choice):
    response = sdk(server).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=1.0,
        seed=2,
    )
    choice = response.choices[0]
    # a named function ends with "stop", as OpenAI and vLLM report a call the caller forced
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    _valid_calls(choice.message.tool_calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]


def test_parameters_are_checked_only_where_they_constrain(server):
    """Under auto a tool's schema is only shown to the model (as vLLM shows it): a keyword the grammar cannot
    enforce there is no error, and a named tool is constrained by its own schema alone."""
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "not": {}}}}
    client = sdk(server)
    for tool_choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        response = client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER, odd], tool_choice=tool_choice, max_tokens=30, temperature=0
        )
        assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_function_without_parameters_takes_none(server):
    """OpenAI: leaving out `parameters` defines a function with an empty parameter list."""
    ping = {"type": "function", "function": {"name": "ping"}}
    response = sdk(server).chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[ping],
        tool_choice={"type": "function", "function": {"name": "ping"}},
        max_tokens=30,
        temperature=1.0,
        seed=3,
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "ping" and json.loads(call.function.arguments) == {}
    named = {"type": "function", "function": {"name": "ping"}}
    constraint, _ = plan_tools([ping], named).constraint(None)
    assert json.loads(constraint.json) == {"additionalProperties": False, "properties": {}, "type": "object"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_reassembles(server, tool_choice):
    client = sdk(server)
    kwargs = dict(
        model="tiny", messages=USER, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=200, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function.name:
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_streamed_required_call_arguments_arrive_in_pieces(server):
    """As OpenAI streams them: a header with id, type and name (arguments ""), then the arguments' text in
    pieces as it is generated, adding up to the non-streamed call's arguments exactly."""
    client = sdk(server)
    kwargs = dict(
        model="tiny",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    headers, pieces = [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                headers.append((delta.index, delta.type, delta.function.name, delta.function.arguments))
            else:
                assert delta.index == 0 and delta.function.name is None
                pieces.append(delta.function.arguments)
    assert headers == [(0, "function", whole[0].function.name, "")]
    assert len(pieces) >= 3 and all(pieces), pieces
    arguments = "".join(pieces)
    jsonschema.validate(json.loads(arguments), PARAMS[whole[0].function.name])
    assert arguments == whole[0].function.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_required_without_parallel_calls_is_one_call(server, stream):
    client = sdk(server)
    for seed in range(3):
        kwargs = dict(
            model="tiny",
            messages=USER,
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            names = [
                d.function.name
                for c in chunks
                if c.choices
                for d in c.choices[0].delta.tool_calls or []
                if d.id is not None
            ]
            finish = chunks[-1].choices[0].finish_reason
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            names, finish = [c.function.name for c in choice.message.tool_calls or []], choice.finish_reason
            _valid_calls(choice.message.tool_calls)
        assert len(names) == 1 and finish == "tool_calls", (seed, names, finish)


def test_tool_follow_up_turn(server):
    messages = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ]
    response = sdk(server).chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert response.choices[0].message.content is not None or response.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
        ),
        (
            {
                "tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"guided_grammar": "root ::= ( broken"}, "guided_grammar"),
        # grammars that match no text: every token masked, the sampler gave token 0 (200, text outside the grammar)
        ({"guided_grammar": "root ::= root"}, "guided_grammar"),
        ({"guided_grammar": 'root ::= x\nx ::= x "b"'}, "guided_grammar"),
        # a reference outside the schema: xgrammar admitted any value there
        (
            {"guided_json": {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}},
            "guided_json",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "other.json#/x"}}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        # a function that is not an object: an AttributeError, a 500
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": ["get_weather"]}}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_rejections_name_the_field(server, body, param):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_grammar_matching_no_text_is_refused_on_completions_too(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_grammar": "root ::= root"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "guided_grammar"), r.text
    assert "matches no text" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/a"}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
    ],
)
def test_grammar_errors_read_without_the_libraries_log_prefix(server, body, param):
    """xgrammar's messages come with its C++ log's time and source line: the 400 keeps the message alone."""
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 5, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param
    assert "cannot be compiled into a grammar: " in error["message"] and ".cc:" not in error["message"], error
    assert not re.search(r"\[\d\d:\d\d:\d\d\]", error["message"]), error


def test_metrics_show_grammar_histograms(server):
    sdk(server).chat.completions.create(
        model="tiny", messages=USER, max_tokens=30, extra_body={"guided_regex": "[0-9]{4}"}
    )
    with server.client() as c:
        text = c.get("/metrics").text
    assert "pagedserve_grammar_compile_seconds_count" in text
    assert "pagedserve_grammar_mask_fill_seconds_count" in text


@pytest.mark.parametrize(
    "text, parser, calls",
    [
        ('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>', "hermes", [("f", '{"a": 1}')]),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"b": "x"}}'
            "</tool_call>",
            "hermes",
            [("f", "{}"), ("g", '{"b": "x"}')],
        ),
        (
            '{"name": "f", "parameters": {"a": 2}}; {"name": "g", "parameters": {}}',
            "llama3_json",
            [("f", '{"a": 2}'), ("g", "{}")],
        ),
        (  # the arguments as written, as a stream sends them
            '<tool_call>{"name":"f","arguments":{"a":1,  "b":"\\u00fc"}}</tool_call>',
            "hermes",
            [("f", '{"a":1,  "b":"\\u00fc"}')],
        ),
        ('<tool_call>{"name": "f", "arguments": "{\\"a\\":1}"}</tool_call>', "hermes", [("f", '{"a": 1}')]),
        ("just text", "hermes", []),
        ("<tool_call>{broken</tool_call>", "hermes", []),
    ],
)
def test_tool_call_parsers(text, parser, calls):
    parsed = parse_tool_calls(text, parser)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    if not calls:
        assert parsed.content == text


def test_two_sources_of_a_grammar_are_refused_naming_the_ones_set(server):
    body = {
        "model": "tiny",
        "messages": USER,
        "max_tokens": 5,
        "guided_json": {"type": "object"},
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": WEATHER["function"]["name"]}},
    }
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and error["message"] == (
        "structured_outputs / guided_* and tool_choice required or named each constrain the output; use one."
    )


class GetWeather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "GetWeather"}}])
def test_a_response_format_beside_a_forced_call_is_taken(server, stream, tool_choice):
    """An output type beside a forced tool call, as instructor and the Agents SDK send them (OpenAI and vLLM take
    both): the call is the output, constrained to the tool's parameters. It was a 400 ("response_format and
    tool_choice required or named each constrain the output; use one.")."""
    client = sdk(server)
    kwargs = dict(
        model="tiny",
        messages=USER,
        response_format=Point,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=1.0,
        seed=2,
    )
    choice = _final_choice(client, stream, client.chat.completions.parse, **kwargs)
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert choice.message.parsed is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_a_response_format_beside_a_forced_call_is_still_checked(server):
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": USER,
                "response_format": {"type": "yaml"},
                "tools": [WEATHER],
                "tool_choice": "required",
            },
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.type", r.text


AUTO_CALL_AFTER_TEXT = r'Sure\. <tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'


def test_streamed_auto_call_after_text_is_the_non_streamed_one(server):
    """tool_choice auto with a model that writes text, then a hermes call (the output forced by a regex): the
    stream sends the text as content and the call as tool_calls, as the non-streamed choice has them."""
    client = sdk(server)
    kwargs = dict(
        model="tiny",
        messages=USER,
        tools=[WEATHER, TIME],
        max_tokens=150,
        temperature=0,
        extra_body={"guided_regex": AUTO_CALL_AFTER_TEXT},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_time", '{"zone": "UTC"}')
    ]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("Sure.", "tool_calls")
    assert list(calls.values()) == [["get_time", '{"zone": "UTC"}']]


def test_streamed_auto_calls_arrive_in_pieces(server):
    """tool_choice auto, two hermes calls (forced by a regex): each call's header arrives once its name is written
    and its arguments in pieces as they are generated, before the chunk that finishes the choice (vLLM streams them
    so); the pieces add up to the non-streamed calls' arguments."""
    client = sdk(server)
    kwargs = dict(
        model="tiny",
        messages=USER,
        tools=[WEATHER, TIME],
        max_tokens=200,
        temperature=0,
        extra_body={"guided_regex": AUTO_TWO_CALLS},
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    headers, pieces = [], {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                headers.append((delta.index, delta.function.name, delta.function.arguments, choice.finish_reason))
            elif delta.function.arguments:
                pieces[delta.index].append((delta.function.arguments, choice.finish_reason))
    assert headers == [(0, "get_weather", "", None), (1, "get_time", "", None)]
    for index, call in enumerate(whole):
        assert "".join(p for p, _ in pieces[index]) == call.function.arguments
        assert len(pieces[index]) >= 3 and all(finish is None for _, finish in pieces[index]), pieces[index]


AUTO_TWO_CALLS = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2\}\}</tool_call>\n'
    r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
)


@pytest.mark.parametrize("parallel", [None, False])
def test_auto_calls_without_parallel_calls_keep_the_first(server, parallel):
    """tool_choice auto, a model that writes two hermes calls (forced by a regex): parallel_tool_calls false keeps
    the first call alone, as vLLM filters them, streamed (the SDK's stream helper) and not; unset keeps both."""
    client = sdk(server)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kwargs = dict(
        model="tiny",
        messages=USER,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        max_tokens=200,
        temperature=0,
        extra_body={"guided_regex": AUTO_TWO_CALLS},
        **extra,
    )
    expected = [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", '{"zone": "UTC"}')]
    expected = expected[:1] if parallel is False else expected
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == expected
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == expected
    response = client.responses.create(
        model="tiny",
        input="Give me the data.",
        tools=[{"type": "function", **t["function"]} for t in (WEATHER, TIME)],
        max_output_tokens=200,
        temperature=0,
        extra_body={"guided_regex": AUTO_TWO_CALLS},
        **extra,
    )
    assert [(item.name, item.arguments) for item in response.output if item.type == "function_call"] == expected


LARK_CODE = """
// a Lark grammar, as vLLM takes it in guided_grammar beside EBNF: no start rule (the first is the root),
// single-quoted literals, terminals with regular expressions and ~ repetition
code: letters '-' DIGIT~2
letters: LETTER LETTER LETTER
LETTER: /[A-Z]/
DIGIT: "0".."9"
"""


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_grammar": LARK_CODE},
        {"structured_outputs": {"grammar": '?start: answer\nanswer: "yes" | "no"\n'}},
        {"guided_grammar": "start: WORD ('!' | '?')\n%import common.WORD\n"},
    ],
)
def test_lark_grammars_constrain_as_vllm_reads_them(server, extra):
    """A grammar with no `::=` rule is Lark (vLLM's reading): it was a 400 (xgrammar's EBNF parser refused it)."""
    client = sdk(server)
    # the whole output when the grammar ended it; a prefix of one when max_tokens cut it short (only WORD is unbounded)
    whole, cut = {
        "guided_grammar": (r"[A-Z]{3}-[0-9]{2}", None) if "code" in str(extra) else (r"[A-Za-z]+[!?]", r"[A-Za-z]+"),
        "structured_outputs": (r"yes|no", None),
    }[next(iter(extra))]
    for choice in client.completions.create(
        model="tiny", prompt="Code:", max_tokens=30, temperature=1.0, seed=3, n=2, extra_body=extra
    ).choices:
        if choice.finish_reason == "stop":
            assert re.fullmatch(whole, choice.text), choice.text
        else:
            assert choice.finish_reason == "length" and cut and re.fullmatch(cut, choice.text), choice
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "guided_grammar": "start: undefined_rule"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text


class Address(BaseModel):
    city: str = Field(max_length=8)


class SetHome(BaseModel):
    home: Address
    past: list[Address] = Field(max_length=2)


@pytest.mark.parametrize("stream", [False, True])
def test_required_takes_parameters_with_definitions(server, stream):
    """A nested pydantic model's parameters hold `$defs` and "#/$defs/..." references: under tool_choice required
    they sit inside the array of calls, so their definitions go to its root (as vLLM gathers them). They were a 400
    ("Cannot find field '$defs'")."""
    set_home = openai.pydantic_function_tool(SetHome, name="set_home")
    assert "$defs" in set_home["function"]["parameters"]
    client = sdk(server)
    kwargs = dict(
        model="tiny", messages=USER, tools=[set_home, TIME], tool_choice="required", max_tokens=200, temperature=0
    )
    choice = _final_choice(client, stream, client.chat.completions.create, **kwargs)
    assert choice.finish_reason in ("tool_calls", "length")
    for call in choice.message.tool_calls if choice.finish_reason == "tool_calls" else []:
        schema = set_home["function"]["parameters"] if call.function.name == "set_home" else PARAMS["get_time"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    other = {
        "$defs": {"Address": {"type": "string"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/Address"}},
    }
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": USER,
                "tools": [set_home, {"type": "function", "function": {"name": "other", "parameters": other}}],
                "tool_choice": "required",
            },
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.parameters.$defs.Address", r.text


def test_a_grammar_that_dead_ends_mid_output_fails_the_request(server):
    """'a', then a rule that can never end: after the 'a' no token is allowed. The request fails alone with a
    message saying so (before, the sampler wrote token 0 over and over, outside the grammar, until max_tokens);
    the server goes on."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 8, "guided_grammar": 'root ::= "a" x\nx ::= x'}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 500, r.text
        assert "grammar allows no token after 1 tokens" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200
