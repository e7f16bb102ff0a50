"""Chat messages as the chat template sees them: text, assistant tool calls and tool results."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from engine.text.chat_content_format import ContentFormat
from engine.text.content_parts import (
    ASSISTANT_PARTS,
    CHAT_PARTS,
    ContentPartError,
    ImagePart,
    part_items,
    template_content,
)
from engine.text.tokenizer import TEMPLATE_RENDERER_ARGUMENTS, Tokenizer
from server.http.errors import APIError, bad_request
from server.openai.chat_templates import TemplateChoice
from server.openai.protocol import ChatMessage


def render_text(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    tools: Optional[list[dict]] = None,
    param: str = "messages",
    *,
    continue_final_message: bool = False,
    template_kwargs: Optional[dict[str, Any]] = None,
    template: TemplateChoice = TemplateChoice(),
    image_placeholder: Optional[str] = None,
) -> str:
    """The conversation as its chat template writes it (a template error is a 400 on `param`); each image part is
    the template's `{"type": "image"}` part, or with the string format `image_placeholder` (a model that takes
    images: else image parts are a 400). `continue_final_message` and `template_kwargs` (vLLM's
    chat_template_kwargs) as Tokenizer.render_chat takes them; check them first with `check_template_options`.
    `template`: which template, and how content reaches it (ChatTemplates.choose)."""
    try:
        return tokenizer.render_chat(
            template_messages(messages, template.content_format, template.keep_developer, image_placeholder),
            add_generation_prompt,
            tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            chat_template=template.text,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from None


def check_template_options(
    add_generation_prompt: bool, continue_final_message: bool, template_kwargs: Optional[dict[str, Any]]
) -> None:
    """400s for template options that cannot render: both a new turn and the last one continued (as vLLM refuses
    them), or a chat_template_kwargs key that is one of the renderer's own arguments."""
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt to "
            "false to continue the last message.",
            param="continue_final_message",
        )
    for key in template_kwargs or {}:
        if key in ("add_generation_prompt", "continue_final_message"):
            raise bad_request(
                f"set {key} as a field of the request, not in chat_template_kwargs.",
                param=f"chat_template_kwargs.{key}",
            )
        if key in TEMPLATE_RENDERER_ARGUMENTS:
            raise bad_request(
                f"chat_template_kwargs cannot set {key!r}: it is an argument of the template's renderer.",
                param=f"chat_template_kwargs.{key}",
            )


def part_error(error: ContentPartError, param: str) -> APIError:
    """A content part that cannot be read as the 400 naming it (`param`: the content's path)."""
    if error.unsupported:
        return bad_request(f"{error}.", param=f"{param}[{error.index}]", code="unsupported_parameter")
    return bad_request(f"{error}.", param=f"{param}[{error.index}].{error.key}")


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


def template_messages(
    messages: Sequence[ChatMessage],
    content_format: ContentFormat = "string",
    keep_developer: bool = False,
    image_placeholder: Optional[str] = None,
) -> list[dict]:
    """`[{"role", "content"}]` for the chat template: content as text, or with `content_format` "openai" as a list
    of parts; `developer` becomes `system` unless `keep_developer` (a template that knows the role). Image parts
    are read where the model takes images (`image_placeholder`: what the string format writes for one)."""
    return [_template_message(m, i, content_format, keep_developer, image_placeholder) for i, m in enumerate(messages)]


def image_parts(messages: Sequence[ChatMessage]) -> list[tuple[str, ImagePart]]:
    """The messages' image parts in order, each with where it is (`messages[i].content[j]`)."""
    found = []
    for i, message in enumerate(messages):
        if message.role != "assistant" and isinstance(message.content, list):
            try:
                items = part_items(message.content, CHAT_PARTS, images=True)
            except ContentPartError as error:
                raise part_error(error, f"messages[{i}].content") from None
            found += [(f"messages[{i}].content[{item.index}]", item) for item in items if isinstance(item, ImagePart)]
    return found


def _template_message(
    message: ChatMessage,
    index: int,
    content_format: ContentFormat,
    keep_developer: bool,
    image_placeholder: Optional[str] = None,
) -> dict:
    param = f"messages[{index}]"
    if message.role == "function":
        raise bad_request(
            "function messages (deprecated) are not supported; use role 'tool'.",
            param=f"{param}.role",
            code="unsupported_parameter",
        )
    content = message.content
    extra = message.model_extra or {}
    if content is None and not (message.role == "assistant" and extra.get("tool_calls")):
        # as OpenAI: only an assistant's message that calls tools may go without content
        article = "an" if message.role == "assistant" else "a"
        raise bad_request(f"{article} {message.role} message needs content.", param=f"{param}.content")
    if message.role == "tool" and not isinstance(extra.get("tool_call_id"), str):
        raise bad_request("a tool message needs the tool_call_id it answers.", param=f"{param}.tool_call_id")
    kinds = ASSISTANT_PARTS if message.role == "assistant" else CHAT_PARTS
    if isinstance(content, list):
        if not content:
            raise bad_request("content must be a string or a non-empty list of parts.", param=f"{param}.content")
        try:
            items = part_items(content, kinds, images=image_placeholder is not None and kinds is CHAT_PARTS)
        except ContentPartError as error:
            raise part_error(error, f"{param}.content") from None
    else:
        items = [content] if content else []
    role = "system" if message.role == "developer" and not keep_developer else message.role
    out: dict[str, Any] = {"role": role}
    # as vLLM hands content to templates: text (images as the model's placeholder), or with the openai format a list
    # of parts (a string as one text part; an image as {"type": "image"})
    out["content"] = template_content(items, content_format, image_placeholder)
    if message.name is not None:  # a participant's name, for the templates that show it (as vLLM passes it)
        out["name"] = message.name
    if role == "tool":
        out["tool_call_id"] = extra["tool_call_id"]
    # an earlier turn's thinking, as --reasoning-parser returned it (vLLM's `reasoning`, or its older
    # `reasoning_content`): given to the template under both names (Qwen3's reads `reasoning_content`)
    thought = extra.get("reasoning", extra.get("reasoning_content"))
    if role == "assistant" and isinstance(thought, str):
        out["reasoning"] = out["reasoning_content"] = thought
    if extra.get("tool_calls"):
        if role != "assistant":
            raise bad_request("only assistant messages carry tool_calls.", param=f"{param}.tool_calls")
        out["tool_calls"] = _template_tool_calls(extra["tool_calls"], f"{param}.tool_calls")
    return out


def _template_tool_calls(calls, param: str) -> list[dict]:
    """OpenAI's tool_calls with their arguments as objects (as chat templates expect them)."""
    if not isinstance(calls, list):
        raise bad_request("tool_calls must be a list.", param=param)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request("a tool call needs function.name and function.arguments.", param=f"{param}[{i}]")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise bad_request(
                "function.arguments must be a JSON object's text.", param=f"{param}[{i}].function.arguments"
            ) from None
        out.append(
            {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}
        )
    return out
