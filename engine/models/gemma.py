"""Gemma (1, 1.1, CodeGemma): pre-norm layers with (1 + w) norms, embeddings scaled by
sqrt(hidden), GELU-tanh-gated MLPs; Gemma 2's layer before its post norms, windows and
soft-caps."""

from __future__ import annotations

from engine.models.arch import ArchSpec, activation
from engine.models.decoder import DecoderForCausalLM


class GemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        # transformers reads the legacy "gelu" of the first releases as the tanh form they meant
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, norm_offset=1.0, late_cast=True,
                        act=activation(config, ("gelu_tanh",)), embed_scale=config.hidden_size**0.5,
                        embed_scale_in_dtype=True, windows=(0,) * config.num_hidden_layers)
