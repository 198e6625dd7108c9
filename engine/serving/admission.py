"""Admission control: a bounded wait instead of unbounded latency.

A request waits from the moment AsyncLLM accepts it until its first token: queued in the
scheduler, or having its prompt computed. Both bounds count only those requests, in
number and in prompt tokens, so a long decode never blocks admission while a burst of
long prompts does. Past either bound a request is refused at once with QueueFullError,
which the HTTP layer answers with 429 and Retry-After, rather than queued without limit.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


class QueueFullError(Exception):
    """The waiting queue is at its bound; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class QueueLimits:
    max_waiting_requests: int | None = None  # None: no bound
    max_waiting_tokens: int | None = None  # prompt tokens of the waiting requests


class Admission:
    def __init__(self, limits: QueueLimits | None = None) -> None:
        self.limits = limits or QueueLimits()
        self.requests = 0
        self.tokens = 0
        self._lock = threading.Lock()  # typed BentoML routes and the OpenAI routes share it

    def admit(self, num_tokens: int) -> None:
        """Count a new waiting request, or raise QueueFullError."""
        lim = self.limits
        with self._lock:
            if lim.max_waiting_requests is not None and self.requests + 1 > lim.max_waiting_requests:
                why = f"{self.requests} requests are already waiting (the bound is {lim.max_waiting_requests})"
            elif (lim.max_waiting_tokens is not None and self.requests
                  and self.tokens + num_tokens > lim.max_waiting_tokens):
                # an idle queue takes any prompt max_model_len allows: the bound is on backlog
                why = (f"{self.tokens} prompt tokens are already waiting and this request adds {num_tokens} "
                       f"(the bound is {lim.max_waiting_tokens})")
            else:
                self.requests += 1
                self.tokens += num_tokens
                return
        raise QueueFullError(f"the server is at capacity: {why}; retry later", self.retry_after())

    def release(self, num_tokens: int) -> None:
        """The request got its first token, or ended before it."""
        with self._lock:
            self.requests -= 1
            self.tokens -= num_tokens

    def retry_after(self) -> float:
        """A rough wait: a second per 2,048 waiting prompt tokens, at least one."""
        return float(max(1, math.ceil(self.tokens / 2048)))
