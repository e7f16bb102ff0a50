"""The tokenizer: a thin wrapper over the HF fast tokenizer with chat templates and stop-token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Optional, Sequence, Union, overload

from engine.errors import TokenIdOutOfVocabularyError
from engine.loading.chat_template import check_chat_template, is_template_file
from engine.loading.loader import CheckpointError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# The chat template renderer's own arguments (HF's apply_chat_template and what it hands the template): a
# template variable of these names (vLLM's chat_template_kwargs) would collide with them.
TEMPLATE_RENDERER_ARGUMENTS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Refuse ids outside the model's vocabulary (TokenIdOutOfVocabularyError naming `field`)."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TokenIdOutOfVocabularyError(field, bad, vocab_size)


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Text <-> token ids for one model.

    `hf` is the underlying HF fast tokenizer (the incremental detokenizer uses it directly).
    `eos_token_ids` holds every id that ends generation: the tokenizer's eos plus
    generation_config.json's `eos_token_id` (an int or a list).
    """

    hf: "PreTrainedTokenizerBase"
    eos_token_ids: frozenset[int]
    max_token_id: int  # largest id the tokenizer can produce, added tokens included
    max_token_chars: Optional[int] = None  # the longest vocabulary entry's length: bounds text per token

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (the model's embedding may be larger)."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: Optional[list[dict]] = None,
        *,
        continue_final_message: bool = False,
        template_kwargs: Optional[Mapping[str, Any]] = None,
        chat_template: Optional[str] = None,
    ) -> str:
        """The prompt text the model's chat template makes of `messages` (and of `tools`, for templates that
        show them). `continue_final_message`: the last message left open (no end-of-turn after it), so the model
        continues it; `template_kwargs`: more variables for the template (vLLM's chat_template_kwargs, e.g.
        `enable_thinking`), none of them one of the renderer's own arguments (`messages`, `tools`, ...);
        `chat_template`: Jinja text used instead of the tokenizer's (a request's, under
        --trust-request-chat-template)."""
        from jinja2.exceptions import TemplateError

        if chat_template is None and not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt")
        try:
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **(template_kwargs or {}),
            )
        except TemplateError as exc:
            raise ValueError(f"the chat template rejected these messages: {exc}") from exc
        except (TypeError, ArithmeticError, LookupError, RecursionError) as exc:
            # a template's own expression failing on these messages (`1 / 0`, `'a' + 1`, endless recursion), which a
            # request's template under --trust-request-chat-template can write: the request's fault, not a bug
            raise ValueError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from exc

    def chat_template_text(self, tools: Optional[list[dict]] = None) -> Optional[str]:
        """The Jinja text `render_chat` renders with `tools` (a tokenizer may keep a named `tool_use` template
        beside its default), or None when it has none."""
        if not self.has_chat_template:
            return None
        return self.hf.get_chat_template(None, tools)

    @overload
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = False,
        tokenize: Literal[True] = True,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = False,
        tokenize: Literal[False],
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        tools: Optional[list[dict]] = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> Union[list[int], str]:
        """Token ids of the chat prompt (the template writes any special tokens itself); `tokenize=False`: its
        text. HF's method's names and defaults (what vLLM's `get_tokenizer()` returns): no generation prompt
        unless asked for."""
        text = self.render_chat(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def load_tokenizer(
    path: Union[str, Path],
    *,
    trust_remote_code: bool = False,
    chat_template: Optional[str] = None,
    generation_config_dir: Union[str, Path, None] = None,
) -> Tokenizer:
    """The tokenizer saved in a checkpoint directory (tokenizer.json et al., generation_config.json).

    `trust_remote_code` lets the checkpoint's own tokenizer code run; `chat_template` (Jinja text or a
    file holding it, see `read_chat_template`) replaces the tokenizer's chat template. `generation_config_dir`:
    where the generation_config.json whose `eos_token_id` also ends generation lies (the model's directory,
    as vLLM reads it, when the tokenizer comes from elsewhere); None: `path`.
    """
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
    if chat_template is not None:
        hf.chat_template = read_chat_template(chat_template)
    eos = set(generation_eos_token_ids(Path(path if generation_config_dir is None else generation_config_dir)))
    if hf.eos_token_id is not None:
        eos.add(hf.eos_token_id)
    vocab = hf.get_vocab()
    max_token_id = max(vocab.values())
    max_token_chars = max(len(token) for token in vocab)
    return Tokenizer(hf=hf, eos_token_ids=frozenset(eos), max_token_id=max_token_id, max_token_chars=max_token_chars)


def looks_like_jinja(text: str) -> bool:
    return any(mark in text for mark in ("{{", "{%", "{#"))


def read_chat_template(value: str) -> str:
    """The Jinja text of a chat template given as a file path (read) or inline (as is), checked to parse;
    ValueError says what is wrong (as vLLM's --chat-template, a path that exists wins)."""
    path = Path(value).expanduser()
    if is_template_file(value):
        try:
            text, where = path.read_text(), f"chat template file {value!r}"
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template file {value!r}: {exc}") from None
    elif looks_like_jinja(value):
        text, where = value, "the inline chat template"
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a Jinja template")
    check_chat_template(text, where)
    return text


def generation_eos_token_ids(path: Path) -> frozenset[int]:
    """`eos_token_id` of generation_config.json in `path` (int or list); empty when absent."""
    try:
        value = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        return frozenset()
    if value is None:
        return frozenset()
    values = value if isinstance(value, list) else [value]
    return frozenset(int(v) for v in values)
