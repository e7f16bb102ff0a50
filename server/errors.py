"""OpenAI's error envelope and the exceptions that map onto it."""

from __future__ import annotations

from http import HTTPStatus
from typing import Optional

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`, for every error the server returns."""

    error: ErrorInfo


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error answered with an OpenAI envelope and an HTTP status."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    error_type = _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# Declared on every route in the OpenAPI schema.
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase}
    for status in (400, 401, 404, 429, 500, 503)
}
