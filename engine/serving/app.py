"""The OpenAI HTTP surface as a Starlette app: routes, body parsing and errors (the API key
and request ids are middleware.py's).

The routes live in a small ASGI app rather than in BentoML API methods: OpenAI clients
need exact paths, OpenAI's error object on every 4xx (including malformed JSON, which
BentoML would answer in its own shape) and text/event-stream bodies. A client that
hangs up aborts its request, so its KV blocks are freed at the next step.

The app does not own the engine: `create_app` takes a function that returns the live
OpenAIServing (or None before it exists), so the service decides where that lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import __version__
from engine.client import tracing
from engine.serving import jsontext
from engine.serving.errors import APIError, bad_request, error_response, to_api_error
from engine.serving.openai import completions
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from engine.serving.openapi import openapi_document
from engine.serving.responses import handler as responses
from engine.serving.responses.protocol import ResponsesRequest

logger = logging.getLogger(__name__)

DEADLINE_HEADER = "X-Request-Timeout"  # seconds; a client's own deadline for one request

GetServing = Callable[[], "OpenAIServing | None"]
Handler = Callable[[OpenAIServing, Any], Awaitable[Any]]


UnknownFields = Literal["reject", "warn"]
IGNORED_HEADER = "X-Ignored-Fields"  # what a lenient parse dropped, so the client can see it too


def parse(body: bytes, model: type[BaseModel], unknown: UnknownFields = "reject") -> tuple[Any, list[str]]:
    """The request, and the unknown fields dropped from it (`warn`; `reject` makes the
    first one a 400). JSON and schema errors become OpenAI 400s naming the field."""
    data = jsontext.loads(body)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    ignored: list[str] = []
    for _ in range(8):  # each pass drops what it finds; a union can hide a nested one until the next
        try:
            return model.model_validate(data), sorted(ignored)
        except ValidationError as exc:
            errs = exc.errors(include_url=False)
            extra = [e for e in errs if e["type"] == "extra_forbidden"]
            if unknown == "warn" and extra:
                for e in extra:
                    ignored.append(_drop(data, e["loc"]))
                continue
            # the deepest place in the client's document: in a union, the member that got furthest
            err, loc = max(((e, _json_path(data, e["loc"])) for e in (extra or errs)),
                           key=lambda el: el[1].count(".") + el[1].count("["))
            if err["type"] == "extra_forbidden":  # OpenAI's wording for a field it does not know
                raise bad_request(f"Unrecognized request argument supplied: {loc}", loc) from None
            msg = err["msg"].removeprefix("Value error, ")
            raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None) from None
    raise bad_request("too many unrecognized fields: " + ", ".join(ignored[:20]), ignored[0] if ignored else None)


MAX_SHOWN_FIELD = 64  # characters of one ignored field's name in the header and the log


def shown_fields(names: list[str], most: int = 16) -> str:
    """Ignored field names as a header value and a log line may carry them: printable ASCII
    only (a name is the client's text: non-Latin-1 made the header a 500 after the whole
    generation, CR/LF forged log lines), each cut short, at most `most`, with a count."""
    def one(name: str) -> str:
        safe = name.encode("ascii", "backslashreplace").decode("ascii")
        safe = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in safe)
        return safe if len(safe) <= MAX_SHOWN_FIELD else safe[:MAX_SHOWN_FIELD] + "..."
    shown = ", ".join(one(n) for n in names[:most])
    return shown + (f" (and {len(names) - most} more)" if len(names) > most else "")


def _drop(data: Any, loc: tuple[Any, ...]) -> str:
    """Remove the unknown key at `loc` from the client's JSON; its path there."""
    path, node = _walk(data, loc[:-1])
    if isinstance(node, dict):
        node.pop(loc[-1], None)
    return f"{path}.{loc[-1]}".lstrip(".")


def _json_path(data: Any, loc: tuple[Any, ...]) -> str:
    """The error's location in the client's JSON, e.g. messages[0].role; a missing
    top-level field is its own name."""
    path, _ = _walk(data, loc)
    return path or (loc[0] if loc and isinstance(loc[0], str) else "")


