"""Chat messages as the chat template sees them (text only; tools refused)."""

from __future__ import annotations

from typing import Sequence

from engine.text.tokenizer import Tokenizer
from server.errors import bad_request
from server.protocol import ChatMessage


def render_prompt(tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """The prompt token ids of a conversation (a template error is a 400 on `messages`)."""
    try:
        return tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None


def message_chars(messages: Sequence[ChatMessage]) -> int:
    """Characters of text in the messages' contents (what the template adds is not counted)."""
    total = 0
    for message in messages:
        content = message.content
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content if isinstance(part.get("text"), str))
    return total


def template_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """`[{"role", "content"}]` for the tokenizer's chat template; `developer` becomes `system`."""
    return [_template_message(m, i) for i, m in enumerate(messages)]


def _template_message(message: ChatMessage, index: int) -> dict:
    param = f"messages[{index}]"
    if message.role in ("tool", "function") or (message.model_extra or {}).get("tool_calls"):
        raise bad_request("tool and function messages are not supported.", param=f"{param}.role",
                          code="unsupported_parameter")
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"content part of type {part.get('type')!r} is not supported; only 'text'.",
                                  param=f"{param}.content[{j}]", code="unsupported_parameter")
            texts.append(part["text"])
        content = "\n".join(texts)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}
