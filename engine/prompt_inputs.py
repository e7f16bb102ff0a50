"""The offline API's prompts as callers give them (vLLM's forms: a string, token ids, a dict of "prompt" or
"prompt_token_ids"), one or a list; a conversation's messages as its chat template reads them."""

from __future__ import annotations

import numbers
import operator
from typing import Any, NamedTuple, Optional, Sequence, Union

from engine.multimodal.inputs import MultiModalInputs
from engine.text.chat_content_format import ContentFormat
from engine.text.content_parts import (
    ASSISTANT_PARTS,
    CHAT_PARTS,
    ContentPartError,
    ImagePart,
    part_items,
    template_content,
)

PromptType = Union[str, Sequence[int], dict]


class EncodedPrompt(NamedTuple):
    """A prompt's text (None when given as token ids), its token ids, and its images (a vision-language
    model's)."""

    text: Optional[str]
    token_ids: list[int]
    multi_modal: Optional[MultiModalInputs] = None


def chat_messages(
    conversation: list[dict], content_format: ContentFormat = "string", image_placeholder: Optional[str] = None
) -> tuple[list[dict], list[tuple[str, ImagePart]]]:
    """Messages whose content is OpenAI's parts, read as the server reads them (engine/text/content_parts.py: with
    the `string` format, texts joined by newlines; with `openai`, parts, a string as one text part), and their
    image parts in order, each with where it is ("messages[i].content[j]"). Image parts are refused unless the
    model takes images (`image_placeholder`: what the `string` format writes for one); audio always."""
    out, images = [], []
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            kinds = ASSISTANT_PARTS if message.get("role") == "assistant" else CHAT_PARTS
            try:
                items = part_items(content, kinds, images=image_placeholder is not None and kinds is CHAT_PARTS)
            except ContentPartError as error:
                raise ValueError(f"message {i}, part {error.index}: {error}") from None
        elif isinstance(content, str):
            items = [content] if content else []
        else:
            out.append(message)
            continue
        images += [(f"messages[{i}].content[{item.index}]", item) for item in items if isinstance(item, ImagePart)]
        out.append({**message, "content": template_content(items, content_format, image_placeholder)})
    return out, images


def as_prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)  # one prompt's token ids, or prompts: told apart by the first item
    if items and isinstance(items[0], numbers.Integral):
        return [items]  # one prompt given as token ids (numpy's integers too)
    return items


def token_ids_of(prompt: Any) -> list[int]:
    """Plain ints of a prompt's ids (numpy's integers and arrays included)."""
    ids = []
    for token in prompt:
        try:
            if isinstance(token, bool):
                raise TypeError
            ids.append(operator.index(token))
        except TypeError:
            raise TypeError(f"a prompt is a string, token ids (ints) or a dict; got a token id {token!r}") from None
    return ids
