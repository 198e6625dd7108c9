"""HunYuan dense (Hunyuan 0.5B-7B): Llama's layer with per-head q/k RMSNorms applied after
the rotary, not before it, and NTK rotary with a fixed alpha (engine/models/layers/rotary.py).
HunYuan MoE (Hunyuan-A13B): the same attention over experts on every layer, routed by an
fp32 router's renormalised softmax top-k, beside an ungated shared MLP of the experts' size."""

from __future__ import annotations

import dataclasses

from engine.errors import ParamError
from engine.models.arch import ArchSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM

# Its checkpoints' q/k norm names, in the model's terms.
NAMES = {".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm.",
         ".mlp.gate.wg.": ".mlp.gate.", ".mlp.shared_mlp.": ".mlp.shared_expert."}


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


def _one(config, key: str) -> int:
    """A count HunYuan MoE may give per layer: served where every layer has the same."""
    value = getattr(config, key)
    values = set(value) if isinstance(value, (list, tuple)) else {value}
    if len(values) != 1:
        raise ParamError("model", f"hunyuan_v1_moe with a different {key} per layer ({value!r}) is not supported")
    return int(values.pop())


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        inter = config.intermediate_size
        moe = moe_spec(config, _one(config, "num_experts"), _one(config, "moe_topk"), inter, norm_topk=True,
                       shared_inter=inter, weights_in_dtype=False, fp32_router=True, shared_gated=False)
        return dataclasses.replace(HunYuanDenseV1ForCausalLM.spec(config), moe=moe)
