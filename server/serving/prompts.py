"""What a generation request is prompted with, and its token ids: a conversation rendered by the chat
template (with its images, for a vision-language model: fetched, then processed with the text by the model's
processor), or text / token ids as given. Text is measured first (a prompt that cannot fit is a 400 before
any tokenizing), then rendered and tokenized off the event loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence, Union

from engine.errors import InvalidParameterError
from engine.multimodal.inputs import MultiModalInputs
from server.http.errors import bad_request
from server.openai.chat_messages import check_template_options, image_parts, message_chars, render_text
from server.openai.protocol import ChatMessage
from server.serving.checks import check_prompt_chars
from server.serving.media import load_images

if TYPE_CHECKING:
    from server.state import ServerState


def truncate(
    state: "ServerState", prompts: list[list[int]], keep: Optional[int], side: Optional[str] = None
) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: the model's context length), or with
    truncation_side "right" its first; a 400 for a value that would leave no prompt or is more than the context
    holds, and for a side without a count."""
    if keep is None:
        if side is not None:
            raise bad_request("truncation_side needs truncate_prompt_tokens.", param="truncation_side")
        return prompts
    limit = state.max_model_len
    if keep == -1:
        keep = limit
    if not 1 <= keep <= limit:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context length) or between 1 and max_model_len ({limit}), "
            f"got {keep}.",
            param="truncate_prompt_tokens",
        )
    return [prompt[:keep] if side == "right" else prompt[-keep:] for prompt in prompts]


@dataclass(frozen=True)
class Rendered:
    """A request's prompts: each one's token ids, and its images (a vision-language model's; else None)."""

    token_ids: list[list[int]]
    multi_modal: list[Optional[MultiModalInputs]]

    @classmethod
    def text(cls, token_ids: list[list[int]]) -> "Rendered":
        return cls(token_ids, [None] * len(token_ids))


class Prompt(Protocol):
    @property
    def param(self) -> str:
        """The request field that holds it, named in its errors."""

    @property
    def count(self) -> int:
        """How many prompts (each is answered by n choices)."""

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        """Every prompt's token ids (truncated as `truncate_prompt_tokens` asks); a 400 naming `param` for one
        that is empty or cannot fit."""

    async def render(self, state: "ServerState") -> Rendered:
        """`token_ids`, with each prompt's images."""


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
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: keep the rendered prompt's last tokens
    truncation_side: Optional[str] = None  # vLLM's: "right" keeps the first tokens instead
    chat_template: Optional[str] = None  # vLLM's: the request's own template (under --trust-request-chat-template)
    check_length: bool = True  # a text too long to ever fit is a 400 before rendering (/tokenize measures any)

    @property
    def count(self) -> int:
        return 1

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        return (await self.render(state)).token_ids

    async def render(self, state: "ServerState") -> Rendered:
        if not self.messages:
            raise bad_request(f"{self.param} must not be empty.", param=self.param)
        template_kwargs = state.templates.kwargs(self.template_kwargs)
        check_template_options(self.add_generation_prompt, self.continue_final_message, template_kwargs)
        truncate(state, [], self.truncate_prompt_tokens, self.truncation_side)  # (refused before any work)
        if self.truncate_prompt_tokens is None and self.check_length:  # (a truncated prompt may be any length)
            check_prompt_chars(state, message_chars(self.messages), self.param)
        processor = state.engine.processor
        parts = image_parts(self.messages) if processor is not None else []
        if processor is not None:
            try:
                processor.check_count(len(parts), self.param)
            except InvalidParameterError as error:
                raise bad_request(f"{error}.", param=self.param) from None
        images = await load_images(state, parts) if parts else []
        template = state.templates.choose(self.chat_template, self.tools, "chat_template")

        def work() -> tuple[list[int], Optional[MultiModalInputs]]:
            text = render_text(
                state.tokenizer,
                self.messages,
                self.add_generation_prompt,
                self.tools,
                self.param,
                continue_final_message=self.continue_final_message,
                template_kwargs=template_kwargs,
                template=template,
                image_placeholder=None if processor is None else processor.image_placeholder,
            )
            if processor is None:
                return state.tokenizer.encode(text, add_special_tokens=self.add_special_tokens), None
            try:
                return processor.process(text, images, add_special_tokens=self.add_special_tokens, param=self.param)
            except InvalidParameterError as error:
                raise bad_request(f"{error}.", param=self.param) from None

        token_ids, multi_modal = await asyncio.to_thread(work)
        kept = truncate(state, [token_ids], self.truncate_prompt_tokens, self.truncation_side)
        if multi_modal is not None and len(kept[0]) < len(token_ids):
            raise bad_request(
                "truncate_prompt_tokens cannot cut a prompt with images; leave it unset.",
                param="truncate_prompt_tokens",
            )
        return Rendered(kept, [multi_modal])


TextOrTokens = Union[str, list[str], list[int], list[list[int]]]


@dataclass(frozen=True)
class TextPrompts:
    """Completions' prompt: one text, several, one list of token ids, or several."""

    prompt: TextOrTokens
    param: str = "prompt"
    add_special_tokens: bool = True  # text only: the tokenizer's BOS and the like (vLLM's field and default)
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: keep each prompt's last tokens
    truncation_side: Optional[str] = None  # vLLM's: "right" keeps the first tokens instead

    @property
    def count(self) -> int:
        prompt = self.prompt
        return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        prompt = self.prompt
        if not isinstance(prompt, str) and not prompt:
            raise bad_request(f"{self.param} must not be empty.", param=self.param)
        keep, side = self.truncate_prompt_tokens, self.truncation_side
        truncate(state, [], keep, side)  # (a bad value refused before any work)
        if isinstance(prompt, str) or isinstance(prompt[0], str):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if keep is None:  # (a prompt that will be truncated may be any length)
                for text in texts:
                    check_prompt_chars(state, len(text), self.param)
            tokenizer, special = state.tokenizer, self.add_special_tokens
            encoded = await asyncio.to_thread(lambda: [tokenizer.encode(text, special) for text in texts])
            return truncate(state, encoded, keep, side)
        if isinstance(prompt[0], int):
            return truncate(state, [list(prompt)], keep, side)
        return truncate(state, [list(p) for p in prompt], keep, side)

    async def render(self, state: "ServerState") -> Rendered:
        return Rendered.text(await self.token_ids(state))


@dataclass(frozen=True)
class PairPrompts:
    """Text pairs for a cross-encoder (scoring with a classifier): each pair tokenized together, as the tokenizer
    joins a text pair, off the event loop; `truncate_prompt_tokens` keeps each pair's first tokens (the query's)."""

    pairs: Sequence[tuple[str, str]]
    param: str
    truncate_prompt_tokens: Optional[int] = None

    @property
    def count(self) -> int:
        return len(self.pairs)

    async def token_ids(self, state: "ServerState") -> list[list[int]]:
        keep = self.truncate_prompt_tokens
        side = None if keep is None else "right"
        truncate(state, [], keep, side)  # (a bad value refused before any work)
        if keep is None:
            for first, second in self.pairs:
                check_prompt_chars(state, len(first) + len(second), self.param)
        tokenizer = state.tokenizer.hf
        joined = await asyncio.to_thread(lambda: [tokenizer(text=a, text_pair=b)["input_ids"] for a, b in self.pairs])
        if any(not ids for ids in joined):
            raise bad_request(f"{self.param} must not be empty.", param=self.param)
        return truncate(state, joined, keep, side)

    async def render(self, state: "ServerState") -> Rendered:
        return Rendered.text(await self.token_ids(state))
