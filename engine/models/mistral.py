"""Mistral: Llama's layer with a sliding window on every layer (v0.1's 4,096 tokens)."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(windows=layer_windows(config, all_layers=True))
