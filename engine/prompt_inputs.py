"""The offline API's prompts as callers give them (vLLM's forms: a string, token ids, a dict of "prompt" or
"prompt_token_ids"), one or a list."""

from __future__ import annotations

import numbers
import operator
from typing import Any, Sequence, Union

PromptType = Union[str, Sequence[int], dict]


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
