"""Mixture-of-experts checkpoints refused by name: a missing expert, or quantization the
expert layer does not take. Greedy equality with transformers for Mixtral, Qwen2-MoE and
Qwen3-MoE is in tests/engine/test_architectures.py, with the other architectures."""

from __future__ import annotations

import pytest

from engine.errors import ParamError


def test_a_checkpoint_missing_an_expert_or_asking_for_quantization_is_refused(tmp_path, default_model_dir):
    from safetensors.torch import load_file, save_file

    from engine import LLM
    from tests.support import arch_models

    path = arch_models.build("qwen3_moe", tmp_path / "m", default_model_dir)
    with LLM(str(path), dtype="float32", max_model_len=64) as llm:  # its expert layers count tokens on the host
        assert not llm.engine.executor.runner.model.graph_safe
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64, quantization="int8")
    assert e.value.param == "quantization" and "qwen3_moe" in str(e.value)
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(weights, path / "model.safetensors")
    with pytest.raises(ParamError) as e:
        LLM(str(path), dtype="float32", max_model_len=64)
    assert e.value.param == "model" and "layers.0.mlp.experts_gate_up" in str(e.value)
