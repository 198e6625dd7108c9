"""Granite 3: Llama's layer with four multipliers, on the embeddings, on each residual
branch, on the attention scores (in place of 1 / sqrt(head_dim)) and, dividing, on the
logits."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                        embed_scale=config.embedding_multiplier, residual_scale=config.residual_multiplier,
                        attn_scale=config.attention_multiplier, logit_divisor=config.logits_scaling,
                        windows=(0,) * config.num_hidden_layers)
