"""Command R and Aya (`cohere`) and Command R7B (`cohere2`): one bias-free LayerNorm a
layer, read by attention and MLP side by side (their outputs join the residual together),
a rotary on adjacent pairs of dims (the loader reorders q and k to rotate-half's pairs),
tied embeddings and a logit scale. Command R7B windows three layers of four and turns
only those; its global layers attend without positions (NoPE)."""

from __future__ import annotations

from engine.errors import ParamError
from engine.models.arch import ArchSpec, layer_windows
from engine.models.decoder import DecoderForCausalLM


def _spec(config, windows: tuple[int, ...], nope: frozenset[int] = frozenset()) -> ArchSpec:
    if getattr(config, "use_qk_norm", False):
        # Command R+'s LayerNorm per head, with a weight per head: not a layer this engine has.
        raise ParamError("model", "a cohere checkpoint with use_qk_norm (Command R+) is not supported")
    bias = bool(getattr(config, "attention_bias", False))
    return ArchSpec(qkv_bias=bias, o_bias=bias, norms="parallel", norm_kind="layer", rope_interleaved=True,
                    logit_scale=float(config.logit_scale), windows=windows, nope=nope)


class CohereForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return _spec(config, (0,) * config.num_hidden_layers)


class Cohere2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        windows = layer_windows(config)
        return _spec(config, windows, frozenset(i for i, w in enumerate(windows) if not w))
