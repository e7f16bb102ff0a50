"""A Responses request in chat terms: `instructions` + `input` items as chat messages, flat function tools and
`tool_choice` as chat's, `text.format` as a structured-output constraint. Bad input is a 400 naming its field
as the Responses API spells it (`input[2].content[0]`, `tools[1].parameters`, `text.format.schema`).

    input item                                      chat message
    {"role", "content": str | [input_text, ...]}    {"role", "content": str}
    {"role": "user", "content": [input_image, ...]} {"role": "user", "content": [text and image_url parts]}
                                                    (a vision-language model's; else input_image is a 400)
    {"type": "function_call", call_id, name, ...}   assistant message with tool_calls (consecutive ones merged)
    {"type": "function_call_output", call_id, ...}  {"role": "tool", "tool_call_id", "content"}
"""

from __future__ import annotations

import json
from typing import Any, Optional

from engine.structured import StructuredOutputs
from engine.text.content_parts import ContentPartError, joined_text
from server.http.errors import bad_request
from server.openai.chat_messages import part_error
from server.openai.protocol import ChatMessage

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = {"input_text": "text", "output_text": "text"}  # (output_text: an assistant's earlier output)


def chat_messages(instructions: Optional[str], items: Any, takes_images: bool = False) -> list[ChatMessage]:
    """The conversation the chat template renders: the instructions as the system message, then the input (a
    user message's `input_image` parts as chat's `image_url` parts where the model `takes_images`)."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    if isinstance(items, str):
        return messages + [ChatMessage(role="user", content=items)]
    if not items:
        raise bad_request("input must not be empty.", param="input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param, takes_images))
        elif kind == "function_call":
            _add_call(messages, item, param)
        elif kind == "function_call_output":
            messages.append(_call_output(item, param))
        else:
            raise bad_request(
                f"input items of type {kind!r} are not supported; use messages, function_call and "
                "function_call_output.",
                param=f"{param}.type",
                code="unsupported_parameter",
            )
    return messages


def _message(item: dict, param: str, takes_images: bool) -> ChatMessage:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"role must be one of {', '.join(_ROLES)}.", param=f"{param}.role")
    content = item.get("content")
    if takes_images and role == "user" and isinstance(content, list):
        if any(isinstance(part, dict) and part.get("type") == "input_image" for part in content):
            return ChatMessage(
                role=role, content=[_chat_part(part, f"{param}.content[{j}]") for j, part in enumerate(content)]
            )
    return ChatMessage(role=role, content=_text(content, f"{param}.content"))


def _chat_part(part: Any, param: str) -> dict:
    """An input_text or input_image part as chat's text or image_url part (an image by URL: `file_id` is refused)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise bad_request(
                "input_image by file_id is not supported; send image_url.",
                param=f"{param}.file_id",
                code="unsupported_parameter",
            )
        if not isinstance(part.get("image_url"), str):
            raise bad_request(
                "an input_image part needs image_url (an http(s) or data: URL).", param=f"{param}.image_url"
            )
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    raise bad_request("a user message with images takes input_text and input_image parts.", param=param)


def _text(content: Any, param: str) -> str:
    """A string, or the text of a list of input_text (output_text in assistant history) parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("content must be a string or a list of input_text parts.", param=param)
    try:
        return joined_text(content, _TEXT_PARTS)
    except ContentPartError as error:
        raise part_error(error, param) from None


def _add_call(messages: list[ChatMessage], item: dict, param: str) -> None:
    """An earlier function call of the model: appended to the assistant message just before, or a new one."""
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise bad_request(f"a function_call item needs {field} as a string.", param=f"{param}.{field}")
    try:  # here, where its place in `input` is known (the chat path would name messages[...].tool_calls)
        json.loads(item["arguments"])
    except ValueError:
        raise bad_request("arguments must be a JSON object's text.", param=f"{param}.arguments") from None
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        extra = last.model_extra
        assert extra is not None  # ChatMessage allows extra fields: pydantic keeps them in a dict
        extra["tool_calls"] = [*(extra.get("tool_calls") or []), call]
        return
    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _call_output(item: dict, param: str) -> ChatMessage:
    if not isinstance(item.get("call_id"), str):
        raise bad_request("a function_call_output item needs call_id.", param=f"{param}.call_id")
    return ChatMessage(role="tool", content=_text(item.get("output"), f"{param}.output"), tool_call_id=item["call_id"])


def chat_tools(tools: Optional[list]) -> Optional[list[dict]]:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}`; built-in tools
    (web_search, file_search, ...) are refused by name."""
    if tools is None:
        return None
    out: list[dict] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(
                f"tools of type {kind!r} are not supported; only function tools.",
                param=f"tools[{i}].type",
                code="unsupported_parameter",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request("a function tool needs a name.", param=f"tools[{i}].name")
        if any(earlier["function"]["name"] == tool["name"] for earlier in out):  # (chat's check names chat's field)
            raise bad_request(f"tools[{i}] repeats the function name {tool['name']!r}.", param=f"tools[{i}].name")
        parameters = tool.get("parameters") or {"type": "object"}
        if not isinstance(parameters, dict):
            raise bad_request("parameters must be a JSON Schema object.", param=f"tools[{i}].parameters")
        StructuredOutputs.of_kind("json", parameters, f"tools[{i}].parameters")  # checked, by name
        function = {k: tool[k] for k in ("name", "description", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": {**function, "parameters": parameters}})
    return out


def chat_tool_choice(tool_choice: Any) -> Any:
    """`{"type": "function", "name"}` as chat's `{"type": "function", "function": {"name"}}`; the strings as
    they are; any other kind (allowed_tools, built-in tools, mcp...) refused by name."""
    if tool_choice is None or tool_choice in ("none", "auto", "required"):
        return tool_choice
    if isinstance(tool_choice, str):  # (chat's message would show chat's shape of a named function)
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.', param="tool_choice"
        )
    kind = tool_choice.get("type")
    if kind != "function":
        raise bad_request(
            f"tool_choice of type {kind!r} is not supported; use none, auto, required or "
            '{"type": "function", "name": ...}.',
            param="tool_choice",
            code="unsupported_parameter",
        )
    if not isinstance(tool_choice.get("name"), str):
        raise bad_request("tool_choice of type function needs the function's name.", param="tool_choice.name")
    return {"type": "function", "function": {"name": tool_choice["name"]}}


def text_constraint(text: Optional[dict]) -> Optional[tuple[StructuredOutputs, str]]:
    """`text.format`: text (none), json_object, or json_schema `{"name", "schema", "strict"}`."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown or text.get("verbosity") not in (None, "medium"):
        name = unknown[0] if unknown else "verbosity"
        raise bad_request(f"text.{name} is not supported.", param=f"text.{name}", code="unsupported_parameter")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True), "text.format"
    if kind != "json_schema":
        raise bad_request(
            f"text.format type {kind!r} is not supported; use text, json_object or json_schema.",
            param="text.format.type",
        )
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema", {}), dict):
        raise bad_request("text.format json_schema needs a name and a schema object.", param="text.format")
    schema = fmt.get("schema", {})
    if schema == {}:
        return StructuredOutputs(json_object=True), "text.format.schema"
    return StructuredOutputs.of_kind("json", schema, "text.format.schema"), "text.format.schema"
