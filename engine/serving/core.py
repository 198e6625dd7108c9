"""Where the engine's busy loop runs for AsyncLLM: a thread of this process, or a process
of its own.

ProcessCore is what the service uses, as vLLM v1 runs its EngineCore: the loop that
schedules, runs the model and samples lives in a child process that owns the cores'
compute, while this process keeps HTTP, validation, tokenization, JSON and SSE. In one
process the two share a GIL: every torch op the engine thread finishes waits to take
the GIL back from whichever request handler holds it, and Python's switch interval is
5 ms, so a busy HTTP side stretches every step. The child gets its own interpreter.

ThreadCore runs an LLMEngine object on a thread, for tests and embedding.

Both report to AsyncLLM through the same three callbacks, from one thread of theirs:
  on_added(request_id, error or None), on_step(outputs, stats), on_dead(exc).
Detokenization and stop strings stay next to the scheduler, in the core: a stop string
must end its sequence in the step that produced it, so that no further token is computed
and its blocks are freed at once. What crosses the pipe per step is each request's new
token ids and new text (msgpack, engine/serving/wire.py), never the text so far.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing as mp
import multiprocessing.util
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

from engine import spawn
from engine.config import EngineConfig
from engine.engine import LLMEngine, StepOutput
from engine.sampling_params import SamplingParams
from engine.serving import wire
from engine.stats import EngineStats, StepStats

logger = logging.getLogger(__name__)

HEALTH_CHECK_S = 1.0  # how often an idle engine looks for dead parallel workers

OnAdded = Callable[[str, BaseException | None], None]
OnStep = Callable[[list[wire.EngineOutput], StepStats], None]
OnDead = Callable[[BaseException], None]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served by this AsyncLLM again."""


class DrainingError(RuntimeError):
    """The server is shutting down: it finishes what it has and takes nothing new."""


class ThreadCore:
    """The engine on a thread of this process: applies queued commands between steps,
    steps while there is work, sleeps on the queue when idle."""

    def __init__(self, engine: LLMEngine, on_added: OnAdded, on_step: OnStep, on_dead: OnDead) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.model_name = engine.model_name
        self.hf_id = engine.hf_id
        self.vocab_size = engine.hf_config.vocab_size
        self._on_added, self._on_step, self._on_dead = on_added, on_step, on_dead
        self._cmds: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.last_stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None,
            priority: int = 0) -> None:
        self._cmds.put(("add", request_id, prompt, params, cache_salt, priority))

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def stats(self, timeout: float) -> EngineStats:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("stats", answer))
        try:
            return answer.result(timeout)
        except concurrent.futures.TimeoutError:
            return self.last_stats

    def shutdown(self, timeout: float) -> None:
        self._cmds.put(("stop",))
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while self._apply(block=not self.engine.has_unfinished()):
                self.engine.check_health()
                if self.engine.has_unfinished():
                    step = self.engine.step()
                    self._on_step([wire.EngineOutput.of(o) for o in step.outputs], step.stats)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the loop must reach the waiters
            logger.exception("engine loop died")
            self._answer_pending_stats()
            self._on_dead(exc)
        else:
            self._answer_pending_stats()
            self._on_dead(EngineDeadError("the engine was shut down"))
        finally:
            self.engine.shutdown()

    def _apply(self, block: bool) -> bool:
        cmds = []
        if block:
            try:
                cmds.append(self._cmds.get(timeout=HEALTH_CHECK_S))
            except queue.Empty:
                return True
        cmds += _drain(self._cmds)
        for cmd in cmds:
            kind = cmd[0]
            if kind == "stop":
                return False
            if kind == "stats":
                self.last_stats = self.engine.stats()
                cmd[1].set_result(self.last_stats)
            elif kind == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._on_step([wire.EngineOutput.of(out)], self.engine.gauges())
            else:
                _, request_id, prompt, params, cache_salt, priority = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, cache_salt, priority)
                except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                    self._on_added(request_id, exc)
                else:
                    self._on_added(request_id, None)
        return True

    def _answer_pending_stats(self) -> None:
        """Adds left in the queue need nothing: AsyncLLM fails every stream on death."""
        for cmd in _drain(self._cmds):
            if cmd[0] == "stats":
                cmd[1].set_result(self.last_stats)


