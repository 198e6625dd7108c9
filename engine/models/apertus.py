"""Apertus: Llama's layer with per-head q/k RMSNorms and a plain MLP, down(xielu(up)), whose
activation has parameters of its own in every layer (engine/models/layers/mlp.py)."""

from __future__ import annotations

from engine.models.arch import ArchSpec, activation
from engine.models.decoder import DecoderForCausalLM

# Its checkpoints' norm names, in the model's terms.
NAMES = {".attention_layernorm.": ".input_layernorm.", ".feedforward_layernorm.": ".post_attention_layernorm."}


class ApertusForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm="head",
                        gated=False, act=activation(config, ("xielu", "relu2", "gelu", "gelu_tanh", "silu")),
                        windows=(0,) * config.num_hidden_layers)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for theirs, ours in NAMES.items():
            name = name.replace(theirs, ours)
        return name
