"""The contract between the engine core and its clients (engine/messages.py): every
message type survives the codec, params cross without being checked again, a step's
message does not grow with the answer, and greedy output through both drivers is
transformers'."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.client import wire
from engine.client.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import ParamError
from engine.messages import (AbortRequest, Added, AddRequest, CompletionDelta, Died, ErrorInfo, GetStats, ModelInfo,
                             Ready, RequestDelta, RequestMetrics, StatsReply, StepOutput, Stop, Stopped,
                             TokenLogprobs)
from engine.sampling_params import SamplingParams, Constraint
from engine.stats import EngineStats, StepStats
from tests.conftest import make_prompts
from tests.test_exactness import hf_greedy

STATS = EngineStats(blocks_total=64, blocks_free=60, blocks_used=4, blocks_shared=1, blocks_cached_free=2,
                    kv_cache_usage=0.0625, kv_waste=0.1, kv_waste_mean=0.2, num_preemptions=3, num_running=2,
                    num_waiting=1, prefix_cache_query_tokens=100, prefix_cache_hit_tokens=32,
                    prompt_tokens_computed=68, generation_tokens=40)
PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=20, seed=2**63, max_tokens=None, stop=["\n\n"],
                        stop_token_ids=[7], logprobs=3, logit_bias={11: -100.0, 49151: 2.5}, allowed_token_ids=[1, 2],
                        structured=Constraint("regex", "[a-z]+"), prompt_logprobs=1, bad_words=["no"])
LPS = [TokenLogprobs(5, -0.25, 1, [(5, -0.25), (9, -1.5)]), TokenLogprobs(9, -2.0, 3, [])]
DELTA = RequestDelta("req-1", 12, [CompletionDelta(0, "héllo ✓", [5, 9], LPS, "stop", "\n\n", None),
                                   CompletionDelta(1, "", [], None, "abort", None, "no token is left")],
                     True, 2, 4, RequestMetrics(1.5, 1.75, 2.0, 3.25), [None, *LPS], ["stop", "abort"])

COMMANDS = [AddRequest("req-1", [1, 2, 3], PARAMS, "salt", -2), AddRequest("r", [0], SamplingParams()),
            AbortRequest("req-1"), GetStats(), Stop()]
EVENTS = [Ready(ModelInfo("SmolLM2", "HuggingFaceTB/SmolLM2-135M-Instruct", 2048, 49152, {"temperature": 0.2},
                          STATS)),
          Added("req-1"), Added("req-2", ErrorInfo("max_tokens is too large", "max_tokens")),
          StepOutput([DELTA, RequestDelta("r", 1, [], False)], StepStats(generation_tokens=2, num_running=1,
                                                                            kv_cache_usage=0.5)),
          StatsReply(STATS), Stopped(), Died("WorkerDiedError: engine-rank1 exited")]


@pytest.mark.unit
@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_every_command_survives_the_codec(cmd):
    assert wire.decode_command(wire.encode(cmd)) == cmd


@pytest.mark.unit
@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_survives_the_codec(event):
    assert wire.decode_event(wire.encode(event)) == event


@pytest.mark.unit
def test_params_cross_as_validated_and_are_not_checked_again(monkeypatch):
    data = wire.encode(COMMANDS[0])

    def checked_again(self):
        raise AssertionError("SamplingParams validated a second time in the engine process")

    monkeypatch.setattr(SamplingParams, "__post_init__", checked_again)
    got = wire.decode_command(data)
    assert got.params == PARAMS and isinstance(got.params.structured, Constraint)


@pytest.mark.unit
def test_errors_cross_with_their_field():
    err = wire.decode_event(wire.encode(Added("r", ErrorInfo.of(ParamError("n", "n (9) exceeds max_num_seqs")))))
    exc = err.error.exception()
    assert isinstance(exc, ParamError) and exc.param == "n" and "max_num_seqs" in str(exc)
    engine_fault = wire.decode_event(wire.encode(Added("r", ErrorInfo.of(RuntimeError("grammar cache")))))
    assert type(engine_fault.error.exception()) is RuntimeError


@pytest.mark.engine
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


@pytest.mark.engine
@pytest.mark.parametrize("driver", ["thread", "process"])
def test_greedy_through_both_drivers_is_transformers(driver, hf_default, tokenizer):
    config = EngineConfig.create(dtype="float32", max_num_seqs=8, max_num_batched_tokens=96, max_model_len=256,
                                 kv_cache_memory_bytes=64 << 20)
    prompts = make_prompts(tokenizer, 6, 40)
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
    with torch.no_grad():
        want = hf_greedy(hf_default, prompts, 24, tokenizer.eos_token_id)
    assert got == want


@pytest.mark.engine
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
