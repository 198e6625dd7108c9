"""EXAONE 4: per-head q/k RMSNorm, norms after attention and MLP only (none before), and
where the config has a sliding window, local layers (`layer_types`) windowed with rotary
and the global ones unwindowed without it (NoPE)."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


class Exaone4ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        hybrid = bool(getattr(config, "sliding_window", None))
        types = getattr(config, "layer_types", None) or ("full_attention",) * config.num_hidden_layers
        nope = frozenset(i for i, t in enumerate(types) if t != "sliding_attention") if hybrid else frozenset()
        return ArchSpec(qk_norm="head", norms="post", windows=layer_windows(config), nope=nope)
