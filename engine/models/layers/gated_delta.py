"""Qwen3.5's and Qwen3-Next's linear-attention layer (Gated DeltaNet; Yang, Kautz and
Hatamizadeh, ICLR 2025) over per-sequence state slots instead of a KV cache.

A sequence's whole past lives in two tensors per layer, whatever its length: the last
k - 1 inputs of the causal convolution, and the gated delta rule's fp32 state per value
head, a dk x dv matrix that each token decays, corrects towards its value and reads
(kernels/reference.py's delta_rule says how; the native kernel does it in one pass). The engine gives each running sequence a slot
(engine/state_slots.py); a sequence whose first new token is at position 0 starts from
zeros, so a preempted one recomputed from its prompt needs nothing reset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.arch import LinearAttnSpec
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
        self._taps: torch.Tensor | None = None  # conv1d's weight as [k, C], taken once loaded
        self.dt_bias = nn.Parameter(torch.empty(spec.value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(spec.value_heads), requires_grad=False)
        self.norm = _GatedNorm(spec.value_dim, eps)
        self.out_proj = nn.Linear(self.value_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata) -> torch.Tensor:
        spec, n = self.spec, x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.in_sizes, dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        slots, qsl = meta.state_slots, meta.query_start_loc
        fresh = (meta.seq_lens - (qsl[1:] - qsl[:-1])) == 0  # first new token at position 0
        conv_state, delta_state = state  # [slots, k - 1, C] and [slots, H, dk, dv]
        weight = self.conv1d.weight[:, 0, :]
        if self._taps is None or self._taps.dtype != weight.dtype:
            self._taps = weight.t().contiguous()  # [k, C]: the kernel reads each tap's channels in a row
        starts = qsl.long()
        conv = meta.backend.conv(conv_state, slots, fresh, starts, mixed, self._taps)
        q, k, v = self._qkv(conv)
        out = meta.backend.delta_rule(delta_state, slots, fresh, starts, q, k, v, g, beta.float())
        core = self.norm(out.to(x.dtype).view(-1, spec.value_dim), z.reshape(-1, spec.value_dim))
        return self.out_proj(core.view(n, self.value_size))

    def _qkv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k L2-normed, q scaled by the key dim's root, all fp32, each key head
        repeated for the value heads that share it: [n, heads, dim] each."""
        spec, n = self.spec, conv.shape[0]
        q, k, v = conv.float().split([self.key_size, self.key_size, self.value_size], dim=-1)
        q, k = q.reshape(n, spec.key_heads, spec.key_dim), k.reshape(n, spec.key_heads, spec.key_dim)
        if spec.key_heads != spec.value_heads:
            q = q.repeat_interleave(spec.value_heads // spec.key_heads, dim=1)
            k = k.repeat_interleave(spec.value_heads // spec.key_heads, dim=1)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return (q * spec.key_dim ** -0.5).contiguous(), k.contiguous(), v.reshape(n, spec.value_heads, spec.value_dim)


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
