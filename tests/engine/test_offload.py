"""What the HTTP worker tokenizes and detokenizes off its event loop: the work is sized by
everything it will render, so a short message carrying megabytes of tool-call arguments,
a thousand short prompts, or a long /detokenize never runs on the loop."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import ChatMessage, DetokenizeRequest


@pytest.fixture(scope="module")
def serving(tokenizer):
    info = SimpleNamespace(max_model_len=8192, vocab_size=len(tokenizer), sampling_defaults={})
    return OpenAIServing(SimpleNamespace(tokenizer=tokenizer, info=info), "m")


def sizes_of(serving: OpenAIServing, call) -> list[int]:
    seen: list[int] = []
    real = serving.offload.run

    async def run(size, fn, *args):
        seen.append(size)
        return await real(size, fn, *args)

    serving.offload.run = run
    try:
        asyncio.run(call())
    finally:
        serving.offload.run = real
    return seen


def test_tool_call_arguments_and_reasoning_count_toward_the_offload_size(serving):
    args = '{"x": "' + "y" * 100_000 + '"}'
    messages = [ChatMessage(role="user", content="hi"),
                ChatMessage.model_validate({"role": "assistant", "reasoning_content": "r" * 50_000, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]})]
    [size] = sizes_of(serving, lambda: serving.chat_prompt_async(messages))
    assert size > 150_000 >= serving.offload.threshold  # off the loop; the text alone is 2 characters


def test_many_short_prompts_leave_the_loop_together(serving):
    prompts = ["a short prompt"] * 5_000
    [size] = sizes_of(serving, lambda: serving.prompts_ids(prompts))
    assert size == 14 * 5_000 >= serving.offload.threshold


def test_detokenize_leaves_the_loop_when_long(serving):
    [size] = sizes_of(serving, lambda: serving.detokenize(DetokenizeRequest(tokens=[42] * 100_000)))
    assert size >= serving.offload.threshold


def test_tokenizing_runs_on_threads_of_its_own(serving):
    """Not asyncio's default pool, where a /stats call waiting on a busy core held a thread."""
    import threading

    name = asyncio.run(serving.offload.run(1 << 30, lambda: threading.current_thread().name))
    assert name.startswith("tokenize")
