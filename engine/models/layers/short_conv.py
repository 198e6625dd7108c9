"""LFM2's short-convolution layer over per-sequence state slots instead of a KV cache: the
input projected to B, C and x, B * x through a causal depthwise convolution of a few taps,
gated by C. A sequence's past is its last k - 1 values of B * x, whatever its length
(engine/state_slots.py holds them; a sequence starting at position 0 starts from zeros).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.arch import ShortConvSpec
from engine.models.layers.attention import AttnMetadata


class _Conv(nn.Module):
    """Holds the depthwise kernel under the checkpoint's name (conv.weight, [C, 1, k])."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)


class ShortConv(nn.Module):
    def __init__(self, hidden: int, spec: ShortConvSpec) -> None:
        super().__init__()
        self.spec = spec
        self.hidden = hidden
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=False)
        self.conv = _Conv(hidden, spec.kernel)
        self.out_proj = nn.Linear(hidden, hidden, bias=False)
        self._taps: torch.Tensor | None = None  # the kernel as [k, C], taken once loaded

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, ...], meta: AttnMetadata) -> torch.Tensor:
        b, c, h = self.in_proj(x).split(self.hidden, dim=-1)
        if self._taps is None or self._taps.dtype != self.conv.weight.dtype:
            self._taps = self.conv.weight[:, 0, :].t().contiguous()
        conv = meta.backend.conv(state[0], meta.state_slots, meta.state_fresh, meta.state_starts, b * h, self._taps,
                                 False)
        return self.out_proj(c * conv)
