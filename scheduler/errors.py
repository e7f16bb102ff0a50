"""Errors the scheduler raises for requests it refuses, each carrying the facts of the refusal.

The messages are plain descriptions for logs and offline users; a front end
that answers remote clients words its own replies from the fields.
"""

from __future__ import annotations

from typing import Optional


class RequestRejectedError(ValueError):
    """A request that can never be served, as it stands.

    `field` names the request field at fault in the engine's terms ("prompt",
    "max_tokens", ...), or is None when no single field is.
    """

    field: Optional[str] = None

    def __init__(self, message: str, *, field: Optional[str] = None):
        super().__init__(message)
        self.message = message
        if field is not None:
            self.field = field


class EmptyPromptError(RequestRejectedError):
    """The prompt has no token."""

    field = "prompt"

    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class InvalidMaxTokensError(RequestRejectedError):
    """`max_tokens` below 1: the request could produce nothing."""

    field = "max_tokens"

    def __init__(self, max_tokens: int):
        super().__init__(f"max_tokens must be at least 1, got {max_tokens}")
        self.max_tokens = max_tokens


class MinTokensOutOfRangeError(RequestRejectedError):
    """`min_tokens` negative, or above `max_tokens` (None: no maximum known yet)."""

    field = "min_tokens"

    def __init__(self, min_tokens: int, max_tokens: Optional[int]):
        bounds = "non-negative" if max_tokens is None else f"between 0 and max_tokens ({max_tokens})"
        super().__init__(f"min_tokens must be {bounds}, got {min_tokens}")
        self.min_tokens = min_tokens
        self.max_tokens = max_tokens


class ContextLengthExceededError(RequestRejectedError):
    """The prompt plus `max_tokens` is longer than `max_model_len`."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} prompt + {max_tokens} max_tokens) "
            f"exceed max_model_len {max_model_len}"
            if max_tokens  # (0: a prefill-only request's, which generates nothing)
            else f"{num_prompt_tokens} prompt tokens exceed max_model_len {max_model_len}"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    @property
    def field(self) -> str:  # type: ignore[override]
        """ "prompt" when the prompt alone fills the context, else "max_tokens"."""
        return "prompt" if self.num_prompt_tokens >= self.max_model_len else "max_tokens"


class KVCacheTooSmallError(RequestRejectedError):
    """The request needs more KV blocks than the whole pool holds (`prompt_alone`: even with max_tokens 1)."""

    def __init__(
        self,
        num_prompt_tokens: int,
        max_tokens: int,
        num_blocks_needed: int,
        num_blocks: int,
        block_size: int,
        prompt_alone: bool = False,
    ):
        needs = f"{num_prompt_tokens} prompt tokens" + (f" + {max_tokens} max_tokens" if max_tokens else "")
        super().__init__(
            f"{needs} need {num_blocks_needed} KV blocks of {block_size} tokens; the pool holds {num_blocks}"
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.num_blocks_needed = num_blocks_needed
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prompt_alone = prompt_alone

    @property
    def field(self) -> str:  # type: ignore[override]
        """ "prompt" when the prompt alone does not fit (no max_tokens would make it), else "max_tokens"."""
        return "prompt" if self.prompt_alone else "max_tokens"


class DuplicateRequestIdError(RequestRejectedError):
    """Another unfinished request has this id."""

    field = "request_id"

    def __init__(self, request_id: str):
        super().__init__(f"request id {request_id!r} is already in use")
        self.request_id = request_id


class MediaSpanTooLongError(RequestRejectedError):
    """A media span whose tokens attend to each other both ways (an image of Gemma 3) is computed in one step,
    and is longer than a step's token budget."""

    field = "prompt"

    def __init__(self, span_tokens: int, max_num_batched_tokens: int):
        super().__init__(
            f"an image of {span_tokens} tokens must be computed in one step (its tokens attend to each other both "
            f"ways), but a step computes at most {max_num_batched_tokens} tokens (max_num_batched_tokens); raise "
            f"--max-num-batched-tokens to at least {span_tokens}"
        )
        self.span_tokens = span_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
