"""Structured outputs on the engine: constraints hold through preemption, forks (n > 1)
and stop strings."""

from __future__ import annotations

import re

import pytest


pytestmark = pytest.mark.timeout(600)


def test_constraints_survive_preemption_forks_and_stop_strings(tiny_model_factory):
    """In the engine itself, on a tiny random model (whose free choices would never match):
    a pool too small for the batch forces preemption by recompute, n=3 forks each matcher,
    seeds make it reproducible, and a stop string may still end a constrained output."""
    from engine.llm import LLM
    from engine.models.decoder import kv_block_bytes
    from engine.models.loader import load_config, resolve
    from engine.sampling_params import SamplingParams, Constraint

    path = tiny_model_factory("structured-tiny")
    block = kv_block_bytes(load_config(resolve(str(path))), 8, __import__("torch").float32)
    llm = LLM(str(path), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
              kv_cache_memory_bytes=24 * block, block_size=8)
    pattern = r"(ab|cd)[0-9]{10,40}"
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=60,
                            structured=Constraint("regex", pattern))
    prompts = [[5 + i, 6, 7, 8] * 10 for i in range(8)]
    first = llm.generate(prompts, [params] * 8, use_tqdm=False)
    assert llm.stats().num_preemptions > 0
    texts = [c.text for o in first for c in o.outputs]
    assert len(texts) == 24 and all(re.fullmatch(pattern, t) for t in texts), texts
    again = llm.generate(prompts, [params] * 8, use_tqdm=False)
    assert [c.text for o in again for c in o.outputs] == texts  # seeded: the same, preempted or not
    digits = Constraint("regex", r"[0-9]{30}")
    free = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured=digits),
                        use_tqdm=False)[0].outputs[0].text
    stop = free[5]  # a digit it will produce: the stop string ends the constrained output there
    stopped = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=3, max_tokens=60, stop=[stop],
                                                        structured=digits), use_tqdm=False)[0].outputs[0]
    assert stopped.stop_reason == stop and stopped.text == free[: free.index(stop)]
