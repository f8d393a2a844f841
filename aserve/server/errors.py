"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the right status."""
from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

from aserve.server.protocol import ErrorInfo, ErrorResponse

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "timeout", 413: "request_too_large", 429: "rate_limit_error", 500: "internal_error",
                503: "service_unavailable", 504: "timeout"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> Response:
    body = ErrorResponse(ErrorInfo(message=message, type=STATUS_TYPES.get(status, "error"), param=param, code=code))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def from_exception(exc: Exception) -> Response:
    if isinstance(exc, APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)
    if isinstance(exc, msgspec.ValidationError):
        path = re.search(r"at `\$\.?([^`]*)`", str(exc))
        param = path.group(1).split("[")[0].split(".")[0] if path and path.group(1) else None
        return error_response(400, f"invalid request: {exc}", param)
    if isinstance(exc, msgspec.DecodeError):
        return error_response(400, f"the body is not valid JSON: {exc}")
    if isinstance(exc, ValueError):
        word = str(exc).split(" ", 1)[0]
        return error_response(400, str(exc), word if word.isidentifier() and "_" in word or word in PARAMS else None)
    raise exc


PARAMS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logprobs", "prompt", "messages"}
