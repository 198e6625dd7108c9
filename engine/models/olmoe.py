"""OLMoE: Llama's pre-norm layer with RMSNorms over all query heads together and all key
heads together (as OLMo 2's, so one tensor rank), and experts on every layer: a softmax
router's top-k, renormalised only where norm_topk_prob says so."""

from __future__ import annotations

import dataclasses

from engine.errors import ParamError
from engine.models.arch import ArchSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM


class OlmoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        if getattr(config, "clip_qkv", None) is not None:
            raise ParamError("model", "an olmoe checkpoint with clip_qkv (q, k and v clamped) is not supported")
        bias = bool(getattr(config, "attention_bias", False))
        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                       norm_topk=bool(config.norm_topk_prob))
        return ArchSpec(qkv_bias=bias, o_bias=bias, qk_norm="all", moe=moe, windows=(0,) * config.num_hidden_layers,
                        tp_ok=False)


class FlexOlmoForCausalLM(DecoderForCausalLM):
    """FlexOlmo: OLMo 2's layer (norms after attention and MLP only, q/k norms over all
    heads) with OLMoE's experts on every layer."""

    @classmethod
    def spec(cls, config) -> ArchSpec:
        from engine.models.olmo2 import Olmo2ForCausalLM

        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                       norm_topk=bool(config.norm_topk_prob))
        return dataclasses.replace(Olmo2ForCausalLM.spec(config), moe=moe)
