"""HunYuan dense (Hunyuan 0.5B-7B): Llama's layer with per-head q/k RMSNorms applied after
the rotary, not before it, and NTK rotary with a fixed alpha (engine/models/layers/rotary.py)."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM

# Its checkpoints' q/k norm names, in the model's terms.
NAMES = {".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm."}


class HunYuanDenseV1ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm="rotated", windows=(0,) * config.num_hidden_layers)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for theirs, ours in NAMES.items():
            name = name.replace(theirs, ours)
        return name
