"""Rope scaling read back from what llama.cpp's converter writes: Llama 3's as a tensor of
per-frequency divisors, linear and YaRN as keys. A Llama 3.1 or 3.2 GGUF read without it
turns its low frequencies up to 32 times too fast at every position."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.errors import ParamError
from engine.models import gguf_config
from tests.support.gguf_files import llama3_divisors


def inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    config = LlamaConfig(hidden_size=head_dim * 8, num_attention_heads=8, head_dim=head_dim, rope_parameters=rope)
    return ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")[0]


# Llama 3.1 8B, Llama 3.2 1B and 3B, and one with cuts of its own.
REAL = [(128, 500000.0, 8.0, 8192), (64, 500000.0, 32.0, 8192), (128, 500000.0, 32.0, 8192),
        (128, 10000.0, 4.0, 2048)]


@pytest.mark.parametrize("head_dim, theta, factor, original", REAL)
def test_llama3_parameters_from_the_divisors_give_transformers_frequencies(head_dim, theta, factor, original):
    rope = dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=original)
    divisors = llama3_divisors(rope, head_dim).numpy().astype(np.float64)
    found = gguf_config._llama3(divisors, theta, head_dim)
    assert found["rope_type"] == "llama3" and found["factor"] == factor
    assert found["original_max_position_embeddings"] == original and found["high_freq_factor"] == 4.0
    torch.testing.assert_close(inv_freq(head_dim, {**found, "rope_theta": theta}), inv_freq(head_dim, rope),
                               rtol=1e-6, atol=0)


def test_divisors_that_are_not_llama3s_are_refused():
    divisors = llama3_divisors(dict(rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192), 128).numpy().astype(np.float64)
    bent = divisors.copy()
    bent[-1] *= 1.5  # the lowest frequency divided by more than the factor the others give
    with pytest.raises(ParamError, match="rope_freqs.weight is not Llama 3's"):
        gguf_config._llama3(bent, 500000.0, 128)
    with pytest.raises(ParamError, match="rope_freqs.weight has 32 factors; head_dim 128 has 64"):
        gguf_config._llama3(divisors[:32], 500000.0, 128)


def scaled(keys: dict, tensors: dict | None = None, rope: dict | None = None) -> dict:
    config = SimpleNamespace(rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
                             hidden_size=64, num_attention_heads=4)
    gguf_config._rope_scaling(config, "qwen2", lambda key, default=None: keys.get(key, default), tensors or {})
    return config.rope_parameters


def test_linear_and_yarn_keys_become_the_configs_rope_parameters():
    assert scaled({"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}) == dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0)
    assert scaled({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                   "rope.scaling.original_context_length": 32768}) == dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32768)
    assert scaled({"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0, "rope.scaling.original_context_length": 64,
                   "rope.scaling.yarn_beta_fast": 16.0, "rope.scaling.yarn_attn_factor": 1.5})["beta_fast"] == 16.0
    assert scaled({"rope.scaling.type": "none"}) == dict(rope_type="default", rope_theta=10000.0)
    # Gemma 3: the global layers' set only
    nested = scaled({"rope.scaling.type": "linear", "rope.scaling.factor": 8.0},
                    rope={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert nested == {"full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


def test_a_rope_scaling_the_engine_cannot_express_is_refused_by_name():
    with pytest.raises(ParamError, match="qwen2 GGUF: rope scaling 'longrope' is not supported"):
        scaled({"rope.scaling.type": "longrope"})
    divisors = SimpleNamespace(data=np.ones(8, dtype=np.float32))
    with pytest.raises(ParamError, match="both rope scaling 'linear' and rope_freqs.weight"):
        scaled({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, {"rope_freqs.weight": divisors})
