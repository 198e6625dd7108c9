"""A model whose every layer is windowed (Mistral v0.1) keeps at most its window's KV
blocks per sequence: the rest go back to the pool as the sequence moves on; a hybrid
model's local layers do the same through their own block tables. Prefix caching, forks
(beam search), speculative decoding and preemption stay exact."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, BeamSearchParams, SamplingParams
from engine.models.decoder import kv_block_bytes
from scripts.beam_bench import peak_blocks
from scripts.beam_oracle import hf_beams
from tests.support import arch_models
from tests.support.oracle import engine_greedy, hf_greedy


WINDOW, BS, BUDGET = arch_models.WINDOW, 8, 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, default_model_dir):
    path = arch_models.build("mistral", tmp_path_factory.mktemp("mistral"), default_model_dir)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def prompts(n: int, length: int, seed: int = 7) -> list[list[int]]:
    return torch.randint(3, 49152, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def windowed_llm(path, blocks: int, **kw) -> LLM:
    hf_config = AutoModelForCausalLM.from_pretrained(path).config
    return LLM(str(path), dtype="float32", block_size=BS, max_num_batched_tokens=BUDGET, max_num_seqs=BUDGET,
               max_model_len=256,
               kv_cache_memory_bytes=blocks * kv_block_bytes(hf_config, BS, torch.float32), **kw)


def test_a_sequence_holds_at_most_its_window_however_long_it_grows(mistral):
    path, hf = mistral
    # Eight blocks (64 slots) for a 30-token prompt and 150 new tokens: 23 blocks without the window.
    llm = windowed_llm(path, 8)
    assert llm.engine.kv_manager.window == WINDOW
    prompt = prompts(1, 30)[0]
    most, _ = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    # the window's keys, one step's new tokens, and a partial block at each end
    assert most <= -(-(WINDOW + BUDGET) // BS) + 1
    got = engine_greedy(llm, [prompt], 150, ignore_eos=True)
    assert got == hf_greedy(hf, [prompt], 150, None)
    stats = llm.stats()
    assert stats.blocks_free == stats.blocks_total


def test_prefix_hits_preemption_and_ngram_speculation_stay_exact(mistral):
    path, hf = mistral
    shared = prompts(1, 40, seed=3)[0]
    # common prefixes of 35 to 40 tokens, each with its own tail, all 52 long
    batch = [shared[:40 - i] + p[:12 + i] for i, p in enumerate(prompts(6, 18))]
    want = hf_greedy(hf, batch, 40, None)
    # 10 blocks for 6 sequences that each hold 3 to 5: preemption; prefix caching is on.
    llm = windowed_llm(path, 10)
    assert engine_greedy(llm, batch, 40, ignore_eos=True) == want
    assert engine_greedy(llm, batch[:1], 40, ignore_eos=True) == want[:1]  # its first blocks may be cached
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.blocks_free == stats.blocks_total
    spec = windowed_llm(path, 32, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_min": 1})
    assert engine_greedy(spec, batch, 40, ignore_eos=True) == want


def test_beam_search_over_a_window_equals_transformers(mistral):
    """Beams fork their parent's table, dropped entries included, and copy a shared partial block on write."""
    path, hf = mistral
    llm = windowed_llm(path, 48)
    for prompt in prompts(2, 20, seed=11):
        want, _ = hf_beams(hf, prompt, 2, 1.0, [2], 24)
        out = llm.beam_search([prompt], BeamSearchParams(2, 24, length_penalty=1.0, early_stopping=True))[0]
        assert [s.output_token_ids for s in out.sequences] == want


def test_a_hybrid_models_local_layers_stop_growing_at_the_window(tmp_path, default_model_dir):
    """Gemma 2 (local, global, local layers): the local layers' block tables give back what
    lies before the window while the global one keeps the whole sequence; the tokens are
    transformers'."""
    path = arch_models.build("gemma2", tmp_path / "gemma2", default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = windowed_llm(path, 64)
    groups = llm.engine.resolved.kv_groups
    assert groups.windows == (None, WINDOW, WINDOW) and groups.layers_per_block == 1
    prompt = prompts(1, 30, seed=5)[0]
    most, _ = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
    local = -(-(WINDOW + BUDGET) // BS) + 1
    assert most <= -(-180 // BS) + 2 * local  # 23 global blocks and at most 4 per local layer; 69 without
    assert engine_greedy(llm, [prompt], 150, ignore_eos=True) == hf_greedy(hf, [prompt], 150, None)
