"""A response's output items are the same streamed or not: the same messages and calls, each with the same
status (only the last item of a cut output is incomplete; the ones before it ended before the output did)."""

from __future__ import annotations

import pytest

from server.openai.responses.events import ResponseEvents
from server.openai.responses.route import _output
from server.openai.tools.calls import plan_tools
from server.openai.tools.stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
TEXTS = [
    "",
    "plain text",
    CALL,
    "Sure. " + CALL,
    "Both: " + CALL + "\n" + CALL,
    "Cut <tool_call>\n{",
    '<tool_call>{"name": "f"}</tool_call>\n' + CALL,  # a call's arguments known only once it is written whole
    '<tool_call>{"name": "f", "arguments": "{\\"b\\": 2}"}</tool_call>\n' + CALL,
]


def _shape(items: list[dict]) -> list[tuple]:
    """The items without their generated ids."""
    return [
        (item["type"], item["status"], item.get("name"), item.get("arguments"))
        + tuple(part["text"] for part in item.get("content", []))
        for item in items
    ]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("status", ["completed", "incomplete"])
def test_streamed_items_match_the_collected_ones(text, status):
    tools = plan_tools(TOOLS, "auto")
    writer, stream = ResponseEvents(), ToolCallStream(tools, "hermes")
    for i, piece in enumerate(text):
        writer.deltas(stream.feed(piece, i == len(text) - 1))
    if not text:
        writer.deltas(stream.feed("", True))
    writer.finish(status)
    collected = _output(tools, text, "hermes", status)
    assert _shape(writer.output) == _shape(collected)
    assert [item["status"] for item in collected] == ["completed"] * (len(collected) - 1) + [status]
