"""The BentoML service: OpenAI-compatible HTTP over one AsyncLLM, and nothing else.

The engine is engine/, the HTTP surface engine/serving/ (see docs/service.md for the
routes). This file wires them to BentoML: the preset picks the config
($PAGEDSERVE_CONFIG, default config/default.yaml); the weights come from the BentoML
model store (scripts/import_model.py) when the preset names no model and the store
holds the preset's model_tag, else from the embedded default GGUF. Adaptive batching
stays off: the engine batches continuously at token granularity, and request-level
batching in front of it would only add latency. Each worker holds one engine
(service.workers in the preset, default 1); docs/scaling.md covers replicas.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Annotated, Any

import bentoml
from annotated_types import Ge
from bentoml.exceptions import BentoMLException, NotFound
from starlette.middleware.cors import CORSMiddleware

from engine.client.async_llm import AsyncLLM, QueueLimits
from engine.config import EngineConfig
from engine.models import DEFAULT_MODEL_NAME, packaged
from engine.serving import tracing
from engine.serving import tenancy
from engine.serving.app import create_app
from engine.serving.errors import to_api_error
from engine.serving.metrics import engine_metrics
from engine.serving.middleware import APIKeyMiddleware, RequestIdMiddleware, TypedRouteGuard
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from engine.serving.openapi import MergedDocs
from engine.serving.preset import load_preset
from engine.serving.responses.store import ResponseStore

logger = logging.getLogger("pagedserve")

PRESET = load_preset()
tracing.setup_from_env()  # OTLP export only when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set


def _stored_model(tag: str) -> bentoml.models.BentoModel | None:
    """The store's model if scripts/import_model.py put it there; never reaches for a remote."""
    try:
        bentoml.models.get(tag)
    except NotFound:
        return None
    return bentoml.models.BentoModel(tag)


def _claim_cores(workers: int, config: EngineConfig) -> None:
    """With several workers per replica on the CPU, each worker's engine takes its own share
    of the cores (the engine process inherits this thread's CPU set and pins its threads
    within it), so the engines do not fight over the same cores."""
    if workers < 2 or config.device == "cuda":
        return
    from engine import parallel

    index = (bentoml.server_context.worker_index or 1) - 1
    cores = sorted(os.sched_getaffinity(0))
    lo, hi = parallel.split(len(cores), workers, index % workers)
    if hi > lo:
        os.sched_setaffinity(0, cores[lo:hi])
        logger.info("worker %d of %d: engine on cores %s", index + 1, workers, cores[lo:hi])


def _current_serving() -> OpenAIServing | None:
    try:
        return bentoml.get_current_service().serving
    except BentoMLException:  # not instantiated yet
        return None


MODEL_REF = _stored_model(PRESET.service.model_tag) if PRESET.engine.model is None else None
_TRAFFIC = {k: v for k, v in PRESET.service.traffic.model_dump().items() if v is not None}
_RESOURCES = {k: v for k, v in PRESET.service.resources.model_dump().items() if v is not None}


@bentoml.asgi_app(create_app(_current_serving, PRESET.service.max_body_bytes, PRESET.service.request_timeout,
                             PRESET.service.unknown_fields), path="/")