class ProcessCore:
    """The engine in a child process, spoken to over a pipe; a reader thread here turns
    its messages into the callbacks."""

    def __init__(self, config: EngineConfig, tokenizer: Any, on_added: OnAdded, on_step: OnStep,
                 on_dead: OnDead, start_timeout: float = 600.0) -> None:
        self.tokenizer = tokenizer
        self._on_added, self._on_step, self._on_dead = on_added, on_step, on_dead
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and locks
        self._conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: a parallel engine starts its worker processes from there, which
        # daemons may not. The finalizer stops it when this interpreter exits instead.
        self._proc = ctx.Process(target=run_core, args=(config, child), name="engine-core", daemon=False)
        spawn.start(self._proc)  # never re-runs the user's script in the engine process
        mp.util.Finalize(self, _stop_at_exit, args=(self._conn, self._proc), exitpriority=10)
        child.close()
        self._send_lock = threading.Lock()
        self._stats_waiters: queue.SimpleQueue[concurrent.futures.Future] = queue.SimpleQueue()
        if not self._conn.poll(start_timeout):
            self._proc.kill()
            raise EngineDeadError(f"the engine process did not start within {start_timeout:.0f}s")
        try:
            first = wire.unpack(self._conn.recv_bytes())
        except EOFError:
            raise EngineDeadError(f"the engine process exited at start-up (code {self._proc.exitcode})") from None
        if first[0] != "ready":
            self._proc.join(10)
            raise EngineDeadError(f"the engine process failed at start-up: {first[1]}")
        info = first[1]
        self.max_model_len, self.model_name = info["max_model_len"], info["model_name"]
        self.sampling_defaults = info["sampling_defaults"]
        self.hf_id = info["hf_id"]
        self.vocab_size = info["vocab_size"]
        self.last_stats = EngineStats(**info["stats"])
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()

    @property
    def is_alive(self) -> bool:
        return self._proc.is_alive() and self._reader.is_alive()

    def _send(self, msg: list) -> None:
        data = wire.pack(msg)
        with self._send_lock:
            self._conn.send_bytes(data)

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None,
            priority: int = 0) -> None:
        self._send(["add", request_id, prompt, asdict(params), cache_salt, priority])

    def abort(self, request_id: str) -> None:
        try:
            self._send(["abort", request_id])
        except OSError:  # the process is gone; its death is reported by the reader
            pass

    def stats(self, timeout: float) -> EngineStats:
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._send_lock:  # the waiter queue and the pipe in the same order
            self._stats_waiters.put(answer)
            self._conn.send_bytes(wire.pack(["stats"]))
        try:
            return answer.result(timeout)
        except concurrent.futures.TimeoutError:
            return self.last_stats

    def shutdown(self, timeout: float) -> None:
        try:
            self._send(["stop"])
        except OSError:
            pass
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def _read(self) -> None:
        exc: BaseException
        try:
            while True:
                msg = wire.unpack(self._conn.recv_bytes())
                kind = msg[0]
                if kind == "step":
                    self._on_step([wire.EngineOutput.decode(o) for o in msg[1]], StepStats(**msg[2]))
                elif kind == "added":
                    self._on_added(msg[1], None if msg[2] is None else wire.decode_error(msg[2]))
                elif kind == "stats":
                    self.last_stats = EngineStats(**msg[1])
                    self._stats_waiters.get_nowait().set_result(self.last_stats)
                elif kind == "stopped":
                    exc = EngineDeadError("the engine was shut down")
                    break
                else:  # "dead"
                    exc = EngineDeadError(f"the engine loop died: {msg[1]}")
                    break
        except (EOFError, OSError):
            self._proc.join(5)
            exc = EngineDeadError(f"the engine process exited (code {self._proc.exitcode})")
        except BaseException as e:  # noqa: BLE001 - a bug here must still fail the waiters
            logger.exception("engine reader died")
            exc = e
        for waiter in _drain(self._stats_waiters):
            waiter.set_result(self.last_stats)
        self._on_dead(exc)


def run_core(config: EngineConfig, conn: Connection) -> None:
    """The child process: build the engine, then apply commands between steps and ship
    each step's outputs. Blocks on the pipe when idle; exits when the parent goes away.

    SIGTERM is ignored here: a rollout signals the whole process group, and the parent,
    which drains its requests first, is the one that decides when the engine stops."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = LLMEngine(config)
        conn.send_bytes(wire.pack(["ready", {"max_model_len": engine.max_model_len, "model_name": engine.model_name,
                                             "sampling_defaults": engine.sampling_defaults, "hf_id": engine.hf_id,
                                             "vocab_size": engine.hf_config.vocab_size,
                                             "stats": asdict(engine.stats())}]))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why
        logger.exception("engine start-up failed")
        conn.send_bytes(wire.pack(["dead", repr(exc)]))
        return
    try:
        while True:
            engine.check_health()  # a parallel worker's death ends the loop, busy or idle
            if not engine.has_unfinished() and not conn.poll(HEALTH_CHECK_S):
                continue  # idle: sleep until a command (or EOF) arrives, looking up now and then
            while conn.poll(0):
                if not _handle(engine, conn, wire.unpack(conn.recv_bytes())):
                    conn.send_bytes(wire.pack(["stopped"]))
                    return
            if engine.has_unfinished():
                _send_step(conn, engine.step())
    except (EOFError, BrokenPipeError):  # the parent is gone: nothing left to serve
        return
    except BaseException as exc:  # noqa: BLE001
        logger.exception("engine loop died")
        try:
            conn.send_bytes(wire.pack(["dead", repr(exc)]))
        except OSError:
            pass
        raise SystemExit(1) from exc
    finally:
        engine.shutdown()


def _handle(engine: LLMEngine, conn: Connection, msg: list) -> bool:
    kind = msg[0]
    if kind == "stop":
        return False
    if kind == "add":
        _, request_id, prompt, params, cache_salt, priority = msg
        try:
            engine.add_request(request_id, prompt, SamplingParams(**params), cache_salt, priority)
        except Exception as exc:  # noqa: BLE001 - a bad request fails alone
            conn.send_bytes(wire.pack(["added", request_id, wire.encode_error(exc)]))
        else:
            conn.send_bytes(wire.pack(["added", request_id, None]))
    elif kind == "abort":
        out = engine.abort(msg[1])
        if out is not None:
            _send_step(conn, StepOutput([out], engine.gauges()))
    elif kind == "stats":
        conn.send_bytes(wire.pack(["stats", asdict(engine.stats())]))
    return True


def _send_step(conn: Connection, step: StepOutput) -> None:
    conn.send_bytes(wire.pack(["step", [wire.EngineOutput.of(o).encode() for o in step.outputs],
                               asdict(step.stats)]))


def _stop_at_exit(conn: Connection, proc: mp.Process) -> None:
    """At interpreter exit, before multiprocessing joins its children: ask the engine
    process to stop, then make sure it has."""
    if proc.is_alive():
        try:
            conn.send_bytes(wire.pack(["stop"]))
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _drain(q: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
