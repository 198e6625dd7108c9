"""Admission control: a bounded wait instead of unbounded latency.

A request waits from the moment AsyncLLM accepts it until its first token: queued in the
scheduler, or having its prompt computed. Both bounds count only those requests, in
number and in prompt tokens, so a long decode never blocks admission while a burst of
long prompts does. Past either bound a request is refused at once with QueueFullError,
which the HTTP layer answers with 429 and Retry-After, rather than queued without limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


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


class Offload:
    """Tokenizer work off the event loop, bounded. A chat template over a multi-megabyte
    body takes long enough to stall every stream the loop serves, so large inputs are
    tokenized on threads, at most `workers` at once; past `max_waiting` waiting for one a
    request is refused with QueueFullError (429) rather than queued without limit. Small
    inputs stay on the loop, where they cost less than the hop to a thread."""

    def __init__(self, workers: int = 2, max_waiting: int = 32, threshold: int = 32 << 10) -> None:
        self.threshold = threshold  # characters of input from which the work leaves the loop
        self.max_waiting = max_waiting
        self.waiting = 0
        # Threads of its own: on asyncio's default pool it queued behind whatever else ran
        # there (a /stats call waiting on a busy core held one for up to its timeout).
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        if size < self.threshold:
            return fn(*args)
        if self.waiting >= self.max_waiting:
            raise QueueFullError(f"the server is at capacity: {self.waiting} large inputs are already waiting to "
                                 "be tokenized; retry later", 1.0)
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self.waiting -= 1
