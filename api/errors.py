"""OpenAI-style error bodies, and the HTTP status each crowdchat error maps to."""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from engine.errors import (
    CrowdchatError,
    EngineStopped,
    InvalidRequest,
    PromptTooLong,
    ServerBusy,
)
from sessions.errors import RateLimited, SessionBusy, SessionNotFound

log = logging.getLogger(__name__)

# Most specific first: PromptTooLong is an InvalidRequest, everything is a CrowdchatError.
_MAPPING: tuple[tuple[type[Exception], int, str, str | None], ...] = (
    (PromptTooLong, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidRequest, 400, "invalid_request_error", None),
    (SessionNotFound, 404, "not_found_error", "session_not_found"),
    (SessionBusy, 409, "conflict_error", "session_busy"),
    (ServerBusy, 429, "rate_limit_error", "server_busy"),
    (RateLimited, 429, "rate_limit_error", "rate_limit_exceeded"),
    (EngineStopped, 503, "service_unavailable_error", "engine_stopped"),
    (CrowdchatError, 500, "server_error", None),
)


class ApiError(Exception):
    """A request error the API layer finds itself (bad JSON, a field of the wrong type)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_


def error_body(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, `{"error": {message, type, param, code}}`) for any exception.

    Errors a user can cause keep their message; anything else is logged with its traceback
    and answered with a generic 500, so no internals leak to the client.
    """
    if isinstance(exc, ApiError):
        status, type_, param, code = exc.status, exc.type, exc.param, exc.code
        message = str(exc)
    else:
        match = next((m for m in _MAPPING if isinstance(exc, m[0])), None)
        param = None
        if match is None:
            log.error("unexpected error serving a request", exc_info=exc)
            status, type_, code, message = 500, "server_error", None, "internal server error"
        else:
            _cls, status, type_, code = match
            message = str(exc)
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    """The JSON response for `exc` (429s carry a Retry-After hint)."""
    status, body = error_body(exc)
    headers = {"Retry-After": "1"} if status == 429 else None
    return JSONResponse(body, status_code=status, headers=headers)
