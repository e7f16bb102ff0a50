"""OpenAI's error envelope and the exceptions that map onto it."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from pydantic import BaseModel

from engine.async_engine import EngineDeadError
from scheduler import RequestRejectedError
from server.serving.rejections import describe_rejection

if TYPE_CHECKING:
    from server.observability.metrics import ServerMetrics

logger = logging.getLogger(__name__)


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
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error answered with an OpenAI envelope and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ):
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


def model_not_found(requested: str, served: Sequence[str], param: str = "model") -> APIError:
    """OpenAI's (and vLLM's) 404 for a model id, or a LoRA adapter's name, that this server does not serve."""
    return APIError(
        404,
        f"The model {requested!r} does not exist; this server serves {', '.join(map(repr, served))}.",
        param=param,
        code="model_not_found",
    )


def handle_error(exc: BaseException, metrics: ServerMetrics, where: str, *, log_stack: bool = False) -> APIError:
    """What the client sees for an exception raised while serving `where`; counted in the request-failure
    metric, and logged with its traceback when it is a bug (500), or whatever it is with `log_stack`
    (--log-error-stack)."""
    error, failure = _classify(exc)
    if error.status == 500:
        logger.error("unhandled error on %s", where, exc_info=exc)
    elif log_stack:
        logger.warning("error response %d on %s: %s", error.status, where, error.message, exc_info=exc)
    if failure is not None:
        metrics.observe_failure(failure)
    return error


def _classify(exc: BaseException) -> tuple[APIError, Optional[str]]:
    """What the client sees for any exception, and the request-failure reason it counts as in the
    metrics ("rejected", "error", or None: 401, 404, 503 while draining... are not request failures)."""
    if isinstance(exc, APIError):
        return exc, "rejected" if exc.status == 400 else None
    if isinstance(exc, RequestRejectedError):
        return rejection_error(exc), "rejected"
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc)), "error"
    return APIError(500, f"internal error: {type(exc).__name__}"), "error"


def rejection_error(exc: RequestRejectedError, names: Optional[Mapping[str, str]] = None) -> APIError:
    """The 400 for a refusal of the engine or the scheduler, naming request fields as `names` spells them
    (by default as the engine does, which is how /v1/completions spells them too)."""
    message, param, code = describe_rejection(exc, names or {})
    return bad_request(message, param=param, code=code)


# Declared on every route in the OpenAPI schema.
ERROR_RESPONSES: dict[Union[int, str], dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": HTTPStatus(status).phrase}
    for status in (400, 401, 404, 413, 415, 429, 500, 503, 504)
}
