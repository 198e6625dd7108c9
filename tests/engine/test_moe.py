"""Mixture-of-experts checkpoints: a missing expert refused by name, and experts computed
on int8 weights equal to transformers on the same rounded values. Greedy equality with
transformers for Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss is in
tests/engine/test_architectures.py, with the other architectures; GGUF experts (merged
per layer, dense and on the file's blocks) in tests/engine/test_gguf_architectures.py."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.errors import ParamError
from engine.models import quantize
from kernels import quant
from tests.support import arch_models
from tests.support.oracle import engine_greedy, hf_greedy


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path, default_model_dir):
    path = arch_models.build("qwen3_moe", tmp_path / "m", default_model_dir)
    with LLM(str(path), dtype="float32", max_model_len=64) as llm:  # its expert layers count tokens on the host
        assert not llm.engine.executor.runner.model.graph_safe
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "layers.0.mlp.experts_gate_up" in str(e.value)


def test_int8_experts_compute_on_their_int8_values(tmp_path, default_model_dir):
    """Under quantization int8 every routed expert, the shared expert and every other GEMM
    run on int8 rows, the routers stay dense: greedy output equals transformers' on a
    checkpoint holding exactly those rounded values."""
    path = arch_models.build("qwen2_moe", tmp_path / "m", default_model_dir)
    rounded = tmp_path / "rounded"
    shutil.copytree(path, rounded)
    weights = load_file(path / "model.safetensors")
    for name, w in weights.items():
        if w.dim() == 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            weights[name] = quant.dequantize(*quant.quantize_int8(w), quant.INT8_ROWS, w.shape[1])
    save_file(weights, rounded / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(rounded, dtype=torch.float32).eval()
    prompts = torch.randint(3, 49152, (4, 24), generator=torch.Generator().manual_seed(3)).tolist()
    with LLM(str(path), dtype="float32", max_model_len=64, block_size=8, quantization="int8") as llm:
        moe = llm.engine.executor.runner.model.layers[0].mlp
        assert all(isinstance(m, quantize.QuantLinear) for pair in moe.expert_modules for m in pair)
        assert engine_greedy(llm, prompts, 12, ignore_eos=True) == hf_greedy(hf, prompts, 12, None)


def test_a_lone_sequence_decodes_as_transformers(tmp_path, default_model_dir):
    """Every decode step of a lone sequence takes the one-token expert path (no sort,
    gather or scatter), here gpt-oss's, with expert biases and the clamped SwiGLU, inside
    the native fused layer (sinks, fp32 norm weights): greedy output equal to
    transformers', and the path's output the batched path's bits."""
    path = arch_models.build("gpt_oss", tmp_path / "m", default_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(3, 49152, (1, 30), generator=torch.Generator().manual_seed(5)).tolist()
    with LLM(str(path), dtype="float32", max_model_len=64, block_size=8) as llm:
        assert llm.engine.executor.runner.model.fused
        assert engine_greedy(llm, prompt, 12, ignore_eos=True) == hf_greedy(hf, prompt, 12, None)
        moe = llm.engine.executor.runner.model.layers[0].mlp
        x = torch.randn(1, hf.config.hidden_size, generator=torch.Generator().manual_seed(6))
        experts, weights = moe.route(x)
        assert torch.equal(moe._one_token(x, experts[0].tolist(), weights[0]), moe._grouped(x, experts, weights))
