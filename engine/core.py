"""EngineCore: the engine's busy loop, driven by typed commands (engine/messages.py).

Whichever driver runs it (a thread of the serving process, or the engine process of its
own) hands it a source of commands and a sink for events; both run this same loop and
this same `handle`. Between steps it applies every command that has arrived, steps
while there is work, and sleeps on the source when idle, waking now and then to notice
a dead parallel worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.engine import LLMEngine
from engine.messages import (AbortRequest, AddRequest, Added, Command, Died, ErrorInfo, Event, GetStats,
                             Heartbeat, StatsReply, StepOutput, Stop, Stopped)

logger = logging.getLogger(__name__)

HEALTH_CHECK_S = 1.0  # how often an idle engine looks for dead parallel workers
COMPILE_POLL_S = 0.01  # how often an otherwise idle engine looks for compiled constraints
HEARTBEAT_S = 1.0  # the longest the loop stays silent while it turns (messages.Heartbeat)

# Commands that have arrived: waits up to the given seconds for the first one (0: none).
Source = Callable[[float], list[Command]]
Sink = Callable[[Event], None]


class EngineCore:
    def __init__(self, engine: LLMEngine, emit: Sink) -> None:
        self.engine = engine
        self._sink = emit
        self._last_emit = time.monotonic()

    def emit(self, event: Event) -> None:
        self._last_emit = time.monotonic()
        self._sink(event)

    def handle(self, cmd: Command) -> bool:
        """Apply one command between steps; False when it says to stop."""
        engine = self.engine
        if isinstance(cmd, AddRequest):
            try:
                queued = engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt,
                                            cmd.priority, cmd.pooling)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                self.emit(Added(cmd.request_id, ErrorInfo.of(exc)))
            else:
                if queued:  # else Added comes once its constraint has compiled (run)
                    self.emit(Added(cmd.request_id))
        elif isinstance(cmd, AbortRequest):
            out = engine.abort(cmd.request_id)
            if out is not None:
                self.emit(StepOutput([out], engine.gauges()))
        elif isinstance(cmd, GetStats):
            self.emit(StatsReply(engine.stats()))
        elif isinstance(cmd, Stop):
            return False
        else:
            raise TypeError(f"not an engine command: {cmd!r}")
        return True

    def run(self, source: Source) -> None:
        """Until a Stop arrives (then Stopped is emitted) or something raises. Whatever
        raises is the driver's to report, with Died, once the loop is gone."""
        engine = self.engine
        while True:
            engine.check_health()  # a parallel worker's death ends the loop, busy or idle
            idle = COMPILE_POLL_S if engine.compiles else HEALTH_CHECK_S
            for cmd in source(0.0 if engine.has_unfinished() else idle):
                if not self.handle(cmd):
                    self.emit(Stopped())
                    return
            for request_id, error in engine.compiles.poll():
                self.emit(Added(request_id, None if error is None else ErrorInfo.of(error)))
            if engine.has_unfinished():
                self.emit(engine.step())
            elif time.monotonic() - self._last_emit >= HEARTBEAT_S:
                self.emit(Heartbeat())


def died(exc: BaseException) -> Died:
    """The loop's death as an event, logged here with its traceback. The message is for
    the serving side's log; clients get a plain message (engine/serving/errors.py)."""
    logger.error("engine loop died", exc_info=exc)
    return Died(f"{type(exc).__name__}: {exc}")
