"""Gemma 2: norms before and after attention and MLP, (1 + w) norm weights, embeddings
scaled by sqrt(hidden), GELU-tanh, local and global layers alternating, and tanh
soft-capping of the attention scores and the final logits. VaultGemma is Gemma 2 without
the norms after attention and MLP."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


def gemma_spec(config, **extra) -> ArchSpec:
    """What Gemma 2 and 3 share."""
    bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(
        qkv_bias=bias, o_bias=bias, norms="sandwich", norm_offset=1.0, late_cast=True,
        act=_act(config), embed_scale=config.hidden_size**0.5, embed_scale_in_dtype=True,
        attn_scale=config.query_pre_attn_scalar**-0.5, windows=layer_windows(config), **extra)


def _act(config) -> str:
    from engine.errors import ParamError

    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ParamError("model", f"{config.model_type} with hidden activation {act!r} is not supported")
    return "gelu_tanh"


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return gemma_spec(config, attn_softcap=getattr(config, "attn_logit_softcapping", None) or 0.0,
                          final_softcap=getattr(config, "final_logit_softcapping", None) or 0.0)


class VaultGemmaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return dataclasses.replace(Gemma2ForCausalLM.spec(config), norms="pre")

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return name.replace(".pre_feedforward_layernorm.", ".post_attention_layernorm.")  # the pre layer's second
