"""The client side of the engine core: where EngineCore (engine/core.py) runs for AsyncLLM.

ProcessClient is what the service uses, as vLLM v1 runs its EngineCore: the loop that
schedules, runs the model and samples lives in a child process that owns the cores'
compute, while this process keeps HTTP, validation, tokenization, JSON and SSE. In one
process the two share a GIL: every torch op the engine thread finishes waits to take
the GIL back from whichever request handler holds it, and Python's switch interval is
5 ms, so a busy HTTP side stretches every step. The child gets its own interpreter.

ThreadClient runs the same EngineCore around an LLMEngine object on a thread, for tests
and embedding. Commands and events are engine/messages.py's types: handed over as they
are on a thread, encoded by engine/client/wire.py over the pipe. Both clients report
to AsyncLLM through three callbacks, from one thread of theirs:
  on_added(request_id, error or None), on_step(StepOutput), on_dead(exc).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing as mp
import multiprocessing.util
import queue
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from engine import spawn
from engine.client import wire
from engine.errors import EngineDeadError
from engine.messages import (AbortRequest, Added, AddRequest, Command, Died, Event, GetStats, ModelInfo, Ready,
                             StatsReply, StepOutput, Stop, Stopped)
from engine.stats import EngineStats

if TYPE_CHECKING:  # the engine itself loads where it runs: the HTTP process needs neither torch nor models
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

logger = logging.getLogger(__name__)

OnAdded = Callable[[str, BaseException | None], None]
OnStep = Callable[[StepOutput], None]
OnDead = Callable[[BaseException], None]




class DrainingError(RuntimeError):
    """The server is shutting down: it finishes what it has and takes nothing new."""


class EngineCoreClient(ABC):
    """What both clients share: sending commands in order, and turning events into the
    callbacks. Subclasses say how a command travels (`_put`) and how the core runs
    (`is_alive`, `shutdown`)."""

    info: ModelInfo
    tokenizer: Any

    def __init__(self, on_added: OnAdded, on_step: OnStep, on_dead: OnDead) -> None:
        self._on_added, self._on_step, self._on_dead = on_added, on_step, on_dead
        self._send_lock = threading.Lock()  # the stats waiters and the commands in the same order
        self._stats_waiters: queue.SimpleQueue[concurrent.futures.Future] = queue.SimpleQueue()
        self._stats_asked: concurrent.futures.Future | None = None  # the GetStats not yet answered
        self.last_event = time.monotonic()  # when the core last said anything (a heartbeat at least)

    @property
    def silent_for(self) -> float:
        """Seconds since the core's last event: a turning loop speaks at least every second
        (core.HEARTBEAT_S), so a long silence is a core stuck in one step."""
        return time.monotonic() - self.last_event

    @property
    def last_stats(self) -> EngineStats:
        return self.info.stats

    @abstractmethod
    def _put(self, cmd: Command) -> None: ...

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def shutdown(self, timeout: float) -> None: ...

    def add(self, request: AddRequest) -> None:
        with self._send_lock:
            self._put(request)

    def abort(self, request_id: str) -> None:
        try:
            with self._send_lock:
                self._put(AbortRequest(request_id))
        except OSError:  # the process is gone; its death is reported by the reader
            pass

    def stats(self, timeout: float) -> EngineStats:
        """Read by the core between two steps; the last reading if it does not answer in time.
        A call while another's question is unanswered waits for that answer: a core busy
        in a long step gets one GetStats, not one per poll of /stats."""
        try:
            with self._send_lock:
                answer = self._stats_asked
                if answer is None or answer.done():
                    answer = self._stats_asked = concurrent.futures.Future()
                    self._stats_waiters.put(answer)
                    self._put(GetStats())
            return answer.result(timeout)
        except (concurrent.futures.TimeoutError, OSError):
            return self.last_stats

    def dispatch(self, event: Event) -> bool:
        """One event from the core; False once the core is gone (after on_dead)."""
        self.last_event = time.monotonic()
        if isinstance(event, StepOutput):
            self._on_step(event)
        elif isinstance(event, Added):
            self._on_added(event.request_id, None if event.error is None else event.error.exception())
        elif isinstance(event, StatsReply):
            self.info.stats = event.stats
            self._stats_waiters.get_nowait().set_result(event.stats)
        elif isinstance(event, Stopped):
            self._dead(EngineDeadError("the engine was shut down"))
            return False
        elif isinstance(event, Died):
            self._dead(EngineDeadError(f"the engine loop died: {event.message}"))
            return False
        return True

    def _dead(self, exc: BaseException) -> None:
        while True:
            try:
                self._stats_waiters.get_nowait().set_result(self.last_stats)
            except queue.Empty:
                break
        self._on_dead(exc)


class ThreadClient(EngineCoreClient):
    """EngineCore on a thread of this process; events are dispatched on that thread."""

    def __init__(self, engine: LLMEngine, on_added: OnAdded, on_step: OnStep, on_dead: OnDead) -> None:
        super().__init__(on_added, on_step, on_dead)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info = engine.info()
        self._cmds: queue.SimpleQueue[Command] = queue.SimpleQueue()
        from engine.core import EngineCore

        self._core = EngineCore(engine, self.dispatch)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _put(self, cmd: Command) -> None:
        self._cmds.put(cmd)

    def _take(self, timeout: float) -> list[Command]:
        cmds = []
        if timeout > 0:
            try:
                cmds.append(self._cmds.get(timeout=timeout))
            except queue.Empty:
                return []
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _run(self) -> None:
        try:
            self._core.run(self._take)
        except BaseException as exc:  # noqa: BLE001 - whatever kills the loop must reach the waiters
            from engine.core import died

            self.dispatch(died(exc))
        finally:
            self.engine.shutdown()

    def shutdown(self, timeout: float) -> None:
        self._cmds.put(Stop())
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class ProcessClient(EngineCoreClient):
    """EngineCore in a child process, spoken to over a pipe; a reader thread here
    dispatches its events."""

    def __init__(self, config: EngineConfig, load_tokenizer: Callable[[], Any], on_added: OnAdded, on_step: OnStep,
                 on_dead: OnDead, start_timeout: float = 600.0) -> None:
        super().__init__(on_added, on_step, on_dead)
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and locks
        self._conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: a parallel engine starts its worker processes from there, which
        # daemons may not. The finalizer stops it when this interpreter exits instead.
        self._proc = ctx.Process(target=run_core, args=(config, child), name="engine-core", daemon=False)
        spawn.start(self._proc)  # never re-runs the user's script in the engine process
        mp.util.Finalize(self, _stop_at_exit, args=(self._conn, self._proc), exitpriority=10)
        child.close()
        # The tokenizer loads here while the engine process imports and builds its model.
        try:
            self.tokenizer = load_tokenizer()
        except BaseException:
            self._proc.kill()
            self._proc.join(5)
            raise
        if not self._conn.poll(start_timeout):
            self._proc.kill()
            raise EngineDeadError(f"the engine process did not start within {start_timeout:.0f}s")
        try:
            first = wire.decode_event(self._conn.recv_bytes())
        except EOFError:
            raise EngineDeadError(f"the engine process exited at start-up (code {self._proc.exitcode})") from None
        if not isinstance(first, Ready):
            self._proc.join(10)
            raise EngineDeadError(f"the engine process failed at start-up: {getattr(first, 'message', first)}")
        self.info = first.info
        self.pid = self._proc.pid
        self.last_event = time.monotonic()  # Ready, read here rather than by dispatch
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._reader.start()
        # Commands go through a queue to a writer thread: send_bytes blocks once the pipe is
        # full (a core stuck in a step reads nothing), and a caller on the event loop must not.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="engine-core-writer", daemon=True)
        self._writer.start()

    @property
    def is_alive(self) -> bool:
        return self._proc.is_alive() and self._reader.is_alive()

    def _put(self, cmd: Command) -> None:
        """Never blocks: encoded here, in the caller's order, and sent by the writer."""
        if not self._writer.is_alive():
            raise OSError("the engine process's pipe is closed")
        self._outbox.put(wire.encode(cmd))

    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the process is gone: its death is reported by the reader
                return

    def shutdown(self, timeout: float) -> None:
        try:
            with self._send_lock:
                self._put(Stop())
        except OSError:
            pass
        self._outbox.put(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout)

    def _read(self) -> None:
        try:
            while self.dispatch(wire.decode_event(self._conn.recv_bytes())):
                pass
        except (EOFError, OSError):
            self._proc.join(5)
            self._dead(EngineDeadError(f"the engine process exited (code {self._proc.exitcode})"))
        except BaseException as exc:  # noqa: BLE001 - a bug here must still fail the waiters
            logger.exception("engine reader died")
            self._dead(exc)


