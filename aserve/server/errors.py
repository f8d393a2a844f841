"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the right status.

One table maps an error's type to its answer, for plain responses and for the error event that ends a
stream whose status line is long sent. `param` comes from the error itself (InvalidRequestError and
SamplingParams' checks carry it as data), never from its message.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
from starlette.responses import Response

from aserve.errors import (EngineDeadError, EngineError, EngineOverloadedError, ReplicaDeadError,
                                  RequestFailedError, RequestTimeoutError)
from aserve.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger("aserve")

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "timeout", 413: "request_too_large", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable", 504: "timeout"}
RETRY_AFTER_S = 1  # what an overloaded server tells clients to wait; queues move in well under a second per step


class APIError(Exception):
    """An answer the HTTP layer decides itself (401, 404 model, 408, 413, 499), with its status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass(frozen=True)
class Answer:
    status: int
    what: str = ""  # said before the error's own message, where that alone would not say it
    code: str | None = None
    retry_after: bool = False


# Most specific first: the first type an error is an instance of decides.
ANSWERS: tuple[tuple[type[BaseException], Answer], ...] = (
    (EngineOverloadedError, Answer(503, "the server is overloaded", "overloaded", retry_after=True)),
    (ReplicaDeadError, Answer(503, code="replica_died", retry_after=True)),  # the other replicas serve on
    (EngineDeadError, Answer(503, "the engine is not available")),
    (RequestTimeoutError, Answer(504, code="timeout")),
    (RequestFailedError, Answer(500, code="generation_failed")),
    (EngineError, Answer(500, "the engine failed")),
    (msgspec.ValidationError, Answer(400, "invalid request")),
    (msgspec.DecodeError, Answer(400, "the body is not valid JSON")),
    (ValueError, Answer(400)),  # InvalidRequestError, SamplingParams' checks, other bad input
)


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None,
                   headers: dict | None = None) -> Response:
    body = ErrorResponse(ErrorInfo(message=message, type=STATUS_TYPES.get(status, "error"), param=param, code=code))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def answer_for(exc: BaseException) -> Answer | None:
    return next((answer for kind, answer in ANSWERS if isinstance(exc, kind)), None)


def _message(answer: Answer, exc: BaseException) -> str:
    return f"{answer.what}: {exc}" if answer.what else str(exc)


def from_exception(exc: Exception) -> Response:
    """The answer to an error a route raised; an unexpected one is logged and answered with a plain 500."""
    if isinstance(exc, APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)
    answer = answer_for(exc)
    if answer is None:
        log.error("unexpected error while answering a request", exc_info=exc)
        return error_response(500, "internal error: the server could not process this request", code="internal_error")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if answer.retry_after else None
    return error_response(answer.status, _message(answer, exc), getattr(exc, "param", None), answer.code, headers)


def stream_error(exc: BaseException) -> ErrorResponse:
    """The last event of a stream that cannot go on: an error in OpenAI's shape, not a cut connection.
    Its `code` is the status the request would have had."""
    answer = answer_for(exc)
    if answer is None:
        log.error("a stream failed", exc_info=exc)
        return ErrorResponse(ErrorInfo(message="internal error", type=STATUS_TYPES[500], code=500))
    return ErrorResponse(ErrorInfo(message=_message(answer, exc), type=STATUS_TYPES.get(answer.status, "error"),
                                   param=getattr(exc, "param", None), code=answer.status))
