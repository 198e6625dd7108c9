"""Qwen3.5's and Qwen3-Next's linear-attention layer (Gated DeltaNet) over per-sequence
state slots instead of a KV cache.

A sequence's whole past lives in two tensors per layer, whatever its length: the last
k - 1 inputs of the causal convolution, and the delta rule's fp32 state per value head
(engine/models/layers/delta_rule.py). The engine gives each running sequence a slot
(engine/state_slots.py); a sequence whose first new token is at position 0 starts from
zeros, so a preempted one recomputed from its prompt needs nothing reset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import LinearAttnSpec
from engine.models.layers import delta_rule
from engine.models.layers.attention import AttnMetadata


class _Conv(nn.Module):
    """Holds the depthwise kernel under the checkpoint's name (conv1d.weight, [C, 1, k])."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class GatedDeltaNet(nn.Module):
    """in_proj (the checkpoint's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one
    GEMM), the convolution over q, k and v, the delta rule, an RMSNorm per value head
    gated by SiLU(z), out_proj."""

    def __init__(self, hidden: int, spec: LinearAttnSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.key_size = spec.key_heads * spec.key_dim
        self.value_size = spec.value_heads * spec.value_dim
        self.in_sizes = (spec.conv_channels, self.value_size, spec.value_heads, spec.value_heads)
        self.in_proj = nn.Linear(hidden, sum(self.in_sizes), bias=False)
        self.conv1d = _Conv(spec.conv_channels, spec.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(spec.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(spec.value_heads), requires_grad=False)
        self.norm = _GatedNorm(spec.value_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
        spec, n = self.spec, x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.in_sizes, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        slots = meta.state_slots
        qsl = meta.query_start_loc.tolist()
        fresh = (meta.seq_lens - (meta.query_start_loc[1:] - meta.query_start_loc[:-1])) == 0
        conv_state, delta_state = state
        weight = self.conv1d.weight[:, 0, :]
        out = x.new_empty(n, spec.value_heads, spec.value_dim)
        nd = meta.num_decode_tokens
        if nd:  # one token each: all at once
            window = torch.cat([conv_state[slots[:nd]].masked_fill(fresh[:nd, None, None], 0),
                                mixed[:nd, :, None].to(conv_state.dtype)], dim=-1)
            conv_state[slots[:nd]] = window[..., 1:]
            q, k, v = self._qkv(delta_rule.conv_window(window.to(weight.dtype), weight)[..., 0].to(x.dtype))
            s = delta_state[slots[:nd]].masked_fill(fresh[:nd, None, None, None], 0)
            out[:nd] = delta_rule.step(s, q, k, v, g[:nd], beta[:nd].float()).to(x.dtype)
            delta_state[slots[:nd]] = s
        for i in range(nd, len(qsl) - 1):  # prompts (chunks of them): one sequence at a time
            lo, hi, slot = qsl[i], qsl[i + 1], int(slots[i])
            prev = conv_state[slot] if not fresh[i] else conv_state.new_zeros(conv_state.shape[1:])
            window = torch.cat([prev, mixed[lo:hi].t().to(conv_state.dtype)], dim=-1)
            conv_state[slot] = window[:, -prev.shape[-1]:]
            conv = delta_rule.conv_window(window[None].to(weight.dtype), weight)[0].t().to(x.dtype)
            q, k, v = self._qkv(conv)
            s = delta_state[slot] if not fresh[i] else delta_state.new_zeros(delta_state.shape[1:])
            o, delta_state[slot] = delta_rule.chunked(s, q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                      g[lo:hi].t(), beta[lo:hi].t().float())
            out[lo:hi] = o.transpose(0, 1).to(x.dtype)
        core = self.norm(out.view(-1, spec.value_dim), z.reshape(-1, spec.value_dim))
        return self.out_proj(core.view(n, self.value_size))

    def _qkv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        spec, n = self.spec, conv.shape[0]
        q, k, v = conv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return delta_rule.prepare(q.reshape(n, spec.key_heads, spec.key_dim), k.reshape(n, spec.key_heads, spec.key_dim),
                                  v.reshape(n, spec.value_heads, spec.value_dim), spec.value_heads)


class _GatedNorm(nn.Module):
    """RMSNorm of each head's output (its weight plain, not 1 + w), times SiLU(z) in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(z.float())).to(x.dtype)
