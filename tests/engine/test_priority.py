"""vLLM's priority scheduling: lower values run first, preemption takes the least urgent."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.errors import ParamError
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)


def _engine(tiny_model_factory, **kw) -> LLMEngine:
    path = tiny_model_factory("priority-tiny")
    return LLMEngine(EngineConfig.create(model=str(path), device="cpu", dtype="float32",
                                         **{"max_model_len": 128, "kv_cache_memory_bytes": 64 * 8192, **kw}))


def _finish_order(engine: LLMEngine) -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step().outputs if o.finished]
    return order


def test_the_most_urgent_request_runs_first(tiny_model_factory):
    engine = _engine(tiny_model_factory, scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=64)
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, prio in [("late-a", 5), ("urgent", -1), ("late-b", 5), ("normal", 0)]:
        engine.add_request(rid, [7, 8, 9], p, priority=prio)
    assert _finish_order(engine) == ["urgent", "normal", "late-a", "late-b"]


def test_preemption_takes_the_least_urgent_sequence(tiny_model_factory):
    # 6 blocks of 16 tokens: two 40-token prompts growing to 80 tokens cannot both stay.
    engine = _engine(tiny_model_factory, scheduling_policy="priority", kv_cache_memory_bytes=6 * 8192,
                     max_num_batched_tokens=128, max_model_len=96)
    p = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request("background", [5] * 40, p, priority=9)
    engine.add_request("urgent", [6] * 40, p, priority=0)
    preempted: set[str] = set()
    while engine.has_unfinished():
        engine.step()
        preempted |= {s.request_id for s in engine.scheduler.waiting if s.num_preemptions}
    assert preempted == {"background"}


def test_fcfs_refuses_a_priority_by_name(tiny_model_factory):
    engine = _engine(tiny_model_factory)
    with pytest.raises(ParamError) as err:
        engine.add_request("x", [1, 2], SamplingParams(), priority=3)
    assert err.value.param == "priority"
