"""A request's time limits: its deadline (the preset's request_timeout, or the client's
shorter X-Request-Timeout), work cancelled when the client hangs up (which aborts its
engine requests, freeing their KV blocks at the next step), and a stream's deadline and
late errors sent as events after the headers."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request

from engine.serving.errors import APIError, bad_request, openai_error_event, to_api_error

DEADLINE_HEADER = "X-Request-Timeout"  # seconds; a client's own deadline for one request


class ClientGone(Exception):
    pass


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Any], timeout: float | None = None) -> Any:
    """Run work, cancelling it (and so aborting its requests) if the client hangs up first
    or the deadline passes."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task in done:
        return task.result()
    if gone in done:
        raise ClientGone
    raise deadline_exceeded(timeout)


def deadline_exceeded(timeout: float | None) -> APIError:
    within = f" ({timeout:.3g} s)" if timeout is not None else ""
    return APIError(408, f"the request did not finish within its deadline{within}; it was aborted",
                    "timeout_error", None, "deadline_exceeded")


def deadline(request: Request, default: float | None) -> float | None:
    """Seconds this request may take: the preset's request_timeout, or the client's
    X-Request-Timeout header when that is shorter."""
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return default
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not (math.isfinite(asked) and asked > 0):
        raise bad_request(f"the {DEADLINE_HEADER} header must be a positive number of seconds")
    return asked if default is None else min(asked, default)


async def sse_events(events: AsyncIterator[str], deadline: float | None = None,
                     error_event: Callable[[APIError], str] = openai_error_event) -> AsyncIterator[str]:
    """Errors after the headers went out travel as an error event in the route's own
    shape, as OpenAI, Anthropic and vLLM send them; so does a deadline that passes
    mid-stream (`deadline` is loop time)."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            left = None if deadline is None else deadline - loop.time()
            try:
                event = await asyncio.wait_for(events.__anext__(), left) if left is None or left > 0 else None
            except StopAsyncIteration:
                return
            except TimeoutError:
                event = None
            if event is None:
                await events.aclose()  # type: ignore[attr-defined] # its cleanup aborts the request
                raise deadline_exceeded(None)
            yield event
    except Exception as exc:  # noqa: BLE001
        yield error_event(to_api_error(exc))
