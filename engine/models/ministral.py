"""Ministral: Mistral's layer with the window per layer (`layer_types`), so that local
and global layers can interleave. Ministral 3 (`ministral3`): Mistral's layer with Llama
4's attention temperature, the queries of positions past the original context scaled up
(`llama_4_scaling_beta` in its rope parameters), and the config's window on every layer."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class MinistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(windows=layer_windows(config))


class Ministral3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        params = getattr(config, "rope_parameters", None) or {}
        beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
        scale = (float(beta), int(original)) if beta is not None and original else None
        return ArchSpec(windows=layer_windows(config, all_layers=True), q_position_scale=scale)
