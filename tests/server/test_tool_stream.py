"""tool_choice auto, streamed: whatever pieces the text arrives in, the content and calls a stream sends add up to
what the non-streamed parse of the whole text gives; the content before a call streams as it comes, and a call's
header and arguments as they are written."""

from __future__ import annotations

import random

import pytest

from server.openai.tools.calls import plan_tools
from server.openai.tools.parsers import parse_tool_calls
from server.openai.tools.stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'

TEXTS = {
    "call": CALL,
    "text_then_call": "Sure. " + CALL,
    "lines_then_call": "Let me look.\n\n" + CALL,
    "text_then_two_calls": "Both: " + CALL + "\n" + CALL.replace('"a": 1', '"b": "<x>"'),
    "text_after_the_call": "Ok " + CALL + " done",
    "angle_brackets": "a < b and c <tool but no call <tool_cal",
    "no_call": "  plain text, spaces around  ",
    "malformed_call": "Here: <tool_call>{broken</tool_call> end",
    "whitespace_only_before": "\n  " + CALL,
    "spacing_as_written": '<tool_call>{"name":"f","arguments":{"a":1,  "b" : [1, {"c": "}"}]}}</tool_call>',
    "escapes_as_written": '<tool_call>{"name": "f", "arguments": {"city": "Z\\u00fcrich \\"q\\""}}</tool_call>',
    "arguments_in_a_string": '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "no_arguments": '<tool_call>{"name": "f"}</tool_call>',
    "arguments_before_the_name": '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
}


def _stream(text: str, cuts: list[int], parser: str = "hermes"):
    stream = ToolCallStream(plan_tools(TOOLS, "auto"), parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls, content_before_end = [], [], []
    for i, piece in enumerate(pieces):
        finished = i == len(pieces) - 1
        for delta in stream.feed(piece, finished):
            if delta.content:
                content.append(delta.content)
                if not finished:
                    content_before_end.append(delta.content)
            for call in delta.tool_calls or []:
                if "id" in call:
                    calls.append([call["function"]["name"], ""])
                calls[call["index"]][1] += call["function"]["arguments"]
    return "".join(content) or None, [tuple(c) for c in calls], "".join(content_before_end), stream


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("split", ["whole", "characters", "random"])
def test_streamed_auto_calls_add_up_to_the_parse(name, split):
    text = TEXTS[name]
    cuts = {"whole": [], "characters": list(range(1, len(text))), "random": None}[split]
    if cuts is None:
        rng = random.Random(len(text))
        cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    content, calls, _, stream = _stream(text, cuts)
    parsed = parse_tool_calls(text, "hermes")
    assert content == parsed.content
    assert calls == [(c.name, c.arguments) for c in parsed.calls]
    assert stream.finish_reason("stop") == ("tool_calls" if parsed.calls else "stop")


def test_content_before_a_call_streams_before_the_end():
    """ "Sure." is sent as it is written, not held to the end; the space before the marker is not sent."""
    text = TEXTS["text_then_call"]
    content, calls, before_end, _ = _stream(text, list(range(1, len(text))))
    assert before_end == "Sure." == content and calls == [("f", '{"a": 1}')]


def test_a_piece_of_the_marker_is_held_until_it_is_known():
    stream = ToolCallStream(plan_tools(TOOLS, "auto"), "hermes")
    assert [d.content for d in stream.feed("x <tool", False)] == ["x"]
    assert [d.content for d in stream.feed("box", False)] == [" <toolbox"]
    assert [d.content for d in stream.feed(" <", True)] == [" <"]


def _deltas(stream: ToolCallStream, text: str) -> list[tuple[bool, dict]]:
    """The tool-call entries a stream sends for `text` fed a character at a time: (sent before the end, entry)."""
    out = []
    for i, char in enumerate(text):
        finished = i == len(text) - 1
        for delta in stream.feed(char, finished):
            out += [(not finished, call) for call in delta.tool_calls or []]
    return out


@pytest.mark.parametrize(
    "text, parser",
    [
        ("Sure. " + TEXTS["text_then_two_calls"], "hermes"),
        ('{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"b": "<x>"}}', "llama3_json"),
    ],
)
def test_calls_stream_as_they_are_written(text, parser):
    """As vLLM streams auto calls (and OpenAI any): each call's header (id, type, name, arguments "") once its name
    is written, then its arguments in pieces as they grow, long before the output ends."""
    stream = ToolCallStream(plan_tools(TOOLS, "auto"), parser)
    entries = _deltas(stream, text)
    headers = [(early, c["index"], c["function"]["name"]) for early, c in entries if "id" in c]
    assert headers == [(True, 0, "f"), (True, 1, "f")]
    for index, arguments in enumerate(['{"a": 1}', '{"b": "<x>"}']):
        pieces = [(early, c["function"]["arguments"]) for early, c in entries if c["index"] == index and "id" not in c]
        assert "".join(p for _, p in pieces) == arguments
        assert len(pieces) == len(arguments) and all(early for early, _ in pieces)  # a piece per character
    assert stream.finish_reason("stop") == "tool_calls"


def test_without_parallel_calls_only_the_first_streams():
    stream = ToolCallStream(plan_tools(TOOLS, "auto", parallel_tool_calls=False), "hermes")
    entries = _deltas(stream, TEXTS["text_then_two_calls"])
    assert {c["index"] for _, c in entries} == {0}
    assert "".join(c["function"]["arguments"] for _, c in entries) == '{"a": 1}'


def test_a_call_cut_short_after_its_name_ends_as_written():
    """An output cut off inside a call's arguments (max_tokens): the non-streamed parse finds no call in it (the text
    is content, finish "length"), but the stream has sent the call's header and what was written of its arguments,
    as vLLM's parsers leave it; nothing more is made up at the end."""
    text = 'Ok <tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    stream = ToolCallStream(plan_tools(TOOLS, "auto"), "hermes")
    entries = _deltas(stream, text)
    assert [c["function"].get("name") for _, c in entries if "id" in c] == ["f"]
    assert "".join(c["function"]["arguments"] for _, c in entries) == '{"a": [1, 2'
    assert stream.finish_reason("length") == "length"
    assert parse_tool_calls(text, "hermes").calls == []
    content, calls, before_end, _ = _stream("no call {here}", [3, 8], "llama3_json")
    assert content == "no call {here}" and before_end == "no call " and not calls
