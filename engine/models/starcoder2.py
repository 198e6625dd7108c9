"""StarCoder2: torch's LayerNorm with its bias before attention and MLP, biases on every
projection, a plain GELU MLP (`c_fc`, `c_proj`, no gate) and a sliding window on every
layer where the config sets one."""

from __future__ import annotations

from engine.models.arch import ArchSpec, activation, layer_windows
from engine.models.decoder import DecoderForCausalLM

# Its checkpoints' MLP names, in the terms of the model's plain MLP.
NAMES = {".mlp.c_fc.": ".mlp.up_proj.", ".mlp.c_proj.": ".mlp.down_proj."}


class Starcoder2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "use_bias", True))
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bias, gated=False, norm_kind="layer_bias",
                        act=activation(config, ("gelu_tanh", "gelu")), windows=layer_windows(config))

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        for theirs, ours in NAMES.items():
            name = name.replace(theirs, ours)
        return name
