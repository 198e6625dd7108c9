"""OLMo 2: norms after attention and MLP only (none before), and an RMSNorm over all query
heads together and all key heads together. That norm spans every head, so a tensor rank
holding some heads cannot compute it alone: OLMo 2 runs on one tensor rank. OLMo 3 is the
same layer with three sliding-window layers to every full one (`layer_types`, read here)
and rope parameters per layer type (read by the rotary tables)."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class Olmo2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm="all", norms="post", late_cast=True,
                        windows=layer_windows(config), tp_ok=False)
