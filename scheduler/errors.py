"""Errors the scheduler raises for requests it refuses."""

from __future__ import annotations

from typing import Optional


class RequestRejectedError(ValueError):
    """A request that can never be served (the server answers 400).

    `param` names the offending request field and `code` is the OpenAI error
    code, e.g. "context_length_exceeded".
    """

    def __init__(self, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
