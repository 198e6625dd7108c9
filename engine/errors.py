"""Errors that cross the engine's boundary, typed so callers never parse messages."""

from __future__ import annotations


class ParamError(ValueError):
    """A request or config value that can never work. `param` names the offending field.

    It is a ValueError, so callers that only care that the input was bad can catch that;
    the serving layer reads `param` to fill OpenAI's error object.
    """

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine has stopped (a fault inside a step, a dead process, a shutdown) and will
    never step again: every call still pending and every later one raises this, chained
    to the original fault where there is one, rather than waiting on it."""
