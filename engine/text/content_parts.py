"""OpenAI's content parts as the text a chat template reads: each part's text, joined by newlines.

One reading for every caller: the chat route (`text` parts, and an assistant's `refusal` parts), the Responses
route (`input_text` / `output_text` parts) and the offline `LLM.chat`. A part of another type (an image, audio)
or without its text is a ContentPartError saying which part and what is wrong; each caller words it its way.
"""

from __future__ import annotations

from typing import Any, Mapping

CHAT_PARTS: Mapping[str, str] = {"text": "text"}  # part type -> the key of its text
ASSISTANT_PARTS: Mapping[str, str] = {"text": "text", "refusal": "refusal"}  # (its refusal is what it said)


class ContentPartError(ValueError):
    """Part `index` cannot be read: its type is not one of `kinds` (`unsupported`), or its text is not a string
    (`key` names where the text belongs)."""

    def __init__(self, index: int, kind: Any, key: str, unsupported: bool, kinds: Mapping[str, str]):
        self.index, self.kind, self.key, self.unsupported = index, kind, key, unsupported
        if unsupported:
            message = f"content part of type {kind!r} is not supported; only {' or '.join(map(repr, kinds))}"
        else:
            message = f"a {kind!r} content part needs its {key!r} as a string"
        super().__init__(message)


def joined_text(parts: list, kinds: Mapping[str, str]) -> str:
    """The texts of `parts` (each of a type in `kinds`), joined by newlines."""
    return "\n".join(part_texts(parts, kinds))


def part_texts(parts: list, kinds: Mapping[str, str]) -> list[str]:
    """The text of each of `parts` (each of a type in `kinds`)."""
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = kinds.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise ContentPartError(index, kind, "", True, kinds)
        text = part.get(key)
        if not isinstance(text, str):
            raise ContentPartError(index, kind, key, False, kinds)
        texts.append(text)
    return texts
