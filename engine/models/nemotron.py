"""Nemotron (Nemotron-Mini, Minitron): torch's LayerNorm with its bias and a (1 + w)
weight, a plain ReLU² MLP (no gate), and rotary on part of each head."""

from __future__ import annotations

from engine.models.arch import ArchSpec, activation
from engine.models.decoder import DecoderForCausalLM


class NemotronForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), gated=False,
                        act=activation(config, ("relu2",)), norm_kind="layer_bias", norm_offset=1.0,
                        windows=(0,) * config.num_hidden_layers)
