"""AsyncLLM: one engine served to many asyncio consumers, each with a stream of deltas.

The engine steps in an EngineCore reached through a client (engine/client/core_client.py):
by default in a child process, as the service runs it, or on a thread of this process
around an LLMEngine object. The client reports added requests, step outputs and the
core's death; AsyncLLM routes each output to its request's event loop with
call_soon_threadsafe.

Every output carries what its step added. A consumer that falls behind folds what
piled up into one delta per sequence, so a slow client sees each token once and costs
nothing that grows with the text so far.

Failure rules, which the HTTP layer relies on:
- add_request's ParamError (a request that can never run) is raised from the caller's
  `generate` before anything is yielded, and touches no other request;
- a consumer that stops iterating (client gone, task cancelled) aborts its request,
  which frees its KV blocks at the next step boundary;
- if the engine dies (a step raises, the process exits), every waiting stream gets
  EngineDeadError, later calls fail fast, and `is_alive` turns False so /health answers
  503. Nothing is left hanging.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from engine import intake
from engine.client.admission import Admission, QueueFullError, QueueLimits
from engine.client.core_client import DrainingError, ProcessClient, ThreadClient
from engine.client.observers import RequestTracer, StepObserver
from engine.errors import EngineDeadError, ParamError
from engine.messages import AddRequest, CompletionDelta, ModelInfo, RequestDelta, RequestMetrics, StepOutput, TokenLogprobs
from engine.models import loader
from engine.pooling import PoolingParams
from engine.prompts import encode_prompt
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine runs in its own process: this one needs neither torch nor the models
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

logger = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "DrainingError", "EngineDeadError", "QueueFullError", "QueueLimits", "StreamOutput"]


@dataclass
class StreamOutput:
    """One item of a request's stream: the changed sequences' deltas since the last item."""

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    num_output_tokens: int = 0  # so far, over the request's sequences (the core's count)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, on the first item that has them
    metrics: RequestMetrics | None = field(default=None, repr=False)  # the engine's timings so far
    finish_reasons: list[str] | None = None  # by sequence index, on the item that finishes it
    pooled: list[float] | None = None  # a pooling request's embedding or scores, on its one item

    @classmethod
    def fold(cls, prompt_token_ids: list[int], outs: list[RequestDelta]) -> StreamOutput:
        """Several outputs of one request, oldest first, as one item."""
        last = outs[-1]
        if len(outs) == 1:
            return cls(last.request_id, prompt_token_ids, last.deltas, last.finished, last.num_output_tokens,
                       last.num_cached_tokens, last.prompt_logprobs, last.metrics, last.finish_reasons,
                       last.pooled)
        merged: dict[int, CompletionDelta] = {}
        for out in outs:
            for d in out.deltas:
                if d.index in merged:
                    merged[d.index].extend(d)
                else:
                    merged[d.index] = msgspec.structs.replace(
                        d, token_ids=list(d.token_ids), logprobs=None if d.logprobs is None else list(d.logprobs))
        prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        return cls(last.request_id, prompt_token_ids, list(merged.values()), last.finished, last.num_output_tokens,
                   last.num_cached_tokens, prompt_lps, last.metrics, last.finish_reasons, last.pooled)


def _deliver(items: list[tuple[_Stream, RequestDelta]]) -> None:
    """On the consumers' loop: one step's deltas into their requests' queues."""
    for stream, out in items:
        stream.queue.put_nowait(out)


class _Stream:
    """The hand-off from the core's thread to one request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.added: asyncio.Future[None] = loop.create_future()

    def put(self, item: RequestDelta | BaseException) -> bool:
        """Thread-safe; False when the consumer's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False

    def resolve(self, error: BaseException | None) -> None:
        """Thread-safe: the core accepted the request (error None) or refused it."""

        def settle() -> None:
            if self.added.done():  # the consumer was cancelled meanwhile
                return
            if error is None:
                self.added.set_result(None)
            else:
                self.added.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass


