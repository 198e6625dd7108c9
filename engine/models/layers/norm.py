"""RMSNorm, in the forms checkpoints use, Cohere's bias-free LayerNorm, and torch's own
LayerNorm with its bias (StarCoder2, StableLM; Nemotron's with a (1 + w) weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) times the weight, or (Gemma, `offset` 1) times (1 + weight).

    Llama rounds the normalised x to the activation dtype before the weight multiplies it;
    Gemma and OLMo 2 (`late_cast`) multiply in fp32 and round after. Each form follows its
    own reference, so each matches transformers in every dtype."""

    def __init__(self, size: int, eps: float, offset: float = 0.0, late_cast: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size) if offset else torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.late_cast = late_cast or bool(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.late_cast:
            return (h * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def effective_weight(self) -> torch.Tensor:
        """The weight the normalised x is multiplied by, for the fused kernels: in fp32
        where the form multiplies before rounding (late_cast, as the native kernels do
        for an fp32 weight), else in the model dtype."""
        if self.late_cast:
            return self.weight.float() + self.offset
        return self.weight + self.offset if self.offset else self.weight


class LayerNorm(nn.Module):
    """Cohere's: x less its mean, over its standard deviation, times the weight; no bias;
    in fp32, rounded after the weight, as its reference does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class BiasLayerNorm(nn.LayerNorm):
    """torch's LayerNorm (fp32 inside, in every dtype) as the references call it, with the
    weight plus `offset` (Nemotron's LayerNorm1P: 1 + w)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__(size, eps=eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + self.offset if self.offset else self.weight
        return F.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)


def hidden_norm(config, spec) -> RMSNorm | LayerNorm | BiasLayerNorm:
    """A norm over the hidden size, of the kind and form the architecture uses."""
    if spec.norm_kind == "layer":
        return LayerNorm(config.hidden_size, config.layer_norm_eps)
    if spec.norm_kind == "layer_bias":  # StarCoder2's norm_epsilon, Nemotron's norm_eps, StableLM's
        eps = getattr(config, "norm_epsilon", None) or getattr(config, "norm_eps", None) or config.layer_norm_eps
        return BiasLayerNorm(config.hidden_size, eps, spec.norm_offset)
    return RMSNorm(config.hidden_size, config.rms_norm_eps, spec.norm_offset, spec.late_cast)
