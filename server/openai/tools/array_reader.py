"""Reading tool calls as they are generated: `tool_choice: "required"` output, a JSON array of `{"name", "arguments"}`
objects (the grammar's), or under `auto` the bare call objects a model writes (`call_depth` 1: hermes' bodies,
llama3_json's objects, whose arguments may be keyed "parameters"); each call's name as soon as it is written and
its arguments' text as it grows.

    [{"name":"get_weather","arguments":{"city":"Os          <- text so far
      ^ call 0 (depth 2)  ^ arguments_start (depth 3)      arguments so far: {"city":"Os

The arguments are the raw text the model wrote, so the pieces a stream sends add up to the finished call's
arguments exactly. Only the structure is read (strings, nesting, keys at the call's depth); the grammar guarantees
the rest under `required`, and under `auto` the finished text's parse (parsers.py) decides what is a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

ARRAY_CALL_DEPTH = 2  # inside the array (1), inside a call object (2)


@dataclass(slots=True)
class CallSpan:
    """One call as far as it is written: its name once complete, where its arguments start and end in the text."""

    start: int  # where the call's object begins
    end: Optional[int] = None  # one past the object's closing bracket, once written
    name: Optional[str] = None
    arguments_start: Optional[int] = None
    arguments_end: Optional[int] = None  # one past the arguments' closing brace
    arguments_key: Optional[str] = None  # the key they were written under


@dataclass(slots=True)
class ToolArrayReader:
    """Feed it the output's text deltas; `calls` grows as the calls are written."""

    call_depth: int = ARRAY_CALL_DEPTH  # 1: bare call objects, one after another
    arguments_keys: tuple[str, ...] = ("arguments",)  # the first of them written holds a call's arguments
    text: str = ""
    calls: list[CallSpan] = field(default_factory=list)
    _position: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _string_start: int = 0
    _key: Optional[str] = None
    _in_value: bool = False  # at the call's depth: after a key's ":", before the next ","

    def feed(self, delta: str) -> None:
        self.text += delta
        for i in range(self._position, len(self.text)):
            self._read(i, self.text[i])
        self._position = len(self.text)

    def arguments(self, call: CallSpan, skip: int = 0) -> str:
        """The call's arguments text so far ("" before they start), without its first `skip` characters."""
        if call.arguments_start is None:
            return ""
        end = call.arguments_end if call.arguments_end is not None else len(self.text)
        return self.text[call.arguments_start + skip : end]

    def _read(self, i: int, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                self._string_ended(self.text[self._string_start : i + 1])
            return
        if char == '"':
            self._in_string, self._string_start = True, i
        elif char in "{[":
            self._depth += 1
            if char == "{" and self._depth == self.call_depth:
                self.calls.append(CallSpan(i))
                self._key, self._in_value = None, False
            elif (
                self._depth == self.call_depth + 1
                and self._in_value
                and self._key in self.arguments_keys
                and self.calls
                and self.calls[-1].arguments_start is None
            ):
                self.calls[-1].arguments_start = i
                self.calls[-1].arguments_key = self._key
        elif char in "}]":
            self._depth -= 1
            if self._depth == self.call_depth - 1 and self.calls and self.calls[-1].end is None:
                self.calls[-1].end = i + 1
            elif (
                self._depth == self.call_depth
                and self.calls
                and self.calls[-1].arguments_start is not None
                and self.calls[-1].arguments_end is None
                and self._key == self.calls[-1].arguments_key
            ):
                self.calls[-1].arguments_end = i + 1
        elif self._depth == self.call_depth and char == ":":
            self._in_value = True
        elif self._depth == self.call_depth and char == ",":
            self._key, self._in_value = None, False

    def _string_ended(self, literal: str) -> None:
        if self._depth != self.call_depth or not self.calls:
            return
        try:
            value = json.loads(literal, strict=False)
        except ValueError:
            return
        if not self._in_value:
            self._key = value
        elif self._key == "name" and self.calls[-1].name is None:
            self.calls[-1].name = value
