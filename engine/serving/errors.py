"""Every failure a client can see, as an HTTP status plus OpenAI's error object.

`to_api_error` is the one place that decides: the OpenAI routes, the SSE error event
and the typed BentoML APIs all go through it.
"""

from __future__ import annotations

import json
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


# Anthropic's error types by HTTP status (its SDK picks the exception class by status).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_body(err: APIError) -> dict[str, Any]:
    """The error in Anthropic's shape. It has no `param`, so the field leads the message."""
    d = err.detail
    message = d.message if d.param is None or d.param in d.message else f"{d.param}: {d.message}"
    kind = _ANTHROPIC_TYPES.get(err.status) or ("overloaded_error" if err.status == 503 else
                                               "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(err: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_body(err), status_code=err.status, headers={**err.headers, **(headers or {})})


def openai_error_event(err: APIError) -> str:
    """An error after a stream's headers went out, as OpenAI and vLLM send it; clients wait
    for [DONE] to close the stream."""
    return f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"


def anthropic_error_event(err: APIError) -> str:
    return f"event: error\ndata: {json.dumps(anthropic_body(err))}\n\n"


def speaks_anthropic(path: str) -> bool:
    """Whether a path's errors take Anthropic's shape (middleware answers before routing)."""
    return path.startswith("/v1/messages")


def renamed(exc: APIError, rename: Mapping[str, str], whole: frozenset[str] = frozenset()) -> APIError:
    """An error about a chat request's field, pointed at the field the client sent to a
    route that is translated into chat (Responses, Anthropic): `rename` maps the field's
    head (`stop` of `stop[2]`) to the client's; for a head in `whole` the client's field is
    named without the rest of the path, which does not index into it."""
    param = exc.detail.param
    if param is not None:
        head = param.split("[", 1)[0].split(".", 1)[0]
        if head in rename:
            exc.detail.param = rename[head] if head in whole else rename[head] + param[len(head):]
    return exc


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