@bentoml.service(name="pagedserve", traffic=_TRAFFIC, workers=PRESET.service.workers, resources=_RESOURCES,
                 tracing={"excluded_urls": [tracing.GENERATION_ROUTES]})
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
        elif config.model is None and PRESET.service.model_tag in packaged.PACKAGES \
                and PRESET.service.model_tag != packaged.DEFAULT_MODEL_TAG:
            # Not imported yet: the packaged model the tag names (None below: the embedded one).
            config = EngineConfig.create(**{**config.model_dump(), "model": PRESET.service.model_tag})
            served = served or packaged.PACKAGES[PRESET.service.model_tag].name
        # The engine core runs in its own process; this one keeps HTTP, tokenization and SSE.
        served = served or config.model or DEFAULT_MODEL_NAME
        queue = PRESET.service.queue
        limits = QueueLimits(queue.max_waiting_requests, queue.max_waiting_tokens)
        _claim_cores(PRESET.service.workers, config)
        self.llm = AsyncLLM.start(config, engine_metrics(served, PRESET.service.metrics_prefix), limits,
                                  PRESET.service.core_stall_timeout_s, tracer=tracing)
        aliases = [self.llm.info.hf_id] if self.llm.info.hf_id else []  # clients may also name it by its HF id
        store = ResponseStore(**PRESET.service.responses_store.model_dump())
        self.serving = OpenAIServing(self.llm, served, root or self.llm.info.model_name, aliases, store,
                                     PRESET.service.reasoning_parser, PRESET.service.tool_call_parser,
                                     PRESET.service.max_sequences_per_request, PRESET.service.prefix_cache_scope)
        logger.info("serving %s (max_model_len %d) from %s", served, self.llm.info.max_model_len, root or "embedded")
        self._drain_on_sigterm()

    def _drain_on_sigterm(self) -> None:
        """SIGTERM (a rollout, a scale-down) drains before uvicorn's own shutdown starts.

        uvicorn would stop accepting at once, leaving new connections hanging in the
        listen backlog; instead readiness turns false and new requests get 503 while the
        running ones finish (up to service.drain_timeout, then they are aborted), and only
        then is uvicorn's handler called, which closes the server and exits. The instance
        is built inside uvicorn's serve on the main thread, so its handler is the one
        replaced here.
        """
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not on the main thread: SIGTERM will not drain")
            return
        loop = asyncio.get_running_loop()
        uvicorn_exit = signal.getsignal(signal.SIGTERM)

        async def drain() -> None:
            aborted = await self.llm.drain(PRESET.service.drain_timeout)
            logger.info("drained on SIGTERM (%d requests aborted at the deadline); shutting down", aborted)
            if callable(uvicorn_exit):
                uvicorn_exit(signal.SIGTERM, None)

        def on_sigterm(signum: int, frame: Any) -> None:
            if not self.llm.draining:
                loop.call_soon_threadsafe(lambda: loop.create_task(drain()))
                self.llm.draining = True  # at once: readiness and new requests see it now

        signal.signal(signal.SIGTERM, on_sigterm)

    def __is_alive__(self) -> bool:
        return self.llm.is_responsive

    def __is_ready__(self) -> bool:
        return self.llm.is_alive and not self.llm.draining

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
        async for text in self._typed(lambda: self.serving.prompt_ids(prompt), req):
            yield text

    @bentoml.api(route="/chat")
    async def chat(
        self, messages: list[ChatMessage], max_tokens: Annotated[int, Ge(1)] = 256, temperature: float = 0.0,
        top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Chat with the model's chat template, streaming the reply as it is generated."""
        req = ChatCompletionRequest(messages=messages, max_tokens=max_tokens, temperature=temperature,
                                    top_p=top_p, seed=seed, stop=stop)
        async for text in self._typed(lambda: self.serving.chat_prompt_async(req.messages), req):
            yield text

    async def _typed(self, prompt: Any, req: Any) -> AsyncIterator[str]:
        # BentoML awaits the first chunk before answering, so errors here keep their status.
        try:
            params = self.serving.sampling_params(req, req.max_tokens, None, {})
            salt = tenancy.cache_salt(None, self.serving.cache_scope)
            async for out in self.llm.generate(await prompt(), params, cache_salt=salt):
                for delta in out.deltas:
                    if delta.text:
                        yield delta.text
        except Exception as exc:  # noqa: BLE001 - one mapping for every route
            err = to_api_error(exc)
            raise BentoMLException(err.detail.message, error_code=HTTPStatus(err.status)) from None


# Starlette runs the first-added middleware outermost: every answer gets its X-Request-Id,
# CORS answers preflights and puts its headers on every answer (a 401 too, so a browser can
# read it), then the key is checked.
LLMService.add_asgi_middleware(RequestIdMiddleware)
if PRESET.service.cors.allow_origins:
    LLMService.add_asgi_middleware(CORSMiddleware, **PRESET.service.cors.model_dump())
LLMService.add_asgi_middleware(APIKeyMiddleware, protect_ops=PRESET.service.protect_ops_routes,
                               max_in_flight_per_key=PRESET.service.max_in_flight_per_key)
LLMService.add_asgi_middleware(TypedRouteGuard, max_body_bytes=PRESET.service.max_body_bytes,
                               request_timeout=PRESET.service.request_timeout)
LLMService.add_asgi_middleware(MergedDocs)
