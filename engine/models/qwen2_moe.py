"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention with its q/k/v biases, routed experts
beside a shared expert that every token passes through, scaled by a sigmoid gate."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows, moe_spec
from engine.models.decoder import DecoderForCausalLM


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       norm_topk=bool(config.norm_topk_prob), shared_inter=config.shared_expert_intermediate_size)
        return ArchSpec(qkv_bias=bool(getattr(config, "qkv_bias", True)), windows=layer_windows(config), moe=moe)
