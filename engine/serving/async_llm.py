"""AsyncLLM: the engine on its own thread, with an asyncio stream of deltas per request.

LLMEngine is single-threaded and a step blocks for a whole forward pass, so it cannot
run on the event loop. One engine thread owns it: it applies queued adds and aborts
between steps, steps while there is work, and sleeps on the command queue when idle.
Outputs cross back to each request's event loop with call_soon_threadsafe.

Every engine output carries what its step added. A consumer that falls behind folds
what piled up into one delta per sequence, so a slow client sees each token once and
costs nothing that grows with the text so far.

Failure rules, which the HTTP layer relies on:
- add_request's ParamError (a request that can never run) is raised from the caller's
  `generate` before anything is yielded, and touches no other request;
- a consumer that stops iterating (client gone, task cancelled) aborts its request,
  which frees its KV blocks at the next step boundary;
- if a step raises, every waiting stream gets EngineDeadError, later calls fail fast,
  and `is_alive` turns False so /health answers 503. Nothing is left hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.engine import LLMEngine, StepOutput
from engine.outputs import CompletionDelta, RequestOutput
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served by this AsyncLLM again."""


@dataclass
class StreamOutput:
    """One item of a request's stream: the changed sequences' deltas plus the latest state."""

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    finished: bool
    output: RequestOutput  # the latest engine output, cumulative fields included
    num_cached_tokens: int = 0

    @classmethod
    def fold(cls, outs: list[RequestOutput]) -> StreamOutput:
        """Several outputs of one request, oldest first, as one item."""
        merged: dict[int, CompletionDelta] = {}
        for out in outs:
            for d in out.deltas:
                if d.index in merged:
                    merged[d.index].extend(d)
                else:
                    merged[d.index] = replace(d, token_ids=list(d.token_ids),
                                              logprobs=None if d.logprobs is None else list(d.logprobs))
        last = outs[-1]
        return cls(last.request_id, last.prompt_token_ids, list(merged.values()), last.finished, last,
                   last.num_cached_tokens)


class _Stream:
    """The hand-off from the engine thread to one request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Thread-safe; False when the consumer's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    stream: _Stream
    added: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stats:
    answer: concurrent.futures.Future


class _Stop:
    pass


class AsyncLLM:
    """Serve one LLMEngine to many asyncio consumers. Create it, then `generate` from any loop."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cmds: queue.SimpleQueue[_Add | _Abort | _Stats | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()  # orders submissions against death
        self._dead: BaseException | None = None
        self._last_stats = engine.stats()  # what stats() answers once the loop is gone
        if metrics is not None:
            metrics.record_start(self._last_stats)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- facts the HTTP layer needs -------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._dead

    def stats(self, timeout: float = 30.0) -> dict[str, Any]:
        """The engine's stats, read on the engine thread between two steps, plus liveness.

        Computed when asked, never per step; a dead loop answers with its last reading.
        """
        stats = self._last_stats
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            alive = self._dead is None
            if alive:
                self._cmds.put(_Stats(answer))
        if alive:
            try:
                stats = answer.result(timeout)
            except (concurrent.futures.TimeoutError, EngineDeadError):
                pass
        return {**asdict(stats), "engine_alive": self.is_alive}

    # -- requests -------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[StreamOutput]:
        """Queue a request and yield its deltas until it finishes.

        Raises the engine's ParamError before the first item when the request is invalid,
        and EngineDeadError if the engine loop is or becomes dead. Leaving the loop early
        (break, cancellation, a disconnected client) aborts the request.
        """
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop())
        added: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params or SamplingParams(), cache_salt, stream, added))
        finished = False
        try:
            await asyncio.wrap_future(added)
            while not finished:
                items = [await stream.queue.get()]
                while not isinstance(items[-1], BaseException) and not stream.queue.empty():
                    items.append(stream.queue.get_nowait())  # a slow reader: fold what piled up
                if isinstance(items[-1], BaseException):
                    finished = True  # the engine already dropped it
                    raise items[-1]
                out = StreamOutput.fold(items)  # type: ignore[arg-type]
                finished = out.finished
                yield out
        finally:
            # Not when the add itself failed: the id may belong to someone else's request.
            if not finished and not _failed(added):
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step boundary. Thread-safe, idempotent."""
        self._cmds.put(_Abort(request_id))

    def _submit(self, cmd: _Add) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(f"the engine loop is dead: {self._dead!r}") from self._dead
            self._cmds.put(cmd)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight get EngineDeadError."""
        self._cmds.put(_Stop())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._apply(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    step = self.engine.step()
                    self._record(step)
                    self._publish(step.outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the loop must reach the waiters
            logger.exception("engine loop died")
            self._die(exc)
        else:
            self._die(EngineDeadError("the engine was shut down"))

    def _apply(self, block: bool) -> bool:
        """Apply every queued command; wait for one first when idle. False means stop."""
        cmds = [self._cmds.get()] if block else []
        cmds += self._drain()
        for cmd in cmds:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Stats):
                self._last_stats = self.engine.stats()
                cmd.answer.set_result(self._last_stats)
            elif isinstance(cmd, _Abort):
                out = self.engine.abort(cmd.request_id)
                if out is not None:
                    self._record(StepOutput([out], self.engine.gauges()))
                    self._publish([out])
            elif cmd.added.set_running_or_notify_cancel():  # False: caller gave up before we got here
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.cache_salt)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    cmd.added.set_exception(exc)
                else:
                    self._streams[cmd.request_id] = cmd.stream
                    cmd.added.set_result(None)
        return True

    def _record(self, step: StepOutput) -> None:
        if self.metrics is not None:
            try:
                self.metrics.record_step(step)
            except Exception:  # noqa: BLE001 - metrics must never take serving down
                logger.exception("recording metrics failed")

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if stream is not None and not stream.put(out) and not out.finished:
                self._streams.pop(out.request_id, None)
                self.engine.abort(out.request_id)  # nobody is listening any more

    def _drain(self) -> list[_Add | _Abort | _Stats | _Stop]:
        cmds = []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            pending = self._drain()
        for cmd in pending:
            if isinstance(cmd, _Add) and cmd.added.set_running_or_notify_cancel():
                cmd.added.set_exception(EngineDeadError(f"the engine loop is dead: {exc!r}"))
            elif isinstance(cmd, _Stats):
                cmd.answer.set_result(self._last_stats)
        for stream in self._streams.values():
            err = EngineDeadError(f"the engine loop is dead: {exc!r}")
            err.__cause__ = exc
            stream.put(err)
        self._streams.clear()


def _failed(fut: concurrent.futures.Future) -> bool:
    return fut.done() and not fut.cancelled() and fut.exception() is not None
