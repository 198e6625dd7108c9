"""Mixtral: Mistral's attention, and a mixture of experts for every MLP (top 2 of 8),
its routing weights renormalised and kept in fp32."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows, moe_spec
from engine.models.decoder import DecoderForCausalLM

# Mixtral's checkpoints name the expert layer and its projections their own way.
_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class MixtralForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       norm_topk=True, weights_in_dtype=False)
        return ArchSpec(windows=layer_windows(config, all_layers=True), moe=moe)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
