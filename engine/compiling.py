"""Requests admitted but for their structured-output constraint, which compiles on a thread
beside the core (engine/structured.py): the engine queues each once its grammar is there,
or fails it once the grammar is found invalid or has run past its deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.errors import ParamError
from engine.sampling_params import Constraint
from engine.structured import Grammars


@dataclass
class Compiling:
    constraint: Constraint
    future: Future
    deadline: float
    queue: Callable[[], None]  # puts the request in the scheduler once the grammar is there


class CompileWaits:
    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._waiting: dict[str, Compiling] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def start(self, request_id: str, constraint: Constraint, queue: Callable[[], None]) -> bool:
        """Queue the request now if its grammar is cached (True); else wait for the compile
        (False). ParamError at once for a constraint too large or known to be too slow."""
        future = self.grammars.submit(constraint)
        if future is None:
            queue()
            return True
        self._waiting[request_id] = Compiling(constraint, future, time.monotonic() + self.grammars.timeout_s, queue)
        return False

    def poll(self, wait: bool = False) -> list[tuple[str, ParamError | None]]:
        """The requests whose constraint has compiled (now queued: None) or failed (the
        ParamError). `wait` blocks until each is one or the other."""
        settled = []
        for rid, c in list(self._waiting.items()):
            try:
                if self.grammars.result(c.constraint, c.future, c.deadline, wait) is None:
                    continue
            except ParamError as exc:
                settled.append((rid, exc))
            else:
                c.queue()
                settled.append((rid, None))
            del self._waiting[rid]
        return settled

    def drop(self, request_id: str) -> None:
        """An aborted request stops waiting; its compile goes on and is cached for the next."""
        self._waiting.pop(request_id, None)
