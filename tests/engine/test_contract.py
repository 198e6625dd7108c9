"""The contract between the engine core and its clients (engine/messages.py), on a running
engine: a step's message does not grow with the answer, greedy output through both
drivers is transformers', and the core answers every command with typed events."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.client import wire
from engine.client.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.messages import (AbortRequest, Added, AddRequest, GetStats, StatsReply, Stop)
from engine.sampling_params import SamplingParams
from tests.support.prompts import make_prompts
from tests.support.oracle import hf_greedy


def test_a_step_message_does_not_grow_with_the_answer(tiny_model_factory):
    path = tiny_model_factory("contract-tiny", max_position_embeddings=1024)
    engine = LLMEngine(EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_model_len=1024,
                                           kv_cache_memory_bytes=128 * 8192))
    engine.add_request("long", list(range(10, 30)), SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True,
                                                                   logprobs=2))
    sizes = []
    while engine.has_unfinished():
        step = engine.step()
        if step.outputs:
            sizes.append(len(wire.encode(step)))
    assert len(sizes) == 600
    # Each carries one token, its text, its logprobs and the step's stats: the 500th costs
    # what the 1st did, give or take the width of a few integers and of one token's text.
    assert abs(sizes[499] - sizes[0]) < 48, (sizes[0], sizes[499])
    assert max(sizes) - min(sizes) < 96


@pytest.fixture(scope="module")
def oracle(hf_default, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """Six prompts and transformers' greedy continuations, computed once for both drivers."""
    prompts = make_prompts(tokenizer, 6, 40)
    with torch.no_grad():
        return prompts, hf_greedy(hf_default, prompts, 24, tokenizer.eos_token_id)


@pytest.mark.parametrize("driver", ["thread", "process"])
def test_greedy_through_both_drivers_is_transformers(driver, oracle):
    config = EngineConfig.create(dtype="float32", max_num_seqs=8, max_num_batched_tokens=96, max_model_len=256,
                                 kv_cache_memory_bytes=64 << 20)
    prompts, want = oracle
    llm = AsyncLLM.start(config) if driver == "process" else AsyncLLM(LLMEngine(config))
    params = SamplingParams(temperature=0.0, max_tokens=24)

    async def one(p: list[int]) -> list[int]:
        return [t async for out in llm.generate(p, params) for d in out.deltas for t in d.token_ids]

    async def every() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(asyncio.wait_for(every(), 300))
    finally:
        llm.shutdown()
    assert got == want


def test_engine_core_answers_every_command_with_typed_events(tiny_model_factory):
    """EngineCore.handle is what both drivers run: each command's answer, as an event."""
    from engine.core import EngineCore

    path = tiny_model_factory("contract-tiny", max_position_embeddings=1024)
    engine = LLMEngine(EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_model_len=64,
                                           kv_cache_memory_bytes=16 * 8192))
    events: list = []
    core = EngineCore(engine, events.append)
    assert core.handle(AddRequest("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)))
    assert core.handle(AddRequest("b", [5] * 60, SamplingParams(max_tokens=8)))  # past max_model_len
    assert events[0] == Added("a")
    refused = events[1]
    assert isinstance(refused, Added) and refused.error.param == "max_tokens" and refused.error.bad_input
    events.clear()
    events.append(engine.step())
    assert core.handle(AbortRequest("a")) and core.handle(GetStats())
    step, aborted, stats = events
    assert [d.token_ids for d in step.outputs[0].deltas] and not step.outputs[0].finished
    assert aborted.outputs[0].finished and aborted.outputs[0].finish_reasons == ["abort"]
    assert aborted.stats.blocks_free == 16  # the gauges after the abort freed its blocks
    assert isinstance(stats, StatsReply) and stats.stats.blocks_used == 0 and stats.stats.generation_tokens == 1
    assert not core.handle(Stop())
