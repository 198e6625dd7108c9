"""One decoder layer, every architecture's: its norms where the ArchSpec puts them, the
attention, the MLP or the experts; as modules (`forward`, transformers' operations one
for one), and flat on the fused kernels (`forward_fused`) where the attention backend has
them (ArchSpec.fusable says which layer shapes that path runs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine import parallel
from engine.models.arch import ArchSpec
from engine.models.layers.attention import Attention
from engine.models.layers.gated_delta import GatedDeltaNet
from engine.models.layers.short_conv import ShortConv
from engine.models.layers.mlp import MLP
from engine.models.layers.moe import SparseMoE
from engine.models.layers.norm import hidden_norm


@dataclass(frozen=True, slots=True)
class Flat:
    """One decoder layer's weights, projections and sizes as plain references."""

    norm1: torch.Tensor | None  # before attention (None: OLMo 2's and EXAONE 4's layers, Cohere's)
    eps1: float
    norm2: torch.Tensor | None  # before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward one
    eps2: float
    post_attn: torch.Tensor | None  # the norms of the attention's and the MLP's outputs (Gemma, OLMo 2)
    post_mlp: torch.Tensor | None
    eps_post: float
    # A LayerNorm's module before attention (Cohere's, which the MLP reads too: `parallel`;
    # StarCoder2's, StableLM's, Nemotron's) and before the MLP; RMSNorms run fused instead.
    layer_norm: Callable[[torch.Tensor], torch.Tensor] | None
    layer_norm2: Callable[[torch.Tensor], torch.Tensor] | None
    parallel: bool
    # A state-keeping layer's whole token mixer (linear attention or a short convolution,
    # projections in and out), in place of the attention's references below, left neutral.
    mixer: Callable[..., torch.Tensor] | None
    qkv: Callable[[torch.Tensor], torch.Tensor] | None
    qk_norm: torch.Tensor | None  # [H + Hkv, D]: the q heads' norm weight, then the k heads'
    qk_eps: float
    qk_all: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None  # OLMo 2's
    # HunYuan's per-head q and k norms, after the rotary
    qk_rotated: tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None
    o: Callable[[torch.Tensor], torch.Tensor] | None
    gate_up: Callable[[torch.Tensor], torch.Tensor] | None  # None on an expert layer
    glu: bool  # gate_up returns silu(gate) * up itself
    gated: bool  # False: gate_up is up alone, and the MLP is down(act(up))
    act: Callable[[torch.Tensor], torch.Tensor] | None  # None: the native silu-mul
    inter: int
    down: Callable[[torch.Tensor], torch.Tensor] | None
    experts: Callable[[torch.Tensor], torch.Tensor] | None  # an expert layer, all-reduced within
    heads: int
    kv_heads: int
    head_dim: int
    q_size: int
    v_at: int  # where v starts in a qkv row
    scale: float
    window: int
    softcap: float
    sinks: torch.Tensor | None  # gpt-oss's per-head sink logits, fp32
    residual_scale: float
    reduce: Callable[[torch.Tensor], torch.Tensor] | None  # the tensor-parallel all-reduce, if any
    ops: Any  # add_rms_norm, rope_qk, silu_mul: kernels.cpu or kernels.triton_fused


