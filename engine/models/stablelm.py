"""StableLM 2 (1.6B, Zephyr): torch's LayerNorm with its bias, SiLU-gated MLPs, q/k/v
biases, and rotary on a quarter of each head. The 12B's per-head q/k LayerNorms and
parallel residual are refused by name."""

from __future__ import annotations

from engine.errors import ParamError
from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM


class StableLmForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        for flag in ("qk_layernorm", "use_parallel_residual"):
            if getattr(config, flag, False):
                raise ParamError("model", f"a stablelm checkpoint with {flag} (StableLM 2 12B) is not supported")
        return ArchSpec(qkv_bias=bool(getattr(config, "use_qkv_bias", False)), norm_kind="layer_bias",
                        windows=(0,) * config.num_hidden_layers)
