"""Drawing a token from a distribution with a single uniform: the sampler's last stage, and
the replacement draw of a rejected speculative token."""

from __future__ import annotations

import torch


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability passes u[i] times the row's total.

    One uniform per row instead of one per vocabulary entry: drawing 49k numbers a row
    from torch's CPU generator cost more than the model's step at 64 rows. The search goes
    in two levels (blocks of 1024 tokens, then within the block) with the sums in
    float64, so neither a long float32 prefix sum nor a pass over the whole vocabulary
    in float64 is needed; rounding cannot give a token a probability it does not have,
    and a token of probability 0 is never chosen.
    """
    rows, vocab = probs.shape
    block = 1024
    blocks = -(-vocab // block)
    if blocks * block != vocab:
        probs = torch.nn.functional.pad(probs, (0, blocks * block - vocab))
    parts = probs.view(rows, blocks, block)
    cdf = parts.sum(dim=-1).double().cumsum(dim=-1)
    target = _below(u[:, None] * cdf[:, -1:], cdf[:, -1:])
    j = torch.searchsorted(cdf, target, right=True).clamp_max_(blocks - 1)  # a block with mass
    target = target - torch.where(j > 0, cdf.gather(1, (j - 1).clamp_min(0)), 0.0)
    inner = parts[torch.arange(rows, device=probs.device), j[:, 0]].double().cumsum(dim=-1)
    i = torch.searchsorted(inner, _below(target, inner[:, -1:]), right=True).clamp_max_(block - 1)
    # A row of NaNs (which the sampler ends, sampler.not_finite) would land in the padding.
    return (j * block + i)[:, 0].clamp_max_(vocab - 1)


def _below(target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """target, kept under total: the search then lands on a token that has probability."""
    return torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
