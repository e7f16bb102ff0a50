"""Tool calls written in the text by the model (tool_choice auto), found by the `--tool-call-parser` format.

hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, SmolLM, Hermes templates)
llama3_json  {"name": ..., "parameters": {...}} (Llama 3.x; several separated by ";")

A call's arguments are the object's text as the model wrote it (what a stream sends piece by piece, so the pieces
add up to the finished call's), or, where they were written otherwise (a JSON string holding the object, or not
at all), the object's JSON.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple, Optional

from server.openai.tools.array_reader import ToolArrayReader

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"


class ParsedCall(NamedTuple):
    name: str
    arguments: str  # a JSON object's text


class ParsedText(NamedTuple):
    content: Optional[str]  # the text outside the calls (None when there is none)
    calls: list[ParsedCall]


def parse_tool_calls(text: str, parser: str) -> ParsedText:
    """The calls in `text`; text that holds none (or malformed ones) comes back whole as content."""
    calls = _hermes(text) if parser == "hermes" else _llama3_json(text)
    if not calls:
        return ParsedText(text, [])
    if parser == "hermes":  # the text before the first call (a stream sends it as it comes, so no lstrip)
        content = text[: text.index(HERMES_START)].rstrip() or None
    else:
        content = None
    return ParsedText(content, calls)


def may_start_tool_call(text: str, parser: str) -> bool:
    """Whether streamed text so far may be (the start of) a tool call: hold it back until it is known."""
    head = text.lstrip()
    marker = HERMES_START if parser == "hermes" else "{"
    return head.startswith(marker) or marker.startswith(head)


def _hermes(text: str) -> list[ParsedCall]:
    if HERMES_START not in text:
        return []
    calls = []
    for body in _HERMES.findall(text):
        call = _call(body, "arguments")
        if call is None:
            return []
        calls.append(call)
    return calls


def _llama3_json(text: str) -> list[ParsedCall]:
    text = text.strip()
    if not text.startswith("{"):
        return []
    calls = []
    decoder = json.JSONDecoder()
    position = 0
    while position < len(text):
        try:
            value, end = decoder.raw_decode(text, position)
        except ValueError:
            return []
        call = _from_object(value, "parameters", text[position:end])
        if call is None:
            return []
        calls.append(call)
        position = end
        while position < len(text) and text[position] in " \t\r\n;":
            position += 1
    return calls


def _call(body: str, arguments_key: str) -> Optional[ParsedCall]:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _from_object(value, arguments_key, body)


def _from_object(value, arguments_key: str, written: str) -> Optional[ParsedCall]:
    """The call an object holds (`written`: the object's text), or None when it is none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], _as_written(written, arguments))


def parse_call_object(written: str, parser: str) -> Optional[ParsedCall]:
    """The call one object the model wrote holds (`written`: its text), or None when it is none."""
    return _call(written, "arguments" if parser == "hermes" else "parameters")


def call_reader() -> ToolArrayReader:
    """A reader of call objects as a model writes them under `auto` (hermes' bodies, llama3_json's objects)."""
    return ToolArrayReader(call_depth=1, arguments_keys=("arguments", "parameters"))


def _as_written(written: str, arguments: dict) -> str:
    """The arguments' text in the object as written, where it is the object they parse to (a repeated key could
    make them differ); else their JSON."""
    reader = call_reader()
    reader.feed(written)
    if reader.calls and reader.calls[0].arguments_end is not None:
        text = reader.arguments(reader.calls[0])
        try:
            if json.loads(text) == arguments:
                return text
        except ValueError:
            pass
    return json.dumps(arguments, ensure_ascii=False)
