"""GLM-4 (`glm`) and GLM-4-0414 (`glm4`): Llama's layer with q/k/v biases, a fused gate_up_proj
checkpoint tensor, and a partial rotary pairing adjacent dims (the loader reorders q and
k to rotate-half's pairs). GLM-4-0414 also norms the attention's and the MLP's outputs,
Gemma's four norms a layer without Gemma's (1 + w), under its own names."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class GlmForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), rope_interleaved=True,
                        windows=(0,) * config.num_hidden_layers)


# GLM-4-0414's norm names -> the sandwich layer's (engine/models/layers/block.py). Its
# post_attention_layernorm is the one before the MLP.
GLM4_NORMS = {"post_self_attn_layernorm": "post_attention_layernorm",
              "post_attention_layernorm": "pre_feedforward_layernorm",
              "post_mlp_layernorm": "post_feedforward_layernorm"}


class Glm4ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), rope_interleaved=True,
                        norms="sandwich", windows=(0,) * config.num_hidden_layers)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        head, _, leaf = name.rpartition(".")
        base, _, module = head.rpartition(".")
        if module in GLM4_NORMS:
            return f"{base}.{GLM4_NORMS[module]}.{leaf}"
        return name
