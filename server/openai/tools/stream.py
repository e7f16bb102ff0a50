"""Streaming a choice's tool calls as OpenAI does: a `delta.tool_calls` entry with the call's id, type and
name (arguments ""), then entries with pieces of its arguments, all keyed by the call's index."""

from __future__ import annotations

from typing import Optional

from server.openai.protocol import DeltaMessage
from server.openai.tools.array_reader import CallSpan, ToolArrayReader
from server.openai.tools.calls import ToolPlan, new_call_id
from server.openai.tools.parsers import (
    HERMES_START,
    ParsedCall,
    call_reader,
    may_start_tool_call,
    parse_call_object,
)


class ToolCallStream:
    """Turns one choice's text deltas into the deltas to send (content, or tool-call pieces).

    named: the arguments stream as they come. required: each call's header once its name is written, then its
    arguments as they grow (the output is a JSON array of calls, read as it comes: ToolArrayReader). auto: the
    same for the calls the model writes (hermes: after a call's marker; llama3_json: text that begins with an
    object), as vLLM streams them; with hermes the text before the first marker streams as content, all but a
    tail that may begin the marker (or be the whitespace the content's end drops). Until a call's name is written
    nothing of it is sent, so an output that turns out to hold no call ends as the non-streamed parse reads it:
    content. (Once a call is sent it stays sent: a call object left malformed after its name ends with what was
    written of it, as vLLM's parsers leave it.)
    """

    def __init__(self, plan: ToolPlan, parser: str):
        self.plan = plan
        self.parser = parser
        self.text = ""
        self.holding = plan.mode == "auto"
        self.num_calls = 0
        self._array = ToolArrayReader() if plan.mode == "required" else None
        self._arguments_sent: list[int] = []  # required: characters of each call's arguments sent so far
        self._calls = call_reader() if plan.mode == "auto" else None  # auto: the calls written after `_start`
        self._arguments: list[str] = []  # auto: each streamed call's arguments sent so far
        self._sent = 0  # auto: characters of the text sent as content before the end (hermes streams them)
        self._marker: Optional[int] = None  # auto, hermes: where the first call's marker begins, once written

    def feed(self, delta: str, finished: bool) -> list[DeltaMessage]:
        self.text += delta
        mode = self.plan.mode
        if self._array is not None:
            return self._required(delta, finished)
        if mode == "named":
            assert self.plan.named is not None
            out = []
            if self.num_calls == 0:
                out.append(self._header(0, self.plan.named))
                self.num_calls = 1
            if delta:
                out.append(DeltaMessage(tool_calls=[{"index": 0, "function": {"arguments": delta}}]))
            return out
        if mode == "auto" and self.parser == "hermes":
            return self._auto_hermes(finished)
        if not self.holding:
            return [DeltaMessage(content=delta)] if delta else []
        if not may_start_tool_call(self.text, self.parser):
            self.holding = False
            return [DeltaMessage(content=self.text)]
        return self._end() if finished and self.num_calls == 0 else self._stream_calls(0, finished)

    def _end(self) -> list[DeltaMessage]:
        """The finished output's calls, after its content not yet sent (all of the text when no call parses)."""
        content, calls = self.plan.calls_of(self.text, self.parser)
        rest = (content or "")[self._sent :]
        out = [DeltaMessage(content=rest)] if rest else []
        for call in calls:
            out += self._call(call)
        return out

    def _auto_hermes(self, finished: bool) -> list[DeltaMessage]:
        text = self.text
        if self._marker is None:
            at = text.find(HERMES_START, self._sent)  # (no sent text ends in a piece of the marker)
            self._marker = at if at >= 0 else None
        if finished and self.num_calls == 0:
            return self._end()
        out = []
        end = self._marker if self._marker is not None else len(text) - _marker_prefix(text)
        end = self._sent + len(text[self._sent : end].rstrip())  # (only the unsent text: no copy of it all)
        if end > self._sent:
            out.append(DeltaMessage(content=text[self._sent : end]))
            self._sent = end
        if self._marker is not None:
            out += self._stream_calls(self._marker + len(HERMES_START), finished)
        return out

    def _stream_calls(self, start: int, finished: bool) -> list[DeltaMessage]:
        """auto: the headers of the calls written in the text from `start` whose names are complete, and their
        arguments' text written since the last delta; at the end, what the finished text's parse adds to them."""
        reader = self._calls
        assert reader is not None  # auto only
        reader.feed(self.text[start + len(reader.text) :])
        calls = reader.calls if self.plan.parallel else reader.calls[:1]
        out = []
        for index in range(max(self.num_calls - 1, 0), len(calls)):  # earlier calls are complete and sent
            call = calls[index]
            if call.name is None:
                break
            if index == self.num_calls:
                if index > 0:  # the call before is written whole: all of it goes before the next one begins
                    out += self._settle(index - 1, parse_call_object(self._written(calls[index - 1]), self.parser))
                out.append(self._header(index, call.name))
                self.num_calls += 1
                self._arguments.append("")
            piece = reader.arguments(call, skip=len(self._arguments[index]))
            if piece:
                self._arguments[index] += piece
                out.append(DeltaMessage(tool_calls=[{"index": index, "function": {"arguments": piece}}]))
        if finished:
            out += self._finish_calls()
        return out

    def _finish_calls(self) -> list[DeltaMessage]:
        """The rest of each streamed call's arguments as the finished text's parse gives them (the calls before
        the last were settled as the next began, so this adds to the last one only)."""
        _, parsed = self.plan.calls_of(self.text, self.parser)
        out = []
        for index in range(len(self._arguments)):
            out += self._settle(index, parsed[index] if index < len(parsed) else None)
        return out

    def _settle(self, index: int, call: Optional[ParsedCall]) -> list[DeltaMessage]:
        """The rest of streamed call `index`'s arguments, `call` being its parse: none where they were written as
        an object (all sent), else their JSON (arguments written as a string, or not at all). A Responses stream
        closes each function_call item before the next opens, so no piece may come after the next call's header."""
        reader = self._calls
        assert reader is not None
        sent = self._arguments[index]
        if call is not None and call.name == reader.calls[index].name and call.arguments.startswith(sent):
            whole = call.arguments
        else:  # no such call (malformed after its name): what was written, an object at least
            whole = sent or "{}"
        if len(whole) <= len(sent):
            return []
        self._arguments[index] = whole
        return [DeltaMessage(tool_calls=[{"index": index, "function": {"arguments": whole[len(sent) :]}}])]

    def _written(self, call: CallSpan) -> str:
        """The text of a call object the model wrote before the next (to its end, should its brackets not pair)."""
        reader = self._calls
        assert reader is not None
        return reader.text[call.start : call.end]

    def _required(self, delta: str, finished: bool) -> list[DeltaMessage]:
        """Headers of the calls whose names are complete, and the arguments' text written since the last
        delta; an output cut short before any call's name is sent as content at the end."""
        array = self._array
        assert array is not None  # feed() comes here only with an array reader
        array.feed(delta)
        out = []
        for index in range(max(self.num_calls - 1, 0), len(array.calls)):  # earlier calls are complete and sent
            call = array.calls[index]
            if call.name is None:
                break
            if index == self.num_calls:
                out.append(self._header(index, call.name))
                self.num_calls += 1
                self._arguments_sent.append(0)
            piece = array.arguments(call, skip=self._arguments_sent[index])
            if piece:
                self._arguments_sent[index] += len(piece)
                out.append(DeltaMessage(tool_calls=[{"index": index, "function": {"arguments": piece}}]))
        if finished and self.num_calls == 0 and self.text:
            out.append(DeltaMessage(content=self.text))
        return out

    def finish_reason(self, engine_reason: Optional[str]) -> Optional[str]:
        return self.plan.finish_reason(engine_reason, self.num_calls > 0)

    def _call(self, call: ParsedCall) -> list[DeltaMessage]:
        index = self.num_calls
        self.num_calls += 1
        return [
            self._header(index, call.name),
            DeltaMessage(tool_calls=[{"index": index, "function": {"arguments": call.arguments}}]),
        ]

    @staticmethod
    def _header(index: int, name: str) -> DeltaMessage:
        return DeltaMessage(
            tool_calls=[
                {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
            ]
        )


def _marker_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins the hermes marker (a call may be starting there)."""
    for length in range(min(len(text), len(HERMES_START) - 1), 0, -1):
        if text.endswith(HERMES_START[:length]):
            return length
    return 0