class AsyncLLM:
    """Serve one engine to many asyncio consumers. `AsyncLLM(engine)` steps an LLMEngine
    on a thread here; `AsyncLLM.start(config)` builds the engine in its own process."""

    def __init__(self, engine: LLMEngine | None = None, metrics: StepObserver | None = None,
                 *, config: EngineConfig | None = None, limits: QueueLimits | None = None,
                 stall_timeout_s: float | None = 60.0, tracer: RequestTracer | None = None) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.stall_timeout_s = stall_timeout_s
        self.admission = Admission(limits)
        self.draining = False  # set by drain(): new requests are refused, running ones finish
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # orders submissions against death
        self._dead: BaseException | None = None
        callbacks = (self._on_added, self._on_step, self._on_dead)
        if engine is not None:
            self.engine: LLMEngine | None = engine
            self._core: ThreadClient | ProcessClient = ThreadClient(engine, *callbacks)
        else:
            assert config is not None, "AsyncLLM needs an engine or a config"
            self.engine = None
            # A GGUF converts here once, before the engine process looks: the conversion the
            # engine will read (loader.reads_blocks; "auto" is the file's blocks or the dense
            # weights dequantized from them, the same small conversion either way).
            files = loader.resolve(config.model, loader.reads_blocks(config.quantization, config.tensor_parallel_size))
            self._core = ProcessClient(config, lambda: loader.load_tokenizer(files), *callbacks)
        if metrics is not None:
            cfg = config if config is not None else engine.config  # type: ignore[union-attr]
            metrics.record_start(self._core.last_stats, cfg.block_size, cfg.dtype, cfg.enable_prefix_caching)

    @classmethod
    def start(cls, config: EngineConfig, metrics: StepObserver | None = None,
              limits: QueueLimits | None = None, stall_timeout_s: float | None = 60.0,
              tracer: RequestTracer | None = None) -> AsyncLLM:
        """The engine core in a child process: its busy loop never waits on this one's GIL."""
        return cls(None, metrics, config=config, limits=limits, stall_timeout_s=stall_timeout_s, tracer=tracer)

    # -- facts the HTTP layer needs -------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._core.tokenizer

    @property
    def info(self) -> ModelInfo:
        """The model's facts, as the core reported them at start."""
        return self._core.info

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._core.is_alive

    @property
    def is_responsive(self) -> bool:
        """Alive, and its loop has spoken within stall_timeout_s: what liveness probes ask.
        A core stuck inside one step still holds its process, so is_alive alone stays True."""
        return self.is_alive and (self.stall_timeout_s is None or self._core.silent_for < self.stall_timeout_s)

    @property
    def error(self) -> BaseException | None:
        return self._dead

    def stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """The engine's stats, read by the core between two steps, plus liveness.

        Computed when asked, never per step; callers asking at once share one reading
        (client.stats). A dead engine, or one whose step outlasts `timeout`, answers with
        its last reading: the caller's thread is held that long at most, where it was 30 s."""
        stats = self._core.last_stats if self._dead is not None else self._core.stats(timeout)
        return {**asdict(stats), "engine_alive": self.is_alive, "engine_responsive": self.is_responsive}

    # -- requests -------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        operation: str = "text_completion",
        served_model: str | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Queue a request and yield its deltas until it finishes.

        Raises the engine's ParamError before the first item when the request is invalid,
        QueueFullError when the waiting queue is at its bound (engine/client/admission.py),
        and EngineDeadError if the engine is or becomes dead. Leaving the loop early
        (break, cancellation, a disconnected client) aborts the request. With a `tracer`
        (engine/serving/tracing.py), each request is one span, named for `operation` and
        the model name clients use (`served_model`, default the engine's). With
        `pooling_params` it is an embedding request: one finished item carries the vector.
        """
        request_id = request_id or uuid.uuid4().hex
        ids = encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        params = (params or SamplingParams()).validate()  # the one check; the engine process trusts it
        if pooling_params is not None:
            pooling_params.validate()
        intake.check_token_ids(self.info.vocab_size, ids, params)
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine is dead: {self._dead!r}") from self._dead
            if self.draining:
                raise DrainingError("the server is shutting down and takes no new requests; retry on another replica")
            if request_id in self._streams:
                raise ParamError("request_id", f"request_id {request_id!r} is already in use")
            self.admission.admit(len(ids))
            self._streams[request_id] = stream  # before the add: a death from now on reaches it
        finished = False
        waiting = True  # counted by admission until its first output
        span = (self.tracer.start_span(operation, served_model or self.info.model_name, request_id, params, len(ids))
                if self.tracer is not None else None)
        out, error = None, None
        try:
            try:
                self._core.add(AddRequest(request_id, ids, params, cache_salt, priority, pooling_params))
            except OSError:  # the engine process is gone; the core reports the death to the stream
                pass
            except BaseException:  # never handed over: nothing will ever answer this stream
                finished = True
                self._streams.pop(request_id, None)
                raise
            await stream.added
            while not finished:
                items = [await stream.queue.get()]
                while not isinstance(items[-1], BaseException) and not stream.queue.empty():
                    items.append(stream.queue.get_nowait())  # a slow reader: fold what piled up
                if isinstance(items[-1], BaseException):
                    finished = True  # the engine already dropped it
                    raise items[-1]
                out = StreamOutput.fold(ids, items)  # type: ignore[arg-type]
                finished = out.finished
                if waiting:
                    waiting = False
                    self.admission.release(len(ids))
                yield out
        except BaseException as exc:
            error = exc if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else None
            raise
        finally:
            if self.tracer is not None:
                self.tracer.end_span(span, out, error)
            if waiting:
                self.admission.release(len(ids))
            # Not when the add itself failed: the id may belong to someone else's request.
            # Otherwise the core answers the abort with a finished output, which drops the stream.
            if not finished and not _failed(stream.added):
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step boundary. Thread-safe, idempotent."""
        if self._dead is None:
            self._core.abort(request_id)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout: float) -> int:
        """Refuse new requests, let the running ones finish for up to `timeout` seconds, then
        abort the rest (their streams end with finish_reason "abort"). Returns how many were
        aborted. The engine keeps running: shutdown() stops it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for request_id in left:
            self.abort(request_id)
        deadline = loop.time() + 10  # the aborts land at the next step
        while self._streams and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return len(left)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine; requests still in flight get EngineDeadError."""
        self._core.shutdown(timeout)

    # -- callbacks from the core's thread -------------------------------------------
    def _on_added(self, request_id: str, error: BaseException | None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if error is not None:
            self._streams.pop(request_id, None)
        stream.resolve(error)

    def _on_step(self, step: StepOutput) -> None:
        if self.metrics is not None:
            try:
                self.metrics.record_step(step)
            except Exception:  # noqa: BLE001 - metrics must never take serving down
                logger.exception("recording metrics failed")
        # One wake-up of each event loop a step, carrying all its requests' deltas: one
        # call_soon_threadsafe per delta wrote to the loop's self-pipe 64 times a step at
        # c=64, 39% of the HTTP worker's busy time.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestDelta]]] = {}
        for out in step.outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                for _, out in items:
                    if not out.finished:
                        self._streams.pop(out.request_id, None)
                        self._core.abort(out.request_id)

    def _on_dead(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            err = EngineDeadError(f"the engine is dead: {exc!r}")
            err.__cause__ = exc
            stream.resolve(err)
            stream.put(err)


def _failed(fut: asyncio.Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None
