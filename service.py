"""The BentoML service: OpenAI-compatible HTTP over one AsyncLLM, and nothing else.

Routes (see docs/service.md): POST /v1/chat/completions, POST /v1/completions,
GET /v1/models, POST /tokenize, POST /detokenize, GET /health, GET /stats, plus
BentoML's own /metrics, /livez, /readyz and the typed APIs POST /generate and
POST /chat for bentoml.SyncHTTPClient.

The OpenAI routes live in a small Starlette app mounted on the service rather than in
@bentoml.api methods: OpenAI clients need exact paths, OpenAI's error object on every
4xx (including malformed JSON, which BentoML would answer in its own shape) and
text/event-stream bodies. The engine, the OpenAI translation and the config live in
engine/; this file only parses HTTP, maps errors to status codes and watches for
clients that hang up, which abort their request so its KV blocks are freed.

Configuration is a YAML preset picked with $PAGEDSERVE_CONFIG (default
config/default.yaml). The weights come from the BentoML model store
(scripts/import_model.py) when the preset names no model and the store holds the
preset's model_tag, and otherwise from the embedded default GGUF. Adaptive batching
stays off: the engine batches continuously at token granularity, and request-level
batching in front of it would only add latency. One worker holds the one engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import bentoml
from annotated_types import Ge
from bentoml.exceptions import InvalidArgument, NotFound
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.metrics import engine_metrics
from engine.protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, TokenizeRequest,
)
from engine.serving import APIError, OpenAIServing, bad_request
from engine.service_config import load_preset

logger = logging.getLogger("pagedserve")

API_KEY_ENV = "LLM_API_KEY"
PROTECTED_PREFIXES = ("/v1/", "/generate", "/chat")  # everything that spends the model's time
PRESET = load_preset()


def _stored_model(tag: str) -> bentoml.models.BentoModel | None:
    """The store's model if scripts/import_model.py put it there; never reaches for a remote."""
    try:
        bentoml.models.get(tag)
    except NotFound:
        return None
    return bentoml.models.BentoModel(tag)


MODEL_REF = _stored_model(PRESET.service.model_tag) if PRESET.engine.model is None else None
_TRAFFIC = {k: v for k, v in PRESET.service.traffic.model_dump().items() if v is not None}


