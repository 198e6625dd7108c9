"""Ministral: Mistral's layer with the window per layer (`layer_types`), so that local
and global layers can interleave."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class MinistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(windows=layer_windows(config))