def _walk(data: Any, loc: tuple[Any, ...]) -> tuple[str, Any]:
    """Follow a pydantic error location through the client's JSON: the path it reaches
    (e.g. messages[0].content) and the node there. pydantic puts union members ("str",
    "list[int]", a tag) into loc; those are not in the document, so the walk skips what
    it cannot find there."""
    path, node = "", data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            path += f"[{part}]"
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path += f".{part}"
        else:
            continue
        node = node[part]
    return path.lstrip("."), node


class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any], timeout: float | None = None) -> Any:
    """Run work, cancelling it (and so aborting its requests) if the client hangs up first
    or the deadline passes."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task in done:
        return task.result()
    if gone in done:
        raise ClientGone
    raise deadline_exceeded(timeout)


def deadline_exceeded(timeout: float | None) -> APIError:
    within = f" ({timeout:.3g} s)" if timeout is not None else ""
    return APIError(408, f"the request did not finish within its deadline{within}; it was aborted",
                    "timeout_error", None, "deadline_exceeded")


def _deadline(request: Request, default: float | None) -> float | None:
    """Seconds this request may take: the preset's request_timeout, or the client's
    X-Request-Timeout header when that is shorter."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return default
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not (math.isfinite(asked) and asked > 0):
        raise bad_request(f"the {DEADLINE_HEADER} header must be a positive number of seconds")
    return asked if default is None else min(asked, default)


