"""How a finished choice reads in Anthropic's terms: its stop reason and its usage. The
whole answer and the stream end on the same rule."""

from __future__ import annotations

from engine.client.async_llm import StreamOutput
from engine.serving.anthropic.protocol import Usage
from engine.serving.openai.streams import Choice, usage


def stop_reason(choice: Choice, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a call ends the turn as tool_use; a matched stop
    string is named (the engine reports it as the choice's stop_reason)."""
    if called and choice.finish_reason == "stop":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def usage_of(out: StreamOutput, output_tokens: int | None = None) -> Usage:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens: the two
    add up to the prompt. `output_tokens` defaults to the core's count so far."""
    u = usage([out])
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return Usage(input_tokens=u.prompt_tokens - cached,
                 output_tokens=u.completion_tokens if output_tokens is None else output_tokens,
                 cache_read_input_tokens=cached)
