"""ERNIE 4.5 (dense): Llama's layer with one `use_bias` for every projection, and a rotary
that pairs adjacent dims (the loader reorders q and k to rotate-half's pairs)."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "use_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, rope_interleaved=True,
                        windows=(0,) * config.num_hidden_layers)
