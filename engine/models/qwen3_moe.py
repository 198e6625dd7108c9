"""Qwen3-MoE: Qwen3's attention (q/k norms per head), experts on the layers that
`decoder_sparse_step` and `mlp_only_layers` pick, top-k renormalised if norm_topk_prob."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       norm_topk=bool(config.norm_topk_prob))
        return dataclasses.replace(Qwen3ForCausalLM.spec(config), moe=moe)
