"""Every failure a client can see, as an HTTP status plus OpenAI's error object.

`to_api_error` is the one place that decides: the OpenAI routes, the SSE error event
and the typed BentoML APIs all go through it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from engine.client.admission import QueueFullError
from engine.client.core_client import DrainingError
from engine.errors import EngineDeadError, ParamError
from engine.serving import tracing
from engine.serving.openai.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send as OpenAI's {"error": {...}} with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return ErrorResponse(error=self.detail).model_dump()


def error_response(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The Starlette response for an APIError, with any further headers."""
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers, **(headers or {})})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def to_api_error(exc: BaseException, names: Mapping[str, str] | None = None,
                 request_id: str | None = None) -> APIError:
    """Map any exception to what the client gets.

    `names` renames engine field names to the request's own (SamplingParams' `logprobs`
    is chat's `top_logprobs`, say), so `param` always points into the client's JSON.
    The server's own failures are logged in full under the request's id; the client gets
    the id and a plain message, never an internal exception's text.
    """
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ParamError):
        param = (names or {}).get(exc.param, exc.param) if exc.param else None
        return bad_request(str(exc), param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", None, "queue_full",
                        {"Retry-After": str(int(exc.retry_after))})
    if isinstance(exc, DrainingError):
        return APIError(503, str(exc), "server_error", None, "shutting_down")
    ref = request_id or tracing.REQUEST_ID.get() or uuid.uuid4().hex[:16]
    if isinstance(exc, EngineDeadError):
        logger.error("request %s: %s", ref, exc)
        return APIError(503, f"the engine is not running (request {ref}; the server log has the cause)",
                        "server_error", None, "engine_dead")
    logger.error("request %s failed", ref, exc_info=exc)
    return APIError(500, f"internal error (request {ref}; the server log has the details)", "server_error")
