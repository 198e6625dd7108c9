"""LFM2 (Liquid): short-convolution layers (engine/models/layers/short_conv.py) between
attention layers with per-head q/k norms, as `layer_types` says; a SwiGLU MLP whose size
the config derives (`block_auto_adjust_ff_dim`); the final norm after the last layer
(`embedding_norm`, despite its name). The convolution layers keep a state per sequence
instead of KV, in the engine's state slots: such a model is served without the prefix
cache, speculative decoding or parallelism (engine/config.py)."""

from __future__ import annotations

import copy

from engine.errors import ParamError
from engine.models.arch import ArchSpec, ShortConvSpec, moe_spec
from engine.models.decoder import DecoderForCausalLM

# Checkpoint names to ours, by part of the name (the attention's own out_proj only).
NAMES = ((".self_attn.q_layernorm.", ".self_attn.q_norm."), (".self_attn.k_layernorm.", ".self_attn.k_norm."),
         (".self_attn.out_proj.", ".self_attn.o_proj."), (".feed_forward.w1.", ".mlp.gate_proj."),
         (".feed_forward.w3.", ".mlp.up_proj."), (".feed_forward.w2.", ".mlp.down_proj."),
         (".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."))


def _engine_config(config):
    """The config as the shared layers read it (a copy): the MLP's size as LFM2 derives
    it, and its norms' epsilon under the name the others use."""
    config = copy.deepcopy(config)
    inter = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):  # LFM2-MoE's dense layers take theirs as given
        inter = int(2 * inter / 3)
        if config.block_ffn_dim_multiplier is not None:
            inter = int(config.block_ffn_dim_multiplier * inter)
            inter = config.block_multiple_of * ((inter + config.block_multiple_of - 1) // config.block_multiple_of)
    config.intermediate_size = inter
    config.rms_norm_eps = config.norm_eps
    return config


def _layer_types(config) -> list[str]:
    types = list(getattr(config, "layer_types", None) or ())
    if not types and getattr(config, "full_attn_idxs", None) is not None:
        types = ["full_attention" if i in config.full_attn_idxs else "conv" for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {"conv", "full_attention"}:
        raise ParamError("model", f"lfm2 needs layer_types with conv or full_attention for each of its "
                                  f"{config.num_hidden_layers} layers; it has {types!r}"[:300])
    return types


class Lfm2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return cls._spec(config, None)

    @classmethod
    def _spec(cls, config, moe) -> ArchSpec:
        if getattr(config, "conv_bias", False):
            raise ParamError("model", "lfm2 with conv_bias is not supported: its short convolutions carry no bias here")
        types = _layer_types(config)
        conv = ShortConvSpec(frozenset(i for i, t in enumerate(types) if t == "conv"), int(config.conv_L_cache),
                             config.hidden_size)
        if conv.kernel < 2:
            raise ParamError("model", f"conv_L_cache must be at least 2; it is {conv.kernel}")
        return ArchSpec(qk_norm="head", short_conv=conv, windows=(0,) * config.num_hidden_layers, tp_ok=False, moe=moe)

    @classmethod
    def engine_config(cls, config):
        return _engine_config(config)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        if name == "model.embedding_norm.weight":
            return "model.norm.weight"
        for theirs, ours in NAMES:
            name = name.replace(theirs, ours)
        return name


# LFM2-MoE's expert layers, by part of the name (before NAMES: its dense MLP's w1/w3/w2
# become ours there), and each expert's own w1/w3/w2.
MOE_NAMES = ((".feed_forward.expert_bias", ".mlp.gate.choice_bias"), (".feed_forward.gate.", ".mlp.gate."),
             (".feed_forward.experts.", ".mlp.experts."))
EXPERT_NAMES = ((".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (LFM2-8B-A1B): LFM2's layers, dense MLPs on the first `num_dense_layers`,
    then experts chosen by sigmoid scores plus a per-expert bias that moves the choice but
    not the weights (DeepSeek-V3's routing without groups), renormalised over sum + 1e-6
    as transformers does, scaled by routed_scaling_factor."""

    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       norm_topk=bool(config.norm_topk_prob),
                       layers=frozenset(range(int(config.num_dense_layers), config.num_hidden_layers)),
                       fp32_router=True, scoring="sigmoid", choice_bias=bool(config.use_expert_bias), norm_eps=1e-6,
                       routed_scale=float(config.routed_scaling_factor))
        return cls._spec(config, moe)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for theirs, ours in MOE_NAMES:
            name = name.replace(theirs, ours)
        if ".mlp.experts." in name:
            for theirs, ours in EXPERT_NAMES:
                name = name.replace(theirs, ours)
        return super().checkpoint_name(name)
