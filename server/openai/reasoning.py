"""`--reasoning-parser`, as vLLM's: a reasoning model's thinking (between `<think>` and `</think>`) returned apart
from its answer, in the chat message's `reasoning` (vLLM's field; `reasoning_content` before it) and in stream
deltas as it is written.

    deepseek_r1  the output starts in the thinking (its template ends the prompt with <think>, or the model writes
                 it): everything up to </think> is reasoning; an output cut off before it is all reasoning
    qwen3        thinking only where the output begins with <think>, or the rendered prompt ends with it (Qwen3's
                 thinking templates); with enable_thinking false the template closes the thinking in the prompt
                 and the whole output is content

A leading <think> written by the model is dropped; the text after </think> is the content as written (None when
empty). The non-streamed split is the streamed one fed the whole text, so the two always agree.
"""

from __future__ import annotations

from typing import Optional

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def starts_in_reasoning(parser: str, prompt_tail: str) -> bool:
    """Whether the output begins inside the thinking, by the parser and the rendered prompt's last text."""
    return parser == "deepseek_r1" or prompt_tail.rstrip().endswith(START)


class ReasoningSplitter:
    """One choice's text deltas in, (reasoning piece, content piece) out, in order."""

    def __init__(self, in_reasoning: bool):
        self._state = "reasoning" if in_reasoning else "undecided"
        self._at_start = True  # a leading <think> (after whitespace) is the marker, not text
        self._pending = ""

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        reasoning = content = ""
        text = self._pending + delta
        self._pending = ""
        if self._at_start:
            head = text.lstrip()
            if head.startswith(START):
                text, self._state = head[len(START) :], "reasoning"
            elif START.startswith(head) and not finished:  # (nothing yet, or a piece of the marker)
                self._pending = text
                return "", ""
            elif self._state == "undecided":
                self._state = "content"
            self._at_start = False
        if self._state == "reasoning":
            at = text.find(END)
            if at >= 0:
                reasoning, content, self._state = text[:at], text[at + len(END) :], "content"
            else:
                keep = 0 if finished else _end_prefix(text)
                reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        else:
            content = text
        return reasoning, content

    def split(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """A whole output as (reasoning, content), each None when empty."""
        reasoning, content = self.feed(text, True)
        return reasoning or None, content or None


def _end_prefix(text: str) -> int:
    """The length of the longest end of `text` that begins </think> (the marker may be arriving)."""
    for length in range(min(len(text), len(END) - 1), 0, -1):
        if text.endswith(END[:length]):
            return length
    return 0
