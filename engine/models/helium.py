"""Helium (Kyutai): Llama's layer with RMSNorms that multiply in fp32 before rounding,
rotary on adjacent pairs of dims (the loader reorders q and k to rotate-half's pairs), and
q/k/v biases where the config sets them (o_proj has none)."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class HeliumForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)),
                        mlp_bias=bool(getattr(config, "mlp_bias", False)), late_cast=True, rope_interleaved=True,
                        windows=(0,) * config.num_hidden_layers)
