"""Plumbing between AsyncLLM's per-request streams and the OpenAI responses.

A request is primed (its first output awaited) before a handler answers, so these
helpers take (first, rest) pairs; they gather deltas into per-choice totals, chain and
interleave streams, and count usage the way OpenAI does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from engine.client.async_llm import StreamOutput
from engine.messages import CompletionDelta, TokenLogprobs
from engine.serving.errors import bad_request
from engine.serving.openai.replies import PromptTokensDetails, UsageInfo

DONE = "data: [DONE]\n\n"
Started = tuple[StreamOutput, AsyncIterator[StreamOutput]]


def sse(model: Any) -> str:
    return f"data: {model.model_dump_json()}\n\n"


@dataclass
class Choice:
    """A choice's running totals while it streams or is collected."""

    parts: list[str] = field(default_factory=list)  # joined once at the end: += would copy it all
    length: int = 0  # characters so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def absorb(c: Choice, d: CompletionDelta) -> None:
    c.parts.append(d.text)
    c.length += len(d.text)
    if d.logprobs:
        c.logprobs.extend(d.logprobs)
    if d.finish_reason is not None:
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    if d.error is not None:  # the request's own constraints left nothing to sample: its error, not a reply
        raise bad_request(d.error, None, "no_token_allowed")


async def chain(first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> AsyncIterator[StreamOutput]:
    yield first
    if not first.finished:
        async for out in gen:
            yield out


async def collect(started: list[Started], choices: list[Choice],
                  base: int, n: int) -> StreamOutput:
    """Drain one primed request into choices[base:base+n]; return its last output, carrying
    the prompt logprobs that came with an earlier one."""
    [(first, gen)] = started
    out, prompt_lps = first, None
    try:
        async for out in chain(first, gen):
            prompt_lps = prompt_lps or out.prompt_logprobs
            for d in out.deltas:
                absorb(choices[base + d.index], d)
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
    return replace(out, prompt_logprobs=prompt_lps)


async def merge(started: list[Started]
                 ) -> AsyncIterator[tuple[int, StreamOutput]]:
    """Interleave several primed streams, tagging each item with its prompt's position."""
    if len(started) == 1:
        async for out in chain(*started[0]):
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, first: StreamOutput, gen: AsyncIterator[StreamOutput]) -> None:
        try:
            async for out in chain(first, gen):
                await q.put((i, out))
            await q.put((i, None))
        except Exception as exc:  # noqa: BLE001 - surfaced to the consumer below
            await q.put((i, exc))

    tasks = [asyncio.create_task(pump(i, f, g)) for i, (f, g) in enumerate(started)]
    try:
        live = len(tasks)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def usage(outs: list[StreamOutput]) -> UsageInfo:
    """From each request's latest output, whose counts are the core's. Each prompt counts
    once, however many samples it had."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(out.num_output_tokens for out in outs)
    cached = PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outs))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=cached)
