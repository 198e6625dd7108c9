"""Arcee (AFM-4.5B): Llama's layer with a plain MLP, down(relu(up)²), and no gate."""

from __future__ import annotations

from engine.models.arch import ArchSpec, activation
from engine.models.decoder import DecoderForCausalLM


class ArceeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), gated=False,
                        act=activation(config, ("relu2", "silu", "gelu_tanh", "gelu")),
                        windows=(0,) * config.num_hidden_layers)
