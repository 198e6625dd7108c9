"""Granite 3 MoE: Granite's layer (its four multipliers) with a mixture of experts for
every MLP, routed by the top-k router logits softmaxed among themselves (in fp32);
GraniteMoeShared adds an ungated shared expert (`shared_intermediate_size`, 0 for none)
and GraniteMoeSWA Granite SWA's attention to that.
Checkpoints keep each layer's experts stacked, under `input_linear` (gate rows, then up)
and `output_linear`, and the router under `router.layer` (transformers 5 saves them so
too)."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM
from engine.models.granite import GraniteForCausalLM, GraniteSwaForCausalLM

_RENAMES = (("block_sparse_moe.input_linear.weight", "mlp.experts.gate_up_proj"),
            ("block_sparse_moe.output_linear.weight", "mlp.experts.down_proj"),
            ("block_sparse_moe.router.layer.weight", "mlp.gate.weight"),
            # transformers 5's own names, as GraniteMoeSWA checkpoints save them
            ("block_sparse_moe.experts.", "mlp.experts."), ("block_sparse_moe.router.weight", "mlp.gate.weight"),
            # the shared expert (GraniteMoeShared, GraniteMoeSWA): gate rows, then up, fused
            ("shared_mlp.input_linear.weight", "mlp.shared_expert.gate_up_proj.weight"),
            ("shared_mlp.output_linear.weight", "mlp.shared_expert.down_proj.weight"))


class GraniteMoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       norm_topk=False, softmax_topk=True, router_fp32=True,
                       shared_inter=int(getattr(config, "shared_intermediate_size", 0) or 0), shared_gated=False)
        return dataclasses.replace(GraniteForCausalLM.spec(config), mlp_bias=False, moe=moe)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for old, new in _RENAMES:
            if old in name:
                return name.replace(old, new)
        return name


class GraniteMoeSwaForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE's experts (and shared expert) under Granite SWA's attention."""

    @classmethod
    def spec(cls, config) -> ArchSpec:
        swa = GraniteSwaForCausalLM.spec(config)
        return dataclasses.replace(GraniteMoeForCausalLM.spec(config), windows=swa.windows, sinks=swa.sinks)