def run_core(config: EngineConfig, conn: Connection) -> None:
    """The child process: build the engine, say Ready, then run EngineCore over the pipe.
    Exits when the parent goes away.

    SIGTERM is ignored here: a rollout signals the whole process group, and the parent,
    which drains its requests first, is the one that decides when the engine stops."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.core import EngineCore, died
    from engine.engine import LLMEngine

    def emit(event: Event) -> None:
        conn.send_bytes(wire.encode(event))

    def take(timeout: float) -> list[Command]:
        cmds = []
        if conn.poll(timeout):
            while conn.poll(0):
                cmds.append(wire.decode_command(conn.recv_bytes()))
        return cmds

    try:
        engine = LLMEngine(config)
        emit(Ready(engine.info()))
    except BaseException as exc:  # noqa: BLE001 - the parent must hear why
        emit(died(exc))
        return
    try:
        EngineCore(engine, emit).run(take)
    except (EOFError, BrokenPipeError):  # the parent is gone: nothing left to serve
        return
    except BaseException as exc:  # noqa: BLE001
        try:
            emit(died(exc))
        except OSError:
            pass
        raise SystemExit(1) from exc
    finally:
        engine.shutdown()


def _stop_at_exit(conn: Connection, proc: mp.Process) -> None:
    """At interpreter exit, before multiprocessing joins its children: ask the engine
    process to stop, then make sure it has."""
    if proc.is_alive():
        try:
            conn.send_bytes(wire.encode(Stop()))
        except OSError:
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
