"""A Message as Anthropic streams it: message_start, a ping, then each content block opened,
its deltas and closed (text_delta, input_json_delta, thinking_delta), then message_delta
with the stop reason and usage, and message_stop. Every SSE item names its event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from engine.client.async_llm import StreamOutput
from engine.serving.anthropic.outcome import stop_reason, usage_of
from engine.serving.anthropic.protocol import MessagesResponse, OutText, OutThinking, OutToolUse
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import Tool
from engine.serving.openai.streams import Choice, absorb, chain


def event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The content blocks as they open and close: one is open at a time, as Anthropic
    streams them, and each has the index the client assembles it under."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # "text", "thinking" or "tool_use"

    def start(self, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.open = block["type"]
        events.append(event("content_block_start", index=self.count, content_block=block))
        return events

    def delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.count, delta=delta)

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # the SDK expects a signature before a thinking block closes
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        events.append(event("content_block_stop", index=self.count))
        self.open = None
        self.count += 1
        return events


async def stream_message(serving: OpenAIServing, first: StreamOutput, gen: AsyncIterator[StreamOutput],
                         tools: list[Tool], thinking: bool) -> AsyncIterator[str]:
    start = MessagesResponse(model=serving.model_name, usage=usage_of(first, 0))
    splitter = serving.splitter(tools, stream=True)
    blocks = _Blocks()
    choice = Choice()
    called = False
    try:
        yield event("message_start", message=start.model_dump(mode="json"))
        yield event("ping")
        last = first
        async for last in chain(first, gen):
            for d in last.deltas:
                absorb(choice, d)
                reasoning, text, calls = splitter.feed(d.text, final=d.finish_reason is not None)
                if reasoning and thinking:
                    if blocks.open != "thinking":
                        for e in blocks.start(OutThinking(thinking="").model_dump()):
                            yield e
                    yield blocks.delta({"type": "thinking_delta", "thinking": reasoning})
                if text:
                    if blocks.open != "text":
                        for e in blocks.start(OutText(text="").model_dump()):
                            yield e
                    yield blocks.delta({"type": "text_delta", "text": text})
                for c in calls:  # a call opens its block, streams its arguments' JSON text, closes
                    if c.id is not None:
                        called = True
                        for e in blocks.start(OutToolUse(id=c.id, name=c.name or "", input={}).model_dump()):
                            yield e
                    if c.arguments:
                        yield blocks.delta({"type": "input_json_delta", "partial_json": c.arguments})
                    if c.done:
                        for e in blocks.stop():
                            yield e
        if blocks.count == 0 and blocks.open is None:  # an empty answer is still one text block
            for e in blocks.start(OutText(text="").model_dump()):
                yield e
        for e in blocks.stop():
            yield e
        reason, sequence = stop_reason(choice, called)
        u = usage_of(last)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage=u.model_dump())
        yield event("message_stop")
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
