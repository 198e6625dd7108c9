"""Granite 3: Llama's layer with four multipliers, on the embeddings, on each residual
branch, on the attention scores (in place of 1 / sqrt(head_dim)) and, dividing, on the
logits. Granite SWA (`granite_swa`, the "swash" models) adds a window on the layers
`layer_types` mark sliding, a learned sink per head (its output scaled by
sigmoid(logsumexp - sink), which is a sink logit in the softmax, as gpt-oss's) and a rope
base per layer, 0 for none (`layer_rope_theta`, read by engine/models/layers/rotary.py)."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                        embed_scale=config.embedding_multiplier, residual_scale=config.residual_multiplier,
                        attn_scale=config.attention_multiplier, logit_divisor=config.logits_scaling,
                        windows=(0,) * config.num_hidden_layers)


class GraniteSwaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return dataclasses.replace(GraniteForCausalLM.spec(config), windows=layer_windows(config), sinks=True)
