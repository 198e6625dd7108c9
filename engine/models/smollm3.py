"""SmolLM3: Llama's layer, with every fourth layer (`no_rope_layers`: 0) attending without
rotary positions (NoPE), and a sliding window on the layers `layer_types` marks where
`use_sliding_window` is set."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class SmolLM3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        bias = bool(getattr(config, "attention_bias", False))
        layers = config.num_hidden_layers
        windows = layer_windows(config) if getattr(config, "use_sliding_window", False) else (0,) * layers
        return ArchSpec(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)),
                        windows=windows, nope=frozenset(i for i, rope in enumerate(config.no_rope_layers) if not rope))
