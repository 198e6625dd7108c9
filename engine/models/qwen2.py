"""Qwen2 and Qwen2.5: biases on q, k and v (not on o), and a sliding window on the
layers from max_window_layers up where use_sliding_window is set."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=True, windows=layer_windows(config))
