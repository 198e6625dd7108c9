"""Qwen3: Qwen2 without the QKV biases, with an RMSNorm on every query and key head."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm="head", windows=layer_windows(config))
