"""ERNIE 4.5 MoE (`ernie4_5_moe`, 21B-A3B, 300B-A47B): ERNIE 4.5's layer with experts on
the layers from moe_layer_start_index to moe_layer_end_index, every moe_layer_interval.
Its router keeps fp32, softmaxes, and chooses by the probabilities plus a correction bias
(`moe_statics`) while weighting by the probabilities alone, renormalised with the sum
clamped at moe_norm_min; shared experts are added ungated, with the dense MLP's biases.
Unlike the dense ERNIE 4.5, its LM head has a bias where use_bias is set.
Multi-token-prediction tensors (`mtp*`) are not used."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM
from engine.models.ernie4_5 import Ernie4_5ForCausalLM


class Ernie4_5_MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        n = config.num_hidden_layers
        start = int(getattr(config, "moe_layer_start_index", 1))
        end = int(getattr(config, "moe_layer_end_index", -1))
        end = n - 1 if end == -1 else end
        step = int(getattr(config, "moe_layer_interval", 1) or 1)
        inter = config.moe_intermediate_size
        dense = Ernie4_5ForCausalLM.spec(config)
        moe = moe_spec(config, config.moe_num_experts, config.moe_k, inter, norm_topk=True,
                       shared_inter=inter * int(getattr(config, "moe_num_shared_experts", 0) or 0),
                       layers=frozenset(i for i in range(n) if (i + 1) % step == 0 and start <= i <= end),
                       fp32_router=True, choice_bias=True, norm_min=float(getattr(config, "moe_norm_min", 1e-12)),
                       shared_gated=False, shared_bias=dense.mlp_bias)
        return dataclasses.replace(dense, moe=moe, head_bias=dense.mlp_bias)  # its head takes use_bias too

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        if ".mtp" in name or name.startswith("mtp"):
            return None
        # checkpoints keep the bias beside the router (`mlp.moe_statics`); transformers' own
        # module tree has it inside (`mlp.gate.moe_statics`)
        for old in (".mlp.moe_statics.e_score_correction_bias", ".mlp.gate.moe_statics.e_score_correction_bias"):
            name = name.replace(old, ".mlp.gate.choice_bias")
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
