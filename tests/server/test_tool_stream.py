"""tool_choice auto, streamed: whatever pieces the text arrives in, the content and calls a stream sends add up to
what the non-streamed parse of the whole text gives, and the content before a call streams as it comes."""

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


def test_llama3_json_still_holds_text_that_may_be_a_call():
    text = '{"name": "f", "parameters": {"a": 2}}'
    content, calls, before_end, _ = _stream(text, list(range(1, len(text))), "llama3_json")
    assert content is None and before_end == "" and calls == [("f", '{"a": 2}')]
    content, calls, before_end, _ = _stream("no call {here}", [3, 8], "llama3_json")
    assert content == "no call {here}" and before_end == "no call " and not calls
