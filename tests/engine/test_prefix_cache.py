"""Automatic prefix caching and copy-on-write sharing give the same output with less KV."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_cache_manager import cdiv
from tests.support.prompts import make_prompts


def greedy_ids(llm: LLM, prompts, max_tokens: int = 12) -> list[list[int]]:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]


@pytest.fixture(scope="module")
def workload(tokenizer):
    """Hits, partial hits (a shared head, then divergence mid-block) and misses."""
    system = make_prompts(tokenizer, 1, 100)[0]  # a shared 100-token "system prompt"
    others = make_prompts(tokenizer, 12, 40)
    prompts = []
    for i, q in enumerate(others):
        if i % 3 == 0:
            prompts.append(system + q)  # full hit on the system prompt's blocks
        elif i % 3 == 1:
            prompts.append(system[: 20 + 7 * i] + q)  # partial hit, diverging inside a block
        else:
            prompts.append(q + system[:30])  # miss
    return prompts


def test_greedy_output_is_identical_with_caching_on_and_off(workload):
    kw = dict(dtype="float32", max_num_seqs=6, max_num_batched_tokens=128, max_model_len=256,
              kv_cache_memory_bytes=36 * 737280)  # 36 blocks: cached blocks get evicted
    off = LLM(None, enable_prefix_caching=False, **kw)
    on = LLM(None, enable_prefix_caching=True, **kw)
    want = greedy_ids(off, workload)
    # Twice through the cached engine: the second pass hits blocks left by the first.
    assert greedy_ids(on, workload) == want
    assert greedy_ids(on, workload[::-1]) == want[::-1]
    s = on.stats()
    assert s.prefix_cache_hit_tokens > 0
    assert s.prefix_cache_hit_tokens < s.prefix_cache_query_tokens
    assert s.blocks_free == s.blocks_total
    assert off.stats().prefix_cache_hit_tokens == 0
    # A tiny pool forces eviction of cached blocks between the two passes.
    assert on.engine.kv_manager.pool.num_evictions > 0
    assert s.prompt_tokens_computed < 2 * sum(len(p) for p in workload)
    on.reset_prefix_cache()
    assert on.stats().blocks_cached_free == 0
    assert greedy_ids(on, workload[:3]) == want[:3]


def test_cache_salt_keeps_tenants_apart(tokenizer):
    llm = LLM(None, dtype="float32", max_model_len=512, kv_cache_memory_bytes=100 * 737280)
    prompt = make_prompts(tokenizer, 1, 200)[0]
    eng = llm.engine
    p = SamplingParams(temperature=0.0, max_tokens=2)

    def run(rid: str, salt: str | None) -> int:
        eng.add_request(rid, prompt, p, cache_salt=salt)
        while eng.has_unfinished():
            eng.step()
        return eng.stats().prefix_cache_hit_tokens

    assert run("a", "tenant-a") == 0
    assert run("b", "tenant-b") == 0
    assert run("c", "tenant-a") == 192  # 12 full blocks; the last token is recomputed


def test_parallel_samples_share_the_prompt_blocks(tokenizer):
    llm = LLM(None, dtype="float32", max_model_len=1100, kv_cache_memory_bytes=400 * 737280)
    prompt = make_prompts(tokenizer, 1, 1000)[0]
    eng = llm.engine
    eng.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True))
    peak_used, peak_shared = 0, 0
    while eng.has_unfinished():
        eng.step()
        s = eng.stats()
        peak_used = max(peak_used, s.blocks_used)
        peak_shared = max(peak_shared, s.blocks_shared)
    unshared = 4 * cdiv(1000 + 40, 16)
    assert peak_used <= unshared / 3, (peak_used, unshared)
    assert peak_shared >= 1000 // 16
    s = eng.stats()
    assert s.blocks_free == s.blocks_total and s.blocks_shared == 0


def test_forked_samples_match_independent_requests(tokenizer):
    """Copy-on-write must keep forked samples apart: sample i of an n=3 request equals a
    lone request that uses sample i's seed, so no sample ever saw another's KV."""
    from engine.advance import _child_seed

    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=60 * 737280,
              enable_prefix_caching=False)
    prompt = make_prompts(tokenizer, 1, 37)[0]  # ends mid-block: the fork shares a partial block
    kw = dict(temperature=0.8, max_tokens=20, ignore_eos=True)
    shared = llm.generate([prompt], SamplingParams(n=3, seed=11, **kw), use_tqdm=False)[0]
    alone = llm.generate([prompt] * 3, [SamplingParams(seed=_child_seed(11, i), **kw) for i in range(3)],
                         use_tqdm=False)
    assert [c.token_ids for c in shared.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in shared.outputs}) == 3
