"""Seed-OSS: Llama's layer with its q/k/v bias (`attention_bias`) and its o_proj bias
(`attention_out_bias`) set apart."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class SeedOssForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=bool(config.attention_bias), o_bias=bool(getattr(config, "attention_out_bias", False)),
                        mlp_bias=bool(getattr(config, "mlp_bias", False)), windows=(0,) * config.num_hidden_layers)
