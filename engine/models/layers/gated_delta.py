"""Qwen3.5's and Qwen3-Next's linear-attention layer (Gated DeltaNet; Yang, Kautz and
Hatamizadeh, ICLR 2025) over per-sequence state slots instead of a KV cache.

A sequence's whole past lives in two tensors per layer, whatever its length: the last
k - 1 inputs of the causal convolution, and the gated delta rule's fp32 state per value
head, a dk x dv matrix that each token decays, corrects towards its value and reads
(kernels/reference.py's delta_rule says how; the native kernel does it in one pass). The
engine gives each running sequence a slot (engine/state_slots.py); a sequence whose first
new token is at position 0 starts from zeros, so a preempted one recomputed from its
prompt needs nothing reset.
"""

from __future__ import annotations

import torch
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
        mixed, z, b, a = self.in_proj(x).split(self.in_sizes, dim=-1)
        slots, fresh, starts = meta.state_slots, meta.state_fresh, meta.state_starts
        conv_state, delta_state = state  # [slots, k - 1, C] and [slots, H, dk, dv]
        if self._taps is None or self._taps.dtype != self.conv1d.weight.dtype:
            self._taps = self.conv1d.weight[:, 0, :].t().contiguous()  # [k, C]: each tap's channels in a row
        conv = meta.backend.conv(conv_state, slots, fresh, starts, mixed, self._taps)
        core = meta.backend.gated_delta_rule(delta_state, slots, fresh, starts, conv, a, b, z, self.A_log, self.dt_bias,
                                             self.norm.weight, self.spec.key_heads, self.norm.eps)
        return self.out_proj(core)


class _GatedNorm(nn.Module):
    """The gated RMSNorm's weight (plain, not 1 + w) and epsilon, under the checkpoint's
    name; the backend's gated_delta_rule applies it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
