"""Greedy fp32 output matches transformers token for token, under chunked prefill and preemption."""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.models.decoder import kv_block_bytes
from tests.support.oracle import engine_greedy, hf_greedy
from tests.support.prompts import make_prompts


def test_embedded_model_matches_transformers(default_model_dir, hf_default, tokenizer):
    prompts = make_prompts(tokenizer, 16, 64)
    max_new = 32
    # 20 blocks of 16 tokens cannot hold 16 sequences of 96 tokens: preemption is forced,
    # and a 96-token budget chunks every 64-token prompt that shares a step with others.
    llm = LLM(
        None, dtype="float32", max_num_seqs=16, max_num_batched_tokens=96, max_model_len=256,
        kv_cache_memory_bytes=20 * kv_block_bytes(hf_default.config, 16, torch.float32),
    )
    assert llm.stats().blocks_total == 20
    got = engine_greedy(llm, prompts, max_new)
    want = hf_greedy(hf_default, prompts, max_new, tokenizer.eos_token_id)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    assert stats.blocks_free == stats.blocks_total
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i} diverged at token {next(j for j, (a, b) in enumerate(zip(g + [-1], w + [-2])) if a != b)}"


TINY = {
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "mha_linear_rope": dict(num_attention_heads=4, num_key_value_heads=4,
                            rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "gqa4_untied_llama3_rope": dict(
        num_attention_heads=8, num_key_value_heads=2, hidden_size=128, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_random_models_match_transformers(name, tiny_model_factory):
    path = tiny_model_factory(name, **TINY[name])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # stable across processes
    prompts = torch.randint(3, 49152, (16, 40), generator=gen).tolist()
    # 24 blocks of 8 tokens for 16 sequences of 64 tokens: preemption is forced.
    block_bytes = kv_block_bytes(hf.config, 8, torch.float32)
    llm = LLM(str(path), dtype="float32", max_num_seqs=16, max_num_batched_tokens=64,
              max_model_len=128, kv_cache_memory_bytes=24 * block_bytes, block_size=8)
    got = engine_greedy(llm, prompts, 24, ignore_eos=True)
    want = hf_greedy(hf, prompts, 24, None)
    assert got == want
    assert llm.stats().num_preemptions > 0
