"""Rotary position embeddings: the inverse frequencies of every rope type the supported
architectures use, and the cos/sin tables the layers index by position.

The frequencies come from transformers' own rope functions (ROPE_INIT_FUNCTIONS) wherever
a type is scaled, so linear, llama3, yarn and longrope are exactly the reference's; only
the default type, which transformers keeps per model class, is computed here.
"""

from __future__ import annotations

import copy

import torch

from engine.errors import ParamError

SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope")
# The kind of a layer that turns nothing (ArchSpec.nope): its tables rotate by zero, which
# leaves q and k exactly as they are, on every path, fused or not.
NOPE = "nope"
# The kind of a layer with a base of its own (Granite SWA's `layer_rope_theta`): "theta=<base>".
THETA = "theta="


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def parameters(config, kind: str) -> dict:
    """The rope parameters of one layer kind ("" where the config has one set for all, a
    THETA kind that set with its own base)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params[kind] if kind and not kind.startswith(THETA) else params)
    if kind.startswith(THETA):
        params["rope_theta"] = float(kind[len(THETA):])
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


def kinds(config, nope: frozenset[int] = frozenset()) -> tuple[str, ...]:
    """Each layer's key into the rope parameters: Gemma 3 and OLMo 3 keep one set per layer
    type (local layers on another base or unscaled), Granite SWA a base per layer (0 for no
    rotary), every other config one set for all; NOPE for the layers in `nope`."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    thetas = getattr(config, "layer_rope_theta", None)
    if thetas:
        if len(thetas) != config.num_hidden_layers or any(not isinstance(t, (int, float)) or t < 0 for t in thetas):
            raise ParamError("model", f"layer_rope_theta must hold a base >= 0 (0 for no rotary) for each of the "
                                      f"{config.num_hidden_layers} layers; it is {thetas!r}"[:300])
        keys = tuple(f"{THETA}{float(t)!r}" if t else NOPE for t in thetas)
    elif types and all(t in params for t in set(types)):
        keys = tuple(types)
    else:
        keys = ("",) * config.num_hidden_layers
    return tuple(NOPE if i in nope else key for i, key in enumerate(keys))


def _inv_freq(config, kind: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    params = parameters(config, kind)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "dynamic" and params.get("alpha"):
        # HunYuan's NTK with a fixed alpha (its checkpoints say "dynamic"): the base stretched
        # by alpha ** (d / (d - 2)) over the whole head, the same at every length.
        dim = head_dim(config)
        theta = params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in SUPPORTED:
        raise ParamError("model", f"rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED)})")
    if rope_type == "default":
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
        dim = int(head_dim(config) * partial)
        theta = params["rope_theta"]
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind.startswith(THETA):  # the scaled type on this layer's base, as transformers builds it
        config = copy.copy(config)
        config.rope_parameters = params
        kind = ""
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len, layer_type=kind or None)


def tables(config, kind: str, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, rotary dims] in fp32, scaled as the rope type asks.

    LongRoPE (Phi-3) turns with its short factors up to the original context and with its
    long ones past it. transformers switches every position of a sequence to the long
    factors once the sequence outgrows the original context, which a cache of already
    rotated keys cannot do; positions within the original context, where the reference
    is checked, are identical."""
    if kind == NOPE:  # one row, seen at every position: no table's worth of memory
        dims = head_dim(config)
        return torch.ones(1, dims).expand(max_positions, dims), torch.zeros(1, dims).expand(max_positions, dims)
    inv_freq, scaling = _inv_freq(config, kind)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    params = parameters(config, kind)
    if params.get("rope_type") == "longrope":
        original = params.get("original_max_position_embeddings") or config.max_position_embeddings
        long_freq, _ = _inv_freq(config, kind, seq_len=original + 1)
        late = positions >= original
        freqs[late] = positions[late, None] * long_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first cos.shape[-1] dims of each head; the rest pass."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