async def _sse(events: AsyncIterator[str], deadline: float | None = None) -> AsyncIterator[str]:
    """Errors after the headers went out travel as an error event, as OpenAI and vLLM do;
    so does a deadline that passes mid-stream (`deadline` is loop time)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            left = None if deadline is None else deadline - loop.time()
            try:
                event = await asyncio.wait_for(events.__anext__(), left) if left is None or left > 0 else None
            except StopAsyncIteration:
                return
            except TimeoutError:
                event = None
            if event is None:
                await events.aclose()  # type: ignore[attr-defined] # its cleanup aborts the request
                raise deadline_exceeded(None)
            yield event
    except Exception as exc:  # noqa: BLE001
        yield f"data: {json.dumps(to_api_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"  # clients wait for it to close the stream


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes, however it is sent."""
    too_big = APIError(413, f"the request body is larger than {limit} bytes", "invalid_request_error", None,
                       "request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _openai_route(get_serving: GetServing, model: type[BaseModel], handler: Handler, max_body: int,
                  request_timeout: float | None, unknown: UnknownFields
                  ) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: body in, OpenAI error object or JSON or SSE out."""

    async def endpoint(request: Request) -> Response:
        serving = get_serving()
        if serving is None or not serving.llm.is_alive:
            return error_response(APIError(503, "the engine is not running", "server_error"))
        if serving.llm.draining:
            return error_response(APIError(503, "the server is shutting down and takes no new requests",
                                           "server_error", None, "shutting_down"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            timeout = _deadline(request, request_timeout)
            body = await read_body(request, max_body)  # before the disconnect watcher starts reading
            if len(body) <= jsontext.OFF_LOOP_BYTES:
                req, ignored = parse(body, model, unknown)
            else:  # parsing and validating megabytes would hold every other request's loop
                req, ignored = await asyncio.to_thread(parse, body, model, unknown)
        except APIError as exc:
            return error_response(exc)
        headers = {}
        if ignored:
            shown = shown_fields(ignored)
            logger.warning("request %s to %s: ignored unknown fields %s", tracing.REQUEST_ID.get(),
                           request.url.path, shown)
            headers[IGNORED_HEADER] = shown
        try:
            with tracing.continue_trace(request.headers):  # the request's span joins the caller's trace
                work = asyncio.ensure_future(handler(serving, req))
            left = None if timeout is None else timeout - (loop.time() - start)
            result = await _unless_disconnected(request, work, left)
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            return error_response(to_api_error(exc), headers)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json", headers=headers)
        return StreamingResponse(_sse(result, None if timeout is None else start + timeout),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    return endpoint


async def _chat(s: OpenAIServing, req: ChatCompletionRequest) -> Any:
    return await s.chat(req)


async def _completions(s: OpenAIServing, req: CompletionRequest) -> Any:
    return await completions.complete(s, req)


async def _tokenize(s: OpenAIServing, req: TokenizeRequest) -> Any:
    return await s.tokenize(req)


async def _detokenize(s: OpenAIServing, req: DetokenizeRequest) -> Any:
    return await s.detokenize(req)


async def _responses(s: OpenAIServing, req: ResponsesRequest) -> Any:
    return await responses.create(s, req)


DEFAULT_MAX_BODY = 8 << 20


def create_app(get_serving: GetServing, max_body_bytes: int = DEFAULT_MAX_BODY,
               request_timeout: float | None = None, unknown_fields: UnknownFields = "reject") -> Starlette:
    """The OpenAI routes plus /health, /stats and /version, over whatever get_serving
    returns. Bodies past max_body_bytes are 413s; a request still running after
    request_timeout seconds (or its X-Request-Timeout header, if shorter) is aborted with
    a 408; unknown fields are 400s or (`warn`) dropped, logged and named in a header."""

    def route(model: type[BaseModel], handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _openai_route(get_serving, model, handler, max_body_bytes, request_timeout, unknown_fields)

    def live() -> OpenAIServing:
        serving = get_serving()
        if serving is None:
            raise APIError(503, "the engine is not running", "server_error")
        return serving

    async def models(request: Request) -> Response:
        try:
            return Response(live().models().model_dump_json(), media_type="application/json")
        except APIError as exc:
            return error_response(exc)

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        try:
            cards = [card for card in live().models().data if card.id == name]
        except APIError as exc:
            return error_response(exc)
        if not cards:
            return error_response(APIError(404, f"The model `{name}` does not exist.", "invalid_request_error",
                                           "model", "model_not_found"))
        return Response(cards[0].model_dump_json(), media_type="application/json")

    document = openapi_document()

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    async def health(request: Request) -> Response:
        serving = get_serving()
        if serving is None or not serving.llm.is_alive:
            return JSONResponse({"status": "engine dead"}, status_code=503)
        if not serving.llm.is_responsive:
            return JSONResponse({"status": "engine stalled"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        try:
            llm = live().llm
        except APIError as exc:
            return error_response(exc)
        return JSONResponse(await asyncio.to_thread(llm.stats))

    async def stored_response(request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            serving = live()
            if request.method == "DELETE":
                return Response(responses.delete(serving, rid).model_dump_json(), media_type="application/json")
            return Response(responses.get(serving, rid), media_type="application/json")
        except APIError as exc:
            return error_response(exc)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def http_error(request: Request, exc: Exception) -> Response:
        """Unknown paths and methods answer in OpenAI's error shape too, not plain text."""
        status = getattr(exc, "status_code", 500)
        code = "not_found" if status == 404 else "method_not_allowed" if status == 405 else None
        return error_response(APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                                       "invalid_request_error", None, code))

    return Starlette(exception_handlers={404: http_error, 405: http_error}, routes=[
        Route("/v1/chat/completions", route(ChatCompletionRequest, _chat), methods=["POST"]),
        Route("/v1/completions", route(CompletionRequest, _completions), methods=["POST"]),
        Route("/v1/responses", route(ResponsesRequest, _responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", route(TokenizeRequest, _tokenize), methods=["POST"]),
        Route("/detokenize", route(DetokenizeRequest, _detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ])


class TypedRouteGuard:
    """The typed BentoML routes (/generate, /chat) parse their own bodies, so they get the
    OpenAI routes' guards here, in front of BentoML: the body limit (413), JSON bounded as
    every body is (jsontext: depth, NaN, 64-bit integers, valid Unicode; 400 in OpenAI's
    shape), and the deadline (the preset's request_timeout or a shorter X-Request-Timeout).
    A deadline that passes before the answer starts is a 408; one that passes mid-stream
    ends the stream there. Either way the route's task is cancelled, which aborts its
    request in the engine."""

    def __init__(self, app: Any, paths: tuple[str, ...] = ("/generate", "/chat"),
                 max_body_bytes: int = DEFAULT_MAX_BODY, request_timeout: float | None = None) -> None:
        self.app = app
        self.paths = paths
        self.max_body = max_body_bytes
        self.request_timeout = request_timeout

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") not in self.paths:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            timeout = _deadline(request, self.request_timeout)
            body = await read_body(request, self.max_body)
            if not isinstance(await jsontext.loads_async(body), dict):
                raise bad_request("the request body must be a JSON object")
        except APIError as exc:
            await error_response(exc)(scope, receive, send)
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the disconnect, when it comes

        started = False

        async def watch(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await asyncio.wait_for(self.app(scope, replay, watch), timeout)
        except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11, the floor
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await error_response(deadline_exceeded(timeout))(scope, receive, send)
