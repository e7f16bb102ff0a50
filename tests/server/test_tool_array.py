"""tool_choice "required" without a model: its grammar (one call without parallel_tool_calls, an array that may
end after any call, bounded arguments) and the streaming of its output (headers once a name is written, the
arguments' raw text in pieces that add up to the finished call's arguments, whatever the deltas' boundaries)."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from engine.structured.json_bounds import json_schema_grammar
from server.openai.tools.array_reader import ToolArrayReader
from server.openai.tools.calls import plan_tools
from server.openai.tools.parsers import ParsedCall
from server.openai.tools.stream import ToolCallStream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "number"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '{"name":"get_weather","arguments":{"city":"Oslo","days":2}}'
OUTPUT = (
    '[{"name":"get_weather","arguments":{"city":"O\\"s}l[o","days":[1,{"a":"]"}]}},{"name":"get_time","arguments":{}}]'
)
EXPECTED = [ParsedCall("get_weather", '{"city":"O\\"s}l[o","days":[1,{"a":"]"}]}'), ParsedCall("get_time", "{}")]


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)]), max_threads=1, cache_enabled=False)


def accepts(compiler, parallel, text: str) -> bool:
    constraint, _ = plan_tools([WEATHER, TIME], "required").constraint(parallel)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(json_schema_grammar(constraint.json)))
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_grammar_ends_after_a_call(compiler, parallel):
    assert accepts(compiler, parallel, f"[{CALL}]")
    assert accepts(compiler, parallel, f"[{CALL},{CALL}]") == (parallel is not False)
    assert accepts(compiler, parallel, f'[{CALL},{{"name":"get_time","arguments":{{}}}}]') == (parallel is not False)
    assert not accepts(compiler, parallel, "[]")
    assert not accepts(compiler, parallel, '[{"arguments":{"city":"Oslo"},"name":"get_weather"}]')  # name first
    assert not accepts(compiler, parallel, CALL.replace("2", "123456789012345678").join("[]"))  # bounded numbers


def test_reader_finds_names_and_raw_arguments():
    array = ToolArrayReader()
    array.feed(OUTPUT)
    assert [(c.name, array.arguments(c)) for c in array.calls] == [tuple(c) for c in EXPECTED]
    assert plan_tools([WEATHER, TIME], "required").calls_of(OUTPUT, "hermes") == (None, EXPECTED)


def test_calls_cut_short_keep_what_is_written():
    plan = plan_tools([WEATHER, TIME], "required")
    cut = OUTPUT.index("s}l")
    assert plan.calls_of(OUTPUT[:cut], "hermes") == (None, [ParsedCall("get_weather", '{"city":"O\\"')])
    assert plan.calls_of(OUTPUT[:12], "hermes") == (OUTPUT[:12], [])


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, len(OUTPUT)])
def test_streamed_pieces_add_up_to_the_arguments(step):
    stream = ToolCallStream(plan_tools([WEATHER, TIME], "required"), "hermes")
    deltas = []
    for start in range(0, len(OUTPUT), step):
        deltas += stream.feed(OUTPUT[start : start + step], start + step >= len(OUTPUT))
    headers = [c for d in deltas for c in d.tool_calls or [] if "id" in c]
    pieces: dict[int, list[str]] = {}
    for delta in deltas:
        assert delta.content is None
        for call in delta.tool_calls or []:
            if "id" not in call:
                pieces.setdefault(call["index"], []).append(call["function"]["arguments"])
    assert [(h["index"], h["type"], h["function"]) for h in headers] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "get_time", "arguments": ""}),
    ]
    assert ["".join(pieces.get(i, [])) for i in (0, 1)] == [c.arguments for c in EXPECTED]
    if step == 1:
        assert len(pieces[0]) == len(EXPECTED[0].arguments)  # one piece per character written
    assert stream.finish_reason("stop") == "tool_calls"


def test_a_stream_cut_before_any_name_ends_as_content():
    stream = ToolCallStream(plan_tools([WEATHER], "required"), "hermes")
    assert stream.feed('[{"name":"get_', False) == []
    deltas = stream.feed("wea", True)
    assert [d.content for d in deltas] == ['[{"name":"get_wea']
    assert stream.finish_reason("length") == "length"
