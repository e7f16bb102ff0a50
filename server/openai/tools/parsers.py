"""Tool calls written in the text by the model (tool_choice auto), found by the `--tool-call-parser` format.

hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen, SmolLM, Hermes templates)
llama3_json  {"name": ..., "parameters": {...}} (Llama 3.x; several separated by ";")
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple, Optional

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
        call = _from_object(value, "parameters")
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
    return _from_object(value, arguments_key)


def _from_object(value, arguments_key: str) -> Optional[ParsedCall]:
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
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
