"""Phi-3, 3.5 and Phi-4-mini: Llama's layer with fused qkv_proj and gate_up_proj
tensors in the checkpoint (the loader splits them), LongRoPE, partial rotary on Phi-4-mini,
and a sliding window on every layer where the config sets one."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(windows=layer_windows(config, all_layers=True))
