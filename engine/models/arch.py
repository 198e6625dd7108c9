"""What sets one decoder architecture apart from another, as data: each architecture file
reads its config into an ArchSpec, and the shared layers (engine/models/layers) and the
decoder (engine/models/decoder.py) do the rest."""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Literal

import torch


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: `experts` gated MLPs of intermediate size `inter`, each
    token routed to `top_k` of them by a softmax router."""

    experts: int
    top_k: int
    inter: int
    norm_topk: bool  # renormalise the top-k probabilities to sum to 1 (Mixtral; Qwen's norm_topk_prob)
    layers: frozenset[int]  # the layers whose MLP this is; the others keep the dense MLP
    shared_inter: int = 0  # Qwen2-MoE's shared expert, gated by a sigmoid, on every token
    weights_in_dtype: bool = True  # routing weights rounded to the activation dtype (Qwen) or fp32 (Mixtral)
    # gpt-oss: a router with a bias whose top-k logits are softmaxed (not the top-k of a
    # softmax), experts with biases, and its clamped SwiGLU, (up + 1) * g * sigmoid(alpha g)
    # with g = min(gate, limit) and up clipped to [-limit, limit] (0: the plain act(gate) * up).
    router_bias: bool = False
    softmax_topk: bool = False
    router_fp32: bool = False  # the router's logits in fp32 before the top-k (Granite MoE)
    expert_bias: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    # DeepSeek-V3's routing (GLM-4.5, dots.llm1) and ERNIE 4.5's: a router whose weight stays
    # fp32 in a bf16 model and reads the activations in fp32; sigmoid scores; a per-expert
    # bias that moves the choice but not the weights; the experts in `groups`, of which each
    # token first keeps the `topk_groups` whose two best scores sum highest; the renormalised
    # weights' divisor clamped from below (`norm_min`, ERNIE) or nudged (`norm_eps`, GLM);
    # the weights scaled by `routed_scale`.
    fp32_router: bool = False
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    choice_bias: bool = False
    groups: int = 1
    topk_groups: int = 1
    norm_min: float = 0.0
    norm_eps: float = 0.0
    routed_scale: float = 1.0
    # The shared expert: Qwen2-MoE's scaled by a sigmoid gate; others' added as it is, with
    # biases where the dense MLP has them (ERNIE 4.5).
    shared_gated: bool = True
    shared_bias: bool = False


def moe_spec(config, experts: int, top_k: int, inter: int, norm_topk: bool, shared_inter: int = 0,
             weights_in_dtype: bool = True, layers: frozenset[int] | None = None, **routing) -> MoESpec:
    """The config's experts, checked: a bad count is a ParamError naming its key. The expert
    layers are `layers` where the architecture says which, else Qwen's `decoder_sparse_step`
    and `mlp_only_layers` (every layer where a config has neither)."""
    from engine.errors import ParamError

    if experts < 1:
        raise ParamError("model", f"a mixture-of-experts config needs at least one expert; it has {experts}")
    if not 1 <= top_k <= experts:
        raise ParamError("model", f"num_experts_per_tok ({top_k}) must be between 1 and the expert count ({experts})")
    groups, topk_groups = routing.get("groups", 1), routing.get("topk_groups", 1)
    if groups > 1 and (experts % groups or experts // groups < 2 or not 1 <= topk_groups <= groups
                       or top_k > topk_groups * (experts // groups)):
        raise ParamError("model", f"n_group {groups} and topk_group {topk_groups} do not divide {experts} experts "
                                  f"into groups of two or more that hold the top {top_k}")
    if layers is None:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        layers = frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    return MoESpec(experts, top_k, inter, norm_topk, layers, shared_inter, weights_in_dtype, **routing)


def deepseek_moe(config) -> MoESpec:
    """DeepSeek-V3's experts as GLM-4.5 and dots.llm1 configure them: dense MLPs on the
    first `first_k_dense_replace` layers, then sigmoid-scored experts chosen with the
    correction bias within the best groups, renormalised if norm_topk_prob, scaled by
    routed_scaling_factor, beside an ungated shared expert."""
    inter = config.moe_intermediate_size
    first = int(getattr(config, "first_k_dense_replace", 0) or 0)
    return moe_spec(config, config.n_routed_experts, config.num_experts_per_tok, inter,
                    norm_topk=bool(config.norm_topk_prob), shared_inter=inter * int(config.n_shared_experts or 0),
                    weights_in_dtype=False, layers=frozenset(range(first, config.num_hidden_layers)),
                    fp32_router=True, scoring="sigmoid", choice_bias=True, groups=int(config.n_group or 1),
                    topk_groups=int(config.topk_group or 1), norm_eps=1e-20,
                    routed_scale=float(config.routed_scaling_factor), shared_gated=False)


@dataclass(frozen=True)
class LinearAttnSpec:
    """The linear-attention layers and their sizes (transformers' linear_* config keys)."""

    layers: frozenset[int]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def state_layout(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        """Per sequence and layer, each state tensor's shape and whether it is fp32 (else the
        model's dtype): the convolution's last inputs (k - 1, channels), the delta rule's
        state (heads, dk, dv) in fp32, as transformers keeps it."""
        return (((self.conv_kernel - 1, self.conv_channels), False),
                ((self.value_heads, self.key_dim, self.value_dim), True))

    def state_bytes(self, dtype: torch.dtype) -> int:
        return _state_bytes(self.layers, self.state_layout(), dtype)


@dataclass(frozen=True)
class ShortConvSpec:
    """LFM2's short-convolution layers: each keeps its last k - 1 inputs per sequence."""

    layers: frozenset[int]
    kernel: int
    channels: int

    def state_layout(self) -> tuple[tuple[tuple[int, ...], bool], ...]:
        return (((self.kernel - 1, self.channels), False),)

    def state_bytes(self, dtype: torch.dtype) -> int:
        return _state_bytes(self.layers, self.state_layout(), dtype)


def _state_bytes(layers: frozenset[int], layout: tuple[tuple[tuple[int, ...], bool], ...], dtype: torch.dtype) -> int:
    """One sequence's state over all the layers that keep one."""
    elem = torch.empty((), dtype=dtype).element_size()
    return len(layers) * sum(math.prod(shape) * (4 if fp32 else elem) for shape, fp32 in layout)


@dataclass(frozen=True)
class ArchSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # q/k RMSNorm before rotary: per head (Qwen3, Gemma 3) or over all heads (OLMo 2).
    # ("rotated": per head after the rotary, HunYuan's order).
    qk_norm: Literal["", "head", "all", "rotated"] = ""
    # Where the norms sit: "pre" (Llama: before attention and MLP), "sandwich" (Gemma: also
    # after each), "post" (OLMo 2: after each, none before), "parallel" (Cohere: one norm,
    # whose output both attention and MLP read, their outputs added to the residual together).
    norms: Literal["pre", "sandwich", "post", "parallel"] = "pre"
    # Cohere's bias-free LayerNorm, or torch's LayerNorm with its bias (StarCoder2, Nemotron)
    norm_kind: Literal["rms", "layer", "layer_bias"] = "rms"
    norm_offset: float = 0.0  # Gemma multiplies by (1 + weight)
    late_cast: bool = False  # the norm's weight multiplies in fp32, rounding after (Gemma, OLMo 2)
    act: Literal["silu", "gelu_tanh", "gelu", "relu2", "xielu"] = "silu"
    gated: bool = True  # down(act(gate) * up); False: down(act(up)) (Arcee, StarCoder2)
    embed_scale: float = 1.0  # Gemma sqrt(hidden), Granite embedding_multiplier
    embed_scale_in_dtype: bool = False  # Gemma rounds the scale to the activation dtype first
    residual_scale: float = 1.0  # Granite residual_multiplier
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    logit_divisor: float = 1.0  # Granite's logits_scaling
    logit_scale: float = 1.0  # Cohere's logit_scale, multiplying
    head_bias: bool = False  # a bias on the LM head (ERNIE 4.5 MoE's use_bias), tied head or not
    # Llama 4's attention temperature (Ministral 3): each query scaled after the rotary by
    # 1 + beta log(1 + floor(position / original)), given as (beta, original); None for none.
    q_position_scale: tuple[float, int] | None = None
    windows: tuple[int, ...] = ()  # per layer; 0 is full attention
    tp_ok: bool = True  # whether tensor parallelism can split its layers (checked by engine.config)
    moe: MoESpec | None = None
    sinks: bool = False  # a learned logit per head in every attention softmax (gpt-oss)
    nope: frozenset[int] = frozenset()  # layers without rotary (SmolLM3's every fourth, EXAONE 4's global ones)
    # Rotary pairs adjacent dims (2i, 2i + 1) instead of (i, i + rot / 2) (GLM, ERNIE 4.5): the
    # loader reorders each q and k head's rows so that every path runs rotate-half.
    rope_interleaved: bool = False
    # Qwen3-Next's and Qwen3.5's attention: q_proj gives each head's query and then a gate,
    # whose sigmoid scales the head's output before o_proj.
    attn_gate: bool = False
    # Their linear-attention layers (Gated DeltaNet), which keep a state per sequence, not KV;
    # LFM2's short-convolution layers likewise.
    linear: LinearAttnSpec | None = None
    short_conv: ShortConvSpec | None = None

    @property
    def stateful(self) -> LinearAttnSpec | ShortConvSpec | None:
        """The layers that keep a state per sequence instead of KV, if the model has any."""
        return self.linear or self.short_conv

    def fusable(self) -> bool:
        """Whether the fused layer (DecoderLayer.forward_fused) runs this layer shape: every
        placement of RMSNorms (a late_cast norm's fp32 weight applies before the rounding
        there too), and LayerNorms before each block or Cohere's before both, which run as
        modules there, as q/k norms after the rotary do (HunYuan). A gated attention layer
        (Qwen3.5's) runs as modules among fused ones (DecoderLayer.flatten)."""
        return self.norm_kind == "rms" or self.norms in ("pre", "parallel")

    def kv_layers(self, num_layers: int) -> list[int]:
        """The layers that attend over a KV cache: all but the linear-attention ones."""
        stateful = self.stateful.layers if self.stateful is not None else frozenset()
        return [i for i in range(num_layers) if i not in stateful]


# transformers' names of the activations the MLP computes, as ArchSpec names them.
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu", "relu2": "relu2", "xielu": "xielu"}


def activation(config, allowed: tuple[str, ...]) -> str:
    """The config's `hidden_act` as ArchSpec names it, refused by name where the
    architecture does not compute it."""
    from engine.errors import ParamError

    name = getattr(config, "hidden_act", None)
    if HF_ACTIVATIONS.get(name) not in allowed:
        raise ParamError("model", f"{config.model_type} with hidden_act {name!r} is not supported "
                                  f"(supported: {', '.join(k for k, v in HF_ACTIVATIONS.items() if v in allowed)})")
    return HF_ACTIVATIONS[name]


def layer_windows(config, all_layers: bool = False) -> tuple[int, ...]:
    """Each layer's sliding window, 0 where it attends to everything: from `layer_types`
    where the config has them, else (Mistral, Phi-3) `sliding_window` on every layer."""
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if types and not all_layers:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return (window,) * config.num_hidden_layers
