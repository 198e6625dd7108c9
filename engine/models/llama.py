"""Llama (2, 3, 3.x), SmolLM and every checkpoint shaped like them: the plain pre-norm
decoder with SiLU-gated MLPs, optional biases and scaled rotary. Meta's CWM is Llama's
layer with a window on the layers `layer_types` mark sliding (three of every four)."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                        windows=(0,) * config.num_hidden_layers)


class CwmForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return dataclasses.replace(LlamaForCausalLM.spec(config), windows=layer_windows(config))
