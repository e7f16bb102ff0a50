"""OpenAI's content parts as the text a chat template reads: each part's text, joined by newlines.

One reading for every caller: the chat route (`text` parts, and an assistant's `refusal` parts), the Responses
route (`input_text` / `output_text` parts) and the offline `LLM.chat`. A part of another type (audio; an image
where the model takes none) or without its text is a ContentPartError saying which part and what is wrong; each
caller words it its way. Where the model takes images, an image part (`image_url`, and vLLM's offline `image_pil`)
is read as an ImagePart, in its place among the texts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

CHAT_PARTS: Mapping[str, str] = {"text": "text"}  # part type -> the key of its text
ASSISTANT_PARTS: Mapping[str, str] = {"text": "text", "refusal": "refusal"}  # (its refusal is what it said)
IMAGE_PARTS: Mapping[str, str] = {"image_url": "image_url", "image_pil": "image_pil"}  # part type -> its image's key


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An image part: `source` its image (image_url's `{"url": ...}` or its URL, or a PIL image), `index` its
    place in the content."""

    index: int
    kind: str
    source: Any


def part_items(parts: list, kinds: Mapping[str, str], images: bool) -> list[Union[str, ImagePart]]:
    """Each part's text, or with `images` an image part as an ImagePart (in its place among the texts)."""
    items: list[Union[str, ImagePart]] = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = IMAGE_PARTS.get(kind) if images and isinstance(kind, str) else None
        if key is not None:
            source = part.get(key)
            if source is None:
                raise ContentPartError(index, kind, key, False, kinds, "an image")
            items.append(ImagePart(index, str(kind), source))
        else:
            items.append(part_texts([part], kinds, index)[0])
    return items


def template_content(
    items: list[Union[str, ImagePart]], content_format: str, placeholder: Optional[str]
) -> Union[str, list[dict]]:
    """A message's content as the chat template reads it: with the `openai` format a list of parts (`{"type":
    "text", "text"}` and `{"type": "image"}`, as HF's vision-language templates take them), else one text (each
    image written as the model's `placeholder`, the parts joined by newlines)."""
    if content_format == "openai":
        return [{"type": "text", "text": item} if isinstance(item, str) else {"type": "image"} for item in items]
    return "\n".join(item if isinstance(item, str) else (placeholder or "") for item in items)


class ContentPartError(ValueError):
    """Part `index` cannot be read: its type is not one of `kinds` (`unsupported`), or its text is not a string
    (`key` names where the text belongs)."""

    def __init__(
        self, index: int, kind: Any, key: str, unsupported: bool, kinds: Mapping[str, str], what: str = "a string"
    ):
        self.index, self.kind, self.key, self.unsupported = index, kind, key, unsupported
        if unsupported:
            message = f"content part of type {kind!r} is not supported; only {' or '.join(map(repr, kinds))}"
            if kind in IMAGE_PARTS:
                message += " (the model served takes no images)"
        else:
            message = f"a {kind!r} content part needs its {key!r} as {what}"
        super().__init__(message)


def joined_text(parts: list, kinds: Mapping[str, str]) -> str:
    """The texts of `parts` (each of a type in `kinds`), joined by newlines."""
    return "\n".join(part_texts(parts, kinds))


def part_texts(parts: list, kinds: Mapping[str, str], first_index: int = 0) -> list[str]:
    """The text of each of `parts` (each of a type in `kinds`; `first_index`: the first one's index, in errors)."""
    texts = []
    for index, part in enumerate(parts, first_index):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        key = kinds.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise ContentPartError(index, kind, "", True, kinds)
        text = part.get(key)
        if not isinstance(text, str):
            raise ContentPartError(index, kind, key, False, kinds)
        texts.append(text)
    return texts
