"""Which chat template a request renders with, and how its messages reach it: the server's settings
(--chat-template-content-format, --default-chat-template-kwargs, --trust-request-chat-template) with the request's
own chat_template and chat_template_kwargs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from engine.loading.chat_template import check_chat_template
from engine.text.chat_content_format import ContentFormat, detect_content_format, names_developer_role
from engine.text.tokenizer import Tokenizer
from server.config.server_config import ServerConfig
from server.http.errors import bad_request


@dataclass(frozen=True)
class TemplateChoice:
    """A request's template: `text` None is the tokenizer's own; `content_format` how content reaches it;
    `keep_developer` whether developer messages keep that role (else they become system messages)."""

    text: Optional[str] = None
    content_format: ContentFormat = "string"
    keep_developer: bool = False


@dataclass
class ChatTemplates:
    """The server's chat template settings over one tokenizer. What the tokenizer's own templates read is worked
    out once per template (a request's own template, each time it comes)."""

    tokenizer: Tokenizer
    config: ServerConfig
    _known: dict[str, TemplateChoice] = field(default_factory=dict)

    def choose(self, request_template: Optional[str], tools: Optional[list[dict]], param: str) -> TemplateChoice:
        """The template for a request that gives `request_template` (None: the tokenizer's) and shows `tools`; a
        400 naming `param` for a request template the server does not trust or that does not parse."""
        if request_template is not None:
            if not self.config.trust_request_chat_template:
                raise bad_request(
                    "this request gives its own chat_template, which the server renders only when started with "
                    "--trust-request-chat-template.",
                    param=param,
                )
            try:
                check_chat_template(request_template, "chat_template")
            except ValueError as error:
                raise bad_request(f"{error}.", param=param) from None
            return self._choice(request_template)
        try:
            text = self.tokenizer.chat_template_text(tools)
        except ValueError as error:  # HF's: named templates and none of them the default
            raise bad_request(f"the model's chat template cannot be chosen: {error}", param=param) from None
        if text is None:
            return TemplateChoice(content_format=self._fixed_format() or "string")
        known = self._known.get(text)
        if known is None:  # (one or two entries: the tokenizer's default template and its tool_use one)
            known = self._known[text] = self._choice(text)
        return known

    def kwargs(self, request_kwargs: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        """The template variables: --default-chat-template-kwargs, the request's chat_template_kwargs over them."""
        defaults = self.config.default_chat_template_kwargs
        if not defaults:
            return request_kwargs
        return {**defaults, **(request_kwargs or {})}

    def _choice(self, text: str) -> TemplateChoice:
        content_format = self._fixed_format() or detect_content_format(text)
        return TemplateChoice(text, content_format, names_developer_role(text))

    def _fixed_format(self) -> Optional[ContentFormat]:
        given = self.config.chat_template_content_format
        return None if given == "auto" else given
