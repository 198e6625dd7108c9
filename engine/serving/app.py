"""The HTTP surface as a Starlette app: OpenAI's routes and Anthropic's Messages, and their
errors (bodies are parsed by parsing.py, deadlines kept by deadlines.py, the API key,
request ids and the typed routes' guard are middleware.py's).

The routes live in a small ASGI app rather than in BentoML API methods: clients need
exact paths, their API's own error object on every 4xx (including malformed JSON, which
BentoML would answer in its own shape) and text/event-stream bodies. A client that
hangs up aborts its request, so its KV blocks are freed at the next step.

The app does not own the engine: `create_app` takes a function that returns the live
OpenAIServing (or None before it exists), so the service decides where that lives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine import __version__
from engine.serving import tracing
from engine.serving import jsontext
from engine.serving.deadlines import ClientGone, deadline, sse_events, unless_disconnected
from engine.serving.anthropic import handler as anthropic
from engine.serving.rerank import handler as rerank
from engine.serving.rerank.protocol import RerankRequest, ScoreRequest
from engine.serving.anthropic.protocol import CountTokensRequest, MessagesRequest
from engine.serving.errors import (
    APIError, anthropic_error_event, anthropic_error_response, error_response, openai_error_event, to_api_error,
)
from engine.serving.openai import completions, embeddings
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from engine.serving.openapi import openapi_document
from engine.serving.parsing import DEFAULT_MAX_BODY, IGNORED_HEADER, UnknownFields, parse, read_body, shown_fields
from engine.serving.responses import handler as responses
from engine.serving.responses.protocol import ResponsesRequest

logger = logging.getLogger(__name__)

GetServing = Callable[[], "OpenAIServing | None"]
Handler = Callable[[OpenAIServing, Any], Awaitable[Any]]
Render = Callable[..., Response]


def _api_route(get_serving: GetServing, model: type[BaseModel], handler: Handler, max_body: int,
               request_timeout: float | None, unknown: UnknownFields, render: Render = error_response,
               error_event: Callable[[APIError], str] = openai_error_event
               ) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: body in, JSON or SSE out, and errors in the API's own shape
    (`render` before the headers, `error_event` after them)."""

    async def endpoint(request: Request) -> Response:
        serving = get_serving()
        if serving is None or not serving.llm.is_alive:
            return render(APIError(503, "the engine is not running", "server_error"))
        if serving.llm.draining:
            return render(APIError(503, "the server is shutting down and takes no new requests",
                                           "server_error", None, "shutting_down"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            timeout = deadline(request, request_timeout)
            body = await read_body(request, max_body)  # before the disconnect watcher starts reading
            if len(body) <= jsontext.OFF_LOOP_BYTES:
                req, ignored = parse(body, model, unknown)
            else:  # parsing and validating megabytes would hold every other request's loop
                req, ignored = await asyncio.to_thread(parse, body, model, unknown)
        except APIError as exc:
            return render(exc)
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
            result = await unless_disconnected(request, work, left)
        except ClientGone:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001
            return render(to_api_error(exc), headers)
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json", headers=headers)
        return StreamingResponse(sse_events(result, None if timeout is None else start + timeout, error_event),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    return endpoint


async def _chat(s: OpenAIServing, req: ChatCompletionRequest) -> Any:
    return await s.chat(req)


async def _completions(s: OpenAIServing, req: CompletionRequest) -> Any:
    return await completions.complete(s, req)


async def _embeddings(s: OpenAIServing, req: embeddings.EmbeddingRequest) -> Any:
    return await embeddings.embed(s, req)


async def _score(s: OpenAIServing, req: ScoreRequest) -> Any:
    return await rerank.score(s, req)


async def _rerank(s: OpenAIServing, req: RerankRequest) -> Any:
    return await rerank.rerank(s, req)


async def _tokenize(s: OpenAIServing, req: TokenizeRequest) -> Any:
    return await s.tokenize(req)


async def _detokenize(s: OpenAIServing, req: DetokenizeRequest) -> Any:
    return await s.detokenize(req)


async def _responses(s: OpenAIServing, req: ResponsesRequest) -> Any:
    return await responses.create(s, req)


async def _messages(s: OpenAIServing, req: MessagesRequest) -> Any:
    return await anthropic.create(s, req)


async def _count_tokens(s: OpenAIServing, req: CountTokensRequest) -> Any:
    return await anthropic.count_tokens(s, req)


def create_app(get_serving: GetServing, max_body_bytes: int = DEFAULT_MAX_BODY,
               request_timeout: float | None = None, unknown_fields: UnknownFields = "reject") -> Starlette:
    """The OpenAI routes plus /health, /stats and /version, over whatever get_serving
    returns. Bodies past max_body_bytes are 413s; a request still running after
    request_timeout seconds (or its X-Request-Timeout header, if shorter) is aborted with
    a 408; unknown fields are 400s or (`warn`) dropped, logged and named in a header."""

    def route(model: type[BaseModel], handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _api_route(get_serving, model, handler, max_body_bytes, request_timeout, unknown_fields)

    def anthropic_route(model: type[BaseModel], handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        return _api_route(get_serving, model, handler, max_body_bytes, request_timeout, unknown_fields,
                          anthropic_error_response, anthropic_error_event)

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
        Route("/v1/embeddings", route(embeddings.EmbeddingRequest, _embeddings), methods=["POST"]),
        Route("/v1/score", route(ScoreRequest, _score), methods=["POST"]),
        Route("/v1/rerank", route(RerankRequest, _rerank), methods=["POST"]),
        Route("/v2/rerank", route(RerankRequest, _rerank), methods=["POST"]),
        Route("/v1/responses", route(ResponsesRequest, _responses), methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/messages", anthropic_route(MessagesRequest, _messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_route(CountTokensRequest, _count_tokens), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/tokenize", route(TokenizeRequest, _tokenize), methods=["POST"]),
        Route("/detokenize", route(DetokenizeRequest, _detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ])