# -- HTTP plumbing ----------------------------------------------------------------------
def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    """JSON and schema errors become OpenAI 400s naming the offending field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = _json_path(data, err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None) from None


def _json_path(data: Any, loc: tuple[Any, ...]) -> str:
    """The error's location in the client's JSON, e.g. messages[0].role.

    pydantic appends union members ("str", "list[int]") to loc; those are not in the
    client's document, so the walk stops where the document ends.
    """
    path, node = "", data
    for part in loc:
        if isinstance(part, int) and isinstance(node, list) and part < len(node):
            path += f"[{part}]"
        elif isinstance(part, str) and isinstance(node, dict) and part in node:
            path += f".{part}"
        elif isinstance(part, str) and isinstance(node, dict) and not path:
            return part  # a missing top-level field
        else:
            break
        node = node[part]
    return path.lstrip(".")


class ClientGone(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run work, cancelling it (and so aborting its requests) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task in done:
        return task.result()
    raise ClientGone


async def _sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the headers went out travel as an error event, as OpenAI and vLLM do."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as exc:
        yield f"data: {json.dumps(APIError(503, str(exc), 'server_error').body())}\n\n"
    except Exception as exc:  # noqa: BLE001
        logger.exception("stream failed")
        yield f"data: {json.dumps(APIError(500, f'internal error: {exc!r}', 'server_error').body())}\n\n"


def openai_route(handler: Callable[[OpenAIServing, bytes], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a handler: body in, OpenAI error object or JSON or SSE out."""

    async def endpoint(request: Request) -> Response:
        service: LLMService | None = getattr(request.app.state, "service", None)
        if service is None or not service.llm.is_alive:
            return _error(APIError(503, "the engine is not running", "server_error"))
        body = await request.body()  # before the disconnect watcher starts reading
        try:
            result = await _unless_disconnected(request, handler(service.serving, body))
        except APIError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)
        except EngineDeadError as exc:
            return _error(APIError(503, str(exc), "server_error"))
        except Exception as exc:  # noqa: BLE001
            logger.exception("request failed")
            return _error(APIError(500, f"internal error: {exc!r}", "server_error"))
        if isinstance(result, BaseModel):
            return Response(result.model_dump_json(), media_type="application/json")
        return StreamingResponse(_sse(result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return endpoint


async def _chat(s: OpenAIServing, body: bytes) -> Any:
    return await s.chat(_parse(body, ChatCompletionRequest))


async def _completions(s: OpenAIServing, body: bytes) -> Any:
    return await s.completion(_parse(body, CompletionRequest))


async def _tokenize(s: OpenAIServing, body: bytes) -> Any:
    return s.tokenize(_parse(body, TokenizeRequest))


async def _detokenize(s: OpenAIServing, body: bytes) -> Any:
    return s.detokenize(_parse(body, DetokenizeRequest))


async def _models(request: Request) -> Response:
    service: LLMService = request.app.state.service
    return Response(service.serving.models().model_dump_json(), media_type="application/json")


async def _model(request: Request) -> Response:
    service: LLMService = request.app.state.service
    name = request.path_params["model"]
    cards = [card for card in service.serving.models().data if card.id == name]
    if not cards:
        err = APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")
        return _error(err)
    return Response(cards[0].model_dump_json(), media_type="application/json")


async def _health(request: Request) -> Response:
    service: LLMService | None = getattr(request.app.state, "service", None)
    alive = service is not None and service.llm.is_alive
    return JSONResponse({"status": "ok" if alive else "engine dead"}, status_code=200 if alive else 503)


async def _stats(request: Request) -> Response:
    return JSONResponse(request.app.state.service.llm.stats())


openai_app = Starlette(routes=[
    Route("/v1/chat/completions", openai_route(_chat), methods=["POST"]),
    Route("/v1/completions", openai_route(_completions), methods=["POST"]),
    Route("/v1/models", _models, methods=["GET"]),
    Route("/v1/models/{model:path}", _model, methods=["GET"]),
    Route("/tokenize", openai_route(_tokenize), methods=["POST"]),
    Route("/detokenize", openai_route(_detokenize), methods=["POST"]),
    Route("/health", _health, methods=["GET"]),
    Route("/stats", _stats, methods=["GET"]),
])


class APIKeyMiddleware:
    """With $LLM_API_KEY set, model routes need `Authorization: Bearer <key>`; else 401."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.key = os.environ.get(API_KEY_ENV) or None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.key and scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), self.key):
                resp = _error(APIError(401, "Incorrect API key provided; send `Authorization: Bearer <key>`.",
                                       "invalid_request_error", None, "invalid_api_key"))
                resp.headers["WWW-Authenticate"] = "Bearer"
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- the service ------------------------------------------------------------------------
@bentoml.asgi_app(openai_app, path="/")
@bentoml.service(name="pagedserve", traffic=_TRAFFIC, workers=1)
class LLMService:
    if MODEL_REF is not None:
        model_ref = MODEL_REF  # resolved to the stored model (and shipped in the Bento)

    def __init__(self) -> None:
        config, served, root = PRESET.engine, PRESET.service.served_model_name, None
        if config.model is None and MODEL_REF is not None:
            stored = self.model_ref
            config = EngineConfig.create(**{**config.model_dump(), "model": stored.path})
            served = served or stored.info.metadata.get("served_model_name")
            root = str(stored.tag)
        engine = LLMEngine(config)
        served = served or engine.model_name
        self.llm = AsyncLLM(engine, engine_metrics(served))
        self.serving = OpenAIServing(self.llm, served, root or engine.model_name)
        openai_app.state.service = self
        logger.info("serving %s (max_model_len %d) from %s", served, engine.max_model_len, root or "embedded")

    def __is_alive__(self) -> bool:
        return self.llm.is_alive

    def __is_ready__(self) -> bool:
        return self.llm.is_alive

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        self.llm.shutdown()

    # Typed APIs for bentoml.SyncHTTPClient: text deltas, no OpenAI envelope.
    @bentoml.api(route="/generate")
    async def generate(
        self, prompt: str, max_tokens: Annotated[int, Ge(1)] = 128, temperature: float = 0.0,
        top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Complete a raw prompt, streaming the text as it is generated."""
        req = CompletionRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                seed=seed, stop=stop)
        async for text in self._typed(prompt, req):
            yield text

    @bentoml.api(route="/chat")
    async def chat(
        self, messages: list[ChatMessage], max_tokens: Annotated[int, Ge(1)] = 256, temperature: float = 0.0,
        top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Chat with the model's chat template, streaming the reply as it is generated."""
        req = ChatCompletionRequest(messages=messages, max_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, stop=stop)
        try:
            prompt = self.serving.chat_prompt(req.messages)
        except APIError as exc:
            raise InvalidArgument(exc.detail.message) from None
        async for text in self._typed(prompt, req):
            yield text

    async def _typed(self, prompt: str | list[int], req: Any) -> AsyncIterator[str]:
        # BentoML awaits the first chunk before answering, so these errors become 400s.
        try:
            params = self.serving.sampling_params(req, req.max_tokens, None, "logprobs")
            async for out in self.llm.generate(prompt, params):
                for delta in out.deltas:
                    if delta.text:
                        yield delta.text
        except APIError as exc:
            raise InvalidArgument(exc.detail.message) from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None


LLMService.add_asgi_middleware(APIKeyMiddleware)
