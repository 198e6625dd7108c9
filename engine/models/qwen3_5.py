"""Qwen3.5 (text) and Qwen3-Next: three linear-attention layers (Gated DeltaNet) to every
attention layer, as `layer_types` says. Its attention layers are Qwen3's with a sigmoid
gate on each head's output and a quarter of each head turned by the rotary; every RMSNorm
but the linear layers' own multiplies by (1 + w). The multimodal checkpoints' language
model is served as this; their vision tower is not loaded (their text positions turn as
the plain rotary does: every M-RoPE section reads the same position).

The linear layers keep a state per sequence instead of KV, which the engine holds in slots
(engine/state_slots.py): such a model is served without the prefix cache, and
engine/config.py refuses speculative decoding and parallelism for it by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from engine.errors import ParamError
from engine.models.arch import ArchSpec, LinearAttnSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM
from engine.models.text_part import text_name

# The vision tower, and the multi-token-prediction head (for speculation, not served).
OTHER_PARTS = ("model.visual.", "visual.", "mtp.")


def linear_spec(config) -> LinearAttnSpec:
    """The linear-attention layers and sizes, checked: a config they cannot describe is
    refused naming its key."""
    types = list(getattr(config, "layer_types", None) or ())
    if len(types) != config.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise ParamError("model", f"{config.model_type} needs layer_types with linear_attention or full_attention "
                                  f"for each of its {config.num_hidden_layers} layers; it has {types!r}"[:300])
    if "full_attention" not in types:
        raise ParamError("model", f"{config.model_type}'s layer_types has no full_attention layer")
    spec = LinearAttnSpec(frozenset(i for i, t in enumerate(types) if t == "linear_attention"),
                          int(config.linear_num_key_heads), int(config.linear_num_value_heads),
                          int(config.linear_key_head_dim), int(config.linear_value_head_dim),
                          int(config.linear_conv_kernel_dim))
    if spec.key_heads < 1 or spec.value_heads % spec.key_heads:
        raise ParamError("model", f"linear_num_value_heads ({spec.value_heads}) must be a multiple of "
                                  f"linear_num_key_heads ({spec.key_heads})")
    if spec.conv_kernel < 2:
        raise ParamError("model", f"linear_conv_kernel_dim must be at least 2; it is {spec.conv_kernel}")
    return spec


def qwen3_5_spec(config, **extra) -> ArchSpec:
    return ArchSpec(qk_norm="head", norm_offset=1.0, late_cast=True, attn_gate=True, linear=linear_spec(config),
                    windows=(0,) * config.num_hidden_layers, tp_ok=False, **extra)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        if getattr(config, "attention_bias", False):
            raise ParamError("model", f"{config.model_type} with attention_bias is not supported")
        if getattr(config, "attn_output_gate", True) is False:  # every released config gates
            raise ParamError("model", f"{config.model_type} with attn_output_gate false is not supported")
        return qwen3_5_spec(config)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return text_name(name, OTHER_PARTS)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's MoE models: experts on every layer, each token's top k renormalised, and
    Qwen2-MoE's shared expert behind its sigmoid gate."""

    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       norm_topk=True, shared_inter=int(config.shared_expert_intermediate_size or 0),
                       layers=frozenset(range(config.num_hidden_layers)))
        return qwen3_5_spec(config, moe=moe)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5's layers with Qwen3-MoE's choice of expert layers (every
    `decoder_sparse_step`-th, less `mlp_only_layers`) and renormalisation (norm_topk_prob).
    Its checkpoints hold the linear layers' input projections grouped by key head (each
    head's q, k, then its value heads' v and z; b and a likewise): the loader regroups them
    into Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a."""

    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = None
        if int(getattr(config, "num_experts", 0) or 0) > 0:
            moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                           norm_topk=bool(config.norm_topk_prob),
                           shared_inter=int(config.shared_expert_intermediate_size or 0))
        return qwen3_5_spec(config, moe=moe)

    def load_weights(self, weights: Iterable[tuple[str, object]], absent: Callable[[str], bool] | None = None
                     ) -> None:
        super().load_weights(self._regrouped(weights), absent)

    def _regrouped(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        spec = self.arch.linear
        assert spec is not None
        heads, per = spec.key_heads, spec.value_heads // spec.key_heads
        for name, src in weights:
            base, _, leaf = name.rpartition(".")
            if base.endswith(".in_proj_qkvz") and leaf == "weight":
                w = src[...].reshape(heads, 2 * spec.key_dim + 2 * per * spec.value_dim, -1)
                q, k, v, z = w.split([spec.key_dim, spec.key_dim, per * spec.value_dim, per * spec.value_dim], dim=1)
                stem = base.removesuffix("qkvz")
                yield f"{stem}qkv.weight", torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
                yield f"{stem}z.weight", z.reshape(-1, w.shape[-1])
            elif base.endswith(".in_proj_ba") and leaf == "weight":
                b, a = src[...].reshape(heads, 2 * per, -1).split(per, dim=1)
                stem = base.removesuffix("ba")
                yield f"{stem}b.weight", b.reshape(spec.value_heads, -1)
                yield f"{stem}a.weight", a.reshape(spec.value_heads, -1)
            else:
                yield name, src
