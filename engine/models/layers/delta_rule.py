"""The gated delta rule (Gated DeltaNet, Yang, Kautz and Hatamizadeh, ICLR 2025), the
token mixer of Qwen3-Next's and Qwen3.5's linear-attention layers, in fp32 as transformers
computes it.

Each value head keeps a state S (key dim x value dim). A token decays it by exp(g), reads
what it already predicts for the token's key, and writes the difference, scaled by beta:

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q

One token at a time is the decode step (`step`, for a batch of sequences at once). A
prompt is taken in chunks (`chunked`): within a chunk the updates form a unit lower
triangular system whose solution gives every token's u at once, so a chunk costs a few
matrix products instead of a token loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """q and k L2-normed, q scaled by the key dim's root, all fp32, with each key head
    repeated for the value heads that share it: [n, heads, dim] each."""
    q, k, v = q.float(), k.float(), v.float()
    if q.shape[1] != heads:
        q = q.repeat_interleave(heads // q.shape[1], dim=1)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v


def step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
         beta: torch.Tensor) -> torch.Tensor:
    """One token for each of a batch of sequences, updating `state` [b, H, dk, dv] in
    place; q, k [b, H, dk], v [b, H, dv], g and beta [b, H]. Returns o [b, H, dv]."""
    b, h, dk, dv = state.shape
    flat = state.view(b * h, dk, dv)  # batched products: no temporary the size of the state
    state.mul_(g.exp()[..., None, None])
    predicted = torch.bmm(k.reshape(b * h, 1, dk), flat).view(b, h, dv)
    flat.baddbmm_(k.reshape(b * h, dk, 1), ((v - predicted) * beta[..., None]).reshape(b * h, 1, dv))
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv)


def chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens from `state` [H, dk, dv]: q, k [H, n, dk], v [H, n, dv], g
    and beta [H, n]. Returns (o [H, n, dv], the state after the last token).

    In a chunk with decay sums c_t = g_1 + ... + g_t, the state after token t is
    exp(c_t) S0 + sum_{s<=t} exp(c_t - c_s) k_s u_s^T, so u solves (I + L) u =
    beta v - W S0 with L_ts = beta_t exp(c_t - c_s) k_t.k_s below the diagonal and
    W_t = beta_t exp(c_t) k_t."""
    n = q.shape[1]
    out = v.new_empty(v.shape)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        qc, kc, vc, bc = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi, None]
        c = g[:, lo:hi].cumsum(-1)
        causal = torch.ones(hi - lo, hi - lo, dtype=torch.bool, device=q.device).tril()
        decay = (c[:, :, None] - c[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        kb = kc * bc
        system = (kb @ kc.transpose(-1, -2)) * decay  # its diagonal is taken as ones
        u = torch.linalg.solve_triangular(system, vc * bc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, kb * c.exp()[..., None], upper=False, unitriangular=True)
        u = u - w @ state
        out[:, lo:hi] = (qc * c.exp()[..., None]) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = c[:, -1:]
        state = state * last.exp()[..., None] + (kc * (last - c).exp()[..., None]).transpose(-1, -2) @ u
    return out, state


def conv_window(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution over [b, C, width] windows (the state's k - 1
    earlier inputs, then the new ones), with SiLU: [b, C, width - k + 1]."""
    return F.silu(F.conv1d(window, weight[:, None, :], groups=weight.shape[0]))