class DecoderLayer(nn.Module):
    def __init__(self, config, spec: ArchSpec, layer: int, heads: parallel.Heads, tp: parallel.Group) -> None:
        super().__init__()
        self.spec = spec
        # A layer that keeps a state per sequence instead of KV (`is_linear`): Qwen3.5's
        # linear attention, LFM2's short convolution, under their checkpoints' names.
        self.is_linear = spec.stateful is not None and layer in spec.stateful.layers
        self.fused = False  # on the fused kernels (forward_fused); set by flatten
        if self.is_linear and spec.linear is not None:
            self.linear_attn = GatedDeltaNet(config.hidden_size, spec.linear, config.rms_norm_eps)
        elif self.is_linear:
            self.conv = ShortConv(config.hidden_size, spec.short_conv)
        else:
            self.self_attn = Attention(config, spec, layer, heads, tp)
        if spec.moe is not None and layer in spec.moe.layers:
            self.mlp: MLP | SparseMoE = SparseMoE(config.hidden_size, spec.moe, spec.act, tp)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, spec.act, spec.mlp_bias, tp, spec.gated)
        if spec.norms != "post":
            self.input_layernorm = hidden_norm(config, spec)
        if spec.norms != "parallel":
            self.post_attention_layernorm = hidden_norm(config, spec)
        if spec.norms == "sandwich":
            self.pre_feedforward_layernorm = hidden_norm(config, spec)
        if spec.norms in ("sandwich", "post"):
            self.post_feedforward_layernorm = hidden_norm(config, spec)

    def forward(self, h, cos, sin, kv_cache, meta, q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """`q_scale`: each token's query scale after the rotary (ArchSpec.q_position_scale)."""
        norms = self.spec.norms

        def attn(x: torch.Tensor) -> torch.Tensor:
            if self.is_linear:
                return self.mixer(x, kv_cache, meta)
            return self.self_attn(x, cos, sin, kv_cache, meta, q_scale)

        if norms == "pre":
            rs = self.spec.residual_scale
            a = attn(self.input_layernorm(h))
            h = h + (a * rs if rs != 1.0 else a)
            m = self.mlp(self.post_attention_layernorm(h))
            return h + (m * rs if rs != 1.0 else m)
        if norms == "parallel":
            x = self.input_layernorm(h)
            return h + attn(x) + self.mlp(x)
        if norms == "sandwich":
            h = h + self.post_attention_layernorm(attn(self.input_layernorm(h)))
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + self.post_attention_layernorm(attn(h))
        return h + self.post_feedforward_layernorm(self.mlp(h))

    @property
    def mixer(self) -> GatedDeltaNet | ShortConv:
        """A state-keeping layer's token mixer (one attribute per checkpoint name)."""
        return self.linear_attn if hasattr(self, "linear_attn") else self.conv

    def flatten(self, ops: Any) -> None:
        """Plain references to what forward_fused uses, taken once the weights are final
        (loaded, packed or quantized); `ops` holds the fused kernels. A gated attention
        layer (Qwen3.5's, each head's query rows followed by its gate's) keeps the module
        path (`fused` False): the fused rotary reads q and k where Llama's layout has them."""
        self.fused = self.is_linear or not self.self_attn.gated
        if not self.fused:
            return
        attn, mlp = None if self.is_linear else self.self_attn, self.mlp
        moe = isinstance(mlp, SparseMoE)
        qk_norm = None
        if attn is not None and attn.qk_norm == "head":
            qk_norm = torch.cat([attn.q_norm.effective_weight().float().expand(attn.num_heads, -1),
                                 attn.k_norm.effective_weight().float().expand(attn.num_kv_heads, -1)])
        norms = self.spec.norms
        layer_norms = self.spec.norm_kind != "rms"  # modules here; an RMSNorm's weight goes to the fused kernel
        first = self.input_layernorm if norms in ("pre", "sandwich") and not layer_norms else None
        second = {"pre": "post_attention_layernorm", "sandwich": "pre_feedforward_layernorm"}.get(norms)
        second = getattr(self, second) if second and not layer_norms else None
        after = norms in ("sandwich", "post")  # the outputs' norms: post_attention_ and post_feedforward_layernorm
        self.flat = Flat(
            **(_attention_refs(attn, qk_norm) if attn is not None else _NO_ATTENTION),
            mixer=self.mixer.forward if attn is None else None,
            norm1=first.effective_weight() if first else None, eps1=first.eps if first else 0.0,
            norm2=second.effective_weight() if second else None, eps2=second.eps if second else 0.0,
            post_attn=self.post_attention_layernorm.effective_weight() if after else None,
            post_mlp=self.post_feedforward_layernorm.effective_weight() if after else None,
            eps_post=self.post_attention_layernorm.eps if after else 0.0,
            layer_norm=self.input_layernorm.forward if layer_norms else None,
            layer_norm2=self.post_attention_layernorm.forward if layer_norms and norms == "pre" else None,
            parallel=norms == "parallel",
            gate_up=None if moe else mlp.gate_up_proj.forward, glu=not moe and mlp.glu,
            gated=moe or mlp.gated, act=None if moe or (mlp.gated and mlp.act_name == "silu") else mlp.act,
            inter=mlp.inter,
            down=None if moe else mlp.down_proj.forward, experts=mlp.forward if moe else None,
            residual_scale=self.spec.residual_scale, ops=ops)

    def forward_fused(self, residual, pending, cos, sin, kv_cache, meta, keep: torch.Tensor | None = None,
                      q_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer on fused kernels (the native CPU ones, or Triton's on a GPU): each
        residual add fused into the RMSNorm after it (`residual` updated in place, the MLP
        output, Gemma's and OLMo 2's normed, returned as the next layer's `pending`; their
        attention output normed before it joins the residual; where no RMSNorm follows, OLMo
        2's, Cohere's and the LayerNorm layers', a plain add in place, the LayerNorm a
        module call), the rotary fused, and written flat, with no other nn.Module call or
        module attribute lookup inside: at batch 1 on quantized weights the Python around the
        kernels had taken about 95 us a layer, a quarter of the step. On a GPU the module path's forty
        small kernels a layer had taken more device time than the GEMMs, graphs or not.
        cos and sin are [n, rotary dims]. Returns (residual, pending).

        `keep`, on the model's last layer: the rows that need logits. Every row's K and V
        are stored, but only those rows go on through o_proj and the MLP; in a prefill
        chunk that is one row a prompt instead of all of them. Each GEMM row is computed
        on its own, so the kept rows' values are the same. `q_scale` as in forward."""
        f = self.flat
        if f.norm1 is not None:
            x = f.ops.add_rms_norm(pending, residual, f.norm1, f.eps1)
        else:  # the residual itself (norms after each sublayer), or Cohere's LayerNorm of it
            if pending is not None:
                residual.add_(pending)
            x = f.layer_norm(residual) if f.layer_norm is not None else residual
        if f.mixer is not None:  # a state-keeping layer: its mixer whole, then the MLP as any layer's
            out = f.mixer(x, kv_cache, meta)
            if keep is not None:
                out, residual = out[keep], residual[keep]
            return self._mlp_fused(f, _branch_out(f, out, f.post_attn), residual, x)
        n = x.shape[0]
        qkv = f.qkv(x)
        if f.qk_all is not None:  # OLMo 2's q and k norms, each over all its heads
            q_all, k_all = f.qk_all
            qkv = torch.cat([q_all(qkv[:, :f.q_size]), k_all(qkv[:, f.q_size:f.v_at]), qkv[:, f.v_at:]], dim=-1)
        # per-head RMSNorm of q and k (Qwen3, Gemma 3) inside the rotary's pass
        q, k = f.ops.rope_qk(qkv, cos, sin, f.heads, f.kv_heads, f.head_dim, f.qk_norm, f.qk_eps)
        if f.qk_rotated is not None:  # HunYuan's per-head norms, after the rotary
            q, k = f.qk_rotated[0](q), f.qk_rotated[1](k)
        if q_scale is not None:
            q = q * q_scale[:, None, None]
        v = qkv[:, f.v_at:].view(n, f.kv_heads, f.head_dim)
        k_cache, v_cache = kv_cache
        backend = meta.backend
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attention(q, k_cache, v_cache, meta, f.scale, f.window, f.softcap, f.sinks).view(n, f.q_size)
        if keep is not None:
            out, residual = out[keep], residual[keep]
            if f.parallel:
                x = x[keep]
        return self._mlp_fused(f, _branch_out(f, f.o(out), f.post_attn), residual, x)

    @staticmethod
    def _mlp_fused(f: Flat, out: torch.Tensor, residual: torch.Tensor, x: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token mixer's output `out` into the residual, then the MLP or the experts on
        the fused kernels; `x` is what the mixer read (Cohere's MLP reads it too)."""
        if f.norm2 is not None:
            x = f.ops.add_rms_norm(out, residual, f.norm2, f.eps2)
        else:  # the MLP reads the residual (post norms), its LayerNorm, or the same x as attention (Cohere)
            residual.add_(out)  # (h + attention) + MLP, in transformers' order
            if f.layer_norm2 is not None:
                x = f.layer_norm2(residual)
            elif not f.parallel:
                x = residual
        if f.experts is not None:  # all-reduced inside; scaled, and normed where a norm follows (FlexOlmo)
            out = f.experts(x)
            out = out * f.residual_scale if f.residual_scale != 1.0 else out
            return residual, (f.ops.add_rms_norm(None, out, f.post_mlp, f.eps_post) if f.post_mlp is not None else out)
        up = f.gate_up(x)
        if not f.gated:
            out = f.down(f.act(up))
        elif f.glu:
            out = f.down(up)
        elif f.act is None:
            out = f.down(f.ops.silu_mul(up))
        else:
            gate, up = up.split(f.inter, dim=-1)
            out = f.down(f.act(gate) * up)
        return residual, _branch_out(f, out, f.post_mlp)


def _attention_refs(attn: Attention, qk_norm: torch.Tensor | None) -> dict[str, Any]:
    return dict(qkv=attn.qkv_proj.forward, qk_norm=qk_norm, qk_eps=attn.q_norm.eps if qk_norm is not None else 0.0,
                qk_all=(attn.q_norm.forward, attn.k_norm.forward) if attn.qk_norm == "all" else None,
                qk_rotated=(attn.q_norm.forward, attn.k_norm.forward) if attn.qk_norm == "rotated" else None,
                o=attn.o_proj.forward, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                q_size=attn.q_size, v_at=attn.q_size + attn.kv_size, scale=attn.scale, window=attn.window,
                softcap=attn.softcap, sinks=attn.sinks.detach().float() if attn.sinks is not None else None,
                reduce=attn.tp.all_reduce if attn.tp.size > 1 else None)


# A state-keeping layer's Flat: no attention (its mixer is whole), no tensor parallelism.
_NO_ATTENTION: dict[str, Any] = dict(qkv=None, qk_norm=None, qk_eps=0.0, qk_all=None, qk_rotated=None, o=None,
                                     heads=0, kv_heads=0, head_dim=0, q_size=0, v_at=0, scale=0.0, window=0,
                                     softcap=0.0, sinks=None, reduce=None)


def _branch_out(f: Flat, out: torch.Tensor, post: torch.Tensor | None) -> torch.Tensor:
    """A sublayer's output as it joins the residual: Granite's residual multiplier, the
    tensor-parallel all-reduce, and the norm after it where the layer has one (Gemma, OLMo 2)."""
    if f.residual_scale != 1.0:
        out = out * f.residual_scale
    if f.reduce is not None:
        out = f.reduce(out)
    return f.ops.add_rms_norm(None, out, post, f.eps_post) if post is not None else out
