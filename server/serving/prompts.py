"""What a generation request is prompted with, and its token ids: a conversation rendered by the chat
template, or text / token ids as given. Text is measured first (a prompt that cannot fit is a 400 before
any tokenizing), then rendered and tokenized off the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union

from server.http.errors import bad_request
from server.openai.chat_messages import check_template_options, message_chars, render_prompt
from server.openai.protocol import ChatMessage
from server.serving.checks import check_prompt_chars

if TYPE_CHECKING:
    from server.state import ServerState


class Prompt(Protocol):
    @property
    def param(self) -> str:
        """The request field that holds it, named in its errors."""

    @property
    def count(self) -> int:
        """How many prompts (each is answered by n choices)."""

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        """Every prompt's token ids; a 400 naming `param` for one that is empty or cannot fit."""


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation, rendered by the model's chat template (with the tools it is offered)."""

    messages: Sequence[ChatMessage]
    add_generation_prompt: bool = True
    tools: Optional[list[dict]] = None
    param: str = "messages"
    add_special_tokens: bool = False  # vLLM's chat default: the template writes them
    continue_final_message: bool = False
    template_kwargs: Optional[dict[str, Any]] = None  # vLLM's chat_template_kwargs

    @property
    def count(self) -> int:
        return 1

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        if not self.messages:
            raise bad_request(f"{self.param} must not be empty.", param=self.param)
        check_template_options(self.add_generation_prompt, self.continue_final_message, self.template_kwargs)
        check_prompt_chars(state, message_chars(self.messages), self.param)
        return [
            await asyncio.to_thread(
                lambda: render_prompt(
                    state.tokenizer,
                    self.messages,
                    self.add_generation_prompt,
                    self.tools,
                    self.param,
                    self.add_special_tokens,
                    continue_final_message=self.continue_final_message,
                    template_kwargs=self.template_kwargs,
                )
            )
        ]


TextOrTokens = Union[str, list[str], list[int], list[list[int]]]


@dataclass(frozen=True)
class TextPrompts:
    """Completions' prompt: one text, several, one list of token ids, or several."""

    prompt: TextOrTokens
    param: str = "prompt"
    add_special_tokens: bool = True  # text only: the tokenizer's BOS and the like (vLLM's field and default)

    @property
    def count(self) -> int:
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        prompt = self.prompt
        if not isinstance(prompt, str) and not prompt:
            raise bad_request(f"{self.param} must not be empty.", param=self.param)
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            for text in texts:
                check_prompt_chars(state, len(text), self.param)
            tokenizer, special = state.tokenizer, self.add_special_tokens
            return await asyncio.to_thread(lambda: [tokenizer.encode(text, special) for text in texts])
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return [list(p) for p in prompt]
