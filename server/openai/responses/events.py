"""The typed server-sent events of a streamed response, in OpenAI's order, numbered by `sequence_number`:

    response.created, response.in_progress
    per output item:   response.output_item.added
      message:         response.content_part.added, response.output_text.delta..., response.output_text.done,
                       response.content_part.done
      function_call:   response.function_call_arguments.delta..., response.function_call_arguments.done
                       response.output_item.done
    response.completed (status completed) or response.incomplete (max_output_tokens reached)

An error after the stream began is one `error` event (OpenAI's `{"type": "error", "code", "message",
"param"}`, which also carries the usual `{"error": {...}}` envelope so the SDK raises it), then the stream ends.
"""

from __future__ import annotations

import copy
from typing import Optional

from server.openai.protocol import DeltaMessage
from server.openai.responses.protocol import function_call_item, message_item, new_item_id, output_text_part


class ResponseEvents:
    """The events of one response's output, and the output items they build (the final response's)."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict] = []
        self._open: Optional[dict] = None  # the item receiving deltas (the last of `output`)

    def event(self, kind: str, **fields) -> dict:
        """Event `kind` with the next sequence number; the objects in `fields` are copied as they are now."""
        event = {"type": kind, "sequence_number": self.sequence_number, **copy.deepcopy(fields)}
        self.sequence_number += 1
        return event

    def deltas(self, deltas: list[DeltaMessage]) -> list[dict]:
        """The events for chat-shaped deltas (content, or tool-call headers and argument pieces)."""
        events: list[dict] = []
        for delta in deltas:
            if delta.content:
                events += self.text(delta.content)
            for call in delta.tool_calls or []:
                function = call.get("function") or {}
                if call.get("id"):
                    events += self.call(call["id"], function.get("name", ""))
                if function.get("arguments"):
                    events += self.arguments(function["arguments"])
        return events

    def text(self, delta: str) -> list[dict]:
        events = [] if self._is_open("message") else self.close("completed") + self._open_message()
        item = self._current()
        item["content"][0]["text"] += delta
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=self._index,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return events

    def call(self, call_id: str, name: str) -> list[dict]:
        events = self.close("completed")
        self._open = function_call_item(new_item_id("fc"), call_id, name, "", "in_progress")
        self.output.append(self._open)
        return events + [self.event("response.output_item.added", output_index=self._index, item=self._open)]

    def arguments(self, delta: str) -> list[dict]:
        item = self._current()
        item["arguments"] += delta
        return [
            self.event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=self._index, delta=delta
            )
        ]

    def finish(self, status: str) -> list[dict]:
        """Close the last item; a response that wrote nothing still has its (empty) message."""
        events = self._open_message() if not self.output else []
        return events + self.close(status)

    def close(self, status: str) -> list[dict]:
        """The done events of the open item (none when no item is open)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        item["status"] = status
        if item["type"] == "function_call":
            return [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        part = item["content"][0]
        return [
            self.event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            ),
            self.event(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def error(self, body: dict) -> dict:
        """OpenAI's `error` event for `body` (an error envelope), which it also carries."""
        error = body["error"]
        return self.event(
            "error", code=error.get("code"), message=error["message"], param=error.get("param"), error=error
        )

    def _current(self) -> dict:
        """The item receiving deltas (a call's arguments follow its header, text opens a message first)."""
        if self._open is None:
            raise RuntimeError("no output item is open")
        return self._open

    @property
    def _index(self) -> int:
        return len(self.output) - 1

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open["type"] == kind

    def _open_message(self) -> list[dict]:
        self._open = message_item(new_item_id("msg"), None, "in_progress")
        self.output.append(self._open)
        added = self.event("response.output_item.added", output_index=self._index, item=self._open)
        self._open["content"].append(output_text_part(""))
        return [
            added,
            self.event(
                "response.content_part.added",
                item_id=self._open["id"],
                output_index=self._index,
                content_index=0,
                part=self._open["content"][0],
            ),
        ]
