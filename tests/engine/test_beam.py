"""Beam search in the engine: equal to transformers' beam search, on shared blocks, and
robust to aborts and preemption."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, BeamSearchParams, SamplingParams
from engine.models.decoder import kv_block_bytes
from scripts.beam_bench import peak_blocks
from scripts.beam_oracle import DATA, hf_beams
from tests.support.prompts import make_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", max_model_len=1024)


def beams(llm: LLM, prompts, width: int, max_tokens: int, **kw) -> list[list[list[int]]]:
    outs = llm.beam_search(prompts, BeamSearchParams(width, max_tokens, **kw))
    return [[s.output_token_ids for s in o.sequences] for o in outs]


def test_beams_equal_transformers_on_chat_prompts(llm, hf_default):
    """tests/data/beam_transformers.json holds transformers' beams on 24 chat prompts
    (scripts/beam_oracle.py --write, which compares all four settings on all 24); the suite
    checks the two settings that span both widths and both penalties on half the prompts,
    and recomputes one prompt with transformers itself, so the file cannot drift from the
    oracle."""
    data = json.loads(DATA.read_text())
    prompts, eos = data["prompts"], data["eos"]
    assert len(prompts) == 24 and eos == llm.engine.eos_token_ids
    checked = [s for s in data["settings"] if (s["beam_width"], s["length_penalty"]) in ((2, 1.0), (4, 0.6))]
    assert len(checked) == 2
    half = slice(0, 24, 2)
    for setting in checked:
        width, lp = setting["beam_width"], setting["length_penalty"]
        got = beams(llm, prompts[half], width, data["max_new_tokens"], length_penalty=lp, early_stopping=True)
        want = setting["beams"][half]
        best = sum(g[0] == w[0] for g, w in zip(got, want))
        same = sum(sorted(map(tuple, g)) == sorted(map(tuple, w)) for g, w in zip(got, want))
        assert best >= 11 and same >= 10, (width, lp, best, same)
    setting, i = checked[1], 0  # its search ends soonest: 1.6 s of transformers against 5.4 for prompt 17
    live, _ = hf_beams(hf_default, prompts[i], setting["beam_width"], setting["length_penalty"], eos,
                       data["max_new_tokens"])
    assert live == setting["beams"][i]


def test_beams_share_blocks_and_usage_counts_what_was_computed(tokenizer):
    """W=4 on a 400-token prompt holds far fewer blocks than 4 copies of the sequence: the
    prompt is shared, and a beam's blocks go back as soon as it is dropped."""
    prompt = make_prompts(tokenizer, 1, 400)[0]
    llm = LLM(None, dtype="float32", max_model_len=1024, enable_prefix_caching=False)
    engine = llm.engine
    single, _ = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    beam, computed = peak_blocks(llm, prompt, SamplingParams(n=4, temperature=0, max_tokens=48, ignore_eos=True,
                                                             use_beam_search=True))
    assert single == 28  # ceil(448 / 16)
    assert beam < 1.3 * single, (beam, single)
    # one row for the prompt's last position, then 4 beams for each of 47 more tokens
    assert computed == 1 + 4 * 47
    assert engine.kv_manager.pool.num_free == engine.kv_manager.pool.num_blocks


def test_abort_mid_search_and_forced_preemption(tokenizer):
    prompts = make_prompts(tokenizer, 6, 48)
    params = BeamSearchParams(4, 24, length_penalty=0.6, early_stopping=True)
    roomy = LLM(None, dtype="float32", max_model_len=256)
    want = [[s.output_token_ids for s in o.sequences] for o in roomy.beam_search(prompts, params)]

    engine = roomy.engine
    engine.add_request("a", prompts[0], params.sampling_params())
    for _ in range(6):
        engine.step()
    assert engine.kv_manager.pool.num_free < engine.kv_manager.pool.num_blocks
    final = engine.abort("a")
    assert final.finished and final.finish_reasons == ["abort"] * 4
    assert engine.kv_manager.pool.num_free == engine.kv_manager.pool.num_blocks and not engine.has_unfinished()

    # 24 blocks cannot hold 6 searches of 4 beams over 72 tokens: beams are preempted (with
    # their siblings) and recomputed, and every search ends with the same beams.
    tight = LLM(None, dtype="float32", max_model_len=256, max_num_batched_tokens=64,
                kv_cache_memory_bytes=24 * kv_block_bytes(roomy.engine.hf_config, 16, torch.float32))
    got = [[s.output_token_ids for s in o.sequences] for o in tight.beam_search(prompts, params)]
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.blocks_free == stats.blocks_total
    assert got == want


@pytest.mark.parametrize("length_penalty", [1e4, -1e4, 1e300])
def test_an_extreme_length_penalty_ends_its_search_and_the_engine_goes_on(llm, tokenizer, length_penalty):
    """A finite but extreme length_penalty makes length ** length_penalty overflow or vanish:
    Python's power raised OverflowError inside the engine loop, which died with it (found by
    the served API's schema fuzzing). The search now ends with its beams, nothing leaks, and
    the next request is served as before."""
    prompt = make_prompts(tokenizer, 1, 24)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    out = llm.beam_search(prompt, BeamSearchParams(2, 6, length_penalty=length_penalty))[0]
    assert len(out.sequences) == 2 and all(s.output_token_ids for s in out.sequences)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == before
    stats = llm.stats()
    assert stats.blocks_free == stats.blocks_total
