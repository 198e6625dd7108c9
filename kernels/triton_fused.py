"""Triton forms of the decoder's fused elementwise ops (add + RMSNorm, q/k norm + rotary,
SiLU-mul), with the signatures and rounding of the native CPU ones in kernels/cpu.py, so
that DecoderLayer.forward_fused runs on either.

Why: eagerly, a layer's norms, rotary and activation are about forty small kernels. On a
lent H200 a batch-1 decode step of a Qwen3-1.7B shape, replayed from a CUDA graph, spent
more device time in them (about 1.8 ms) than in its GEMMs (1.2 ms): a graph removes the
launches' host cost, not the kernels' own few microseconds each (benchmarks/LOG.md,
session 37). Here each is one kernel a layer, one pass over its rows.

Math is in fp32 with the eager layer's roundings: the residual sum rounded to the model
dtype before its statistics; the normalised row rounded before a model-dtype weight
multiplies it, or (an fp32 weight: Gemma's, gpt-oss's) multiplied first and rounded once;
SiLU rounded before it multiplies `up`. The rotary's products are summed in fp32 and
rounded once, where eager torch rounds each product: the native kernels do the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps,
                         ADD: tl.constexpr, LATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    base = row * n
    h = tl.load(res_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        h = h + tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        rounded = h.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + base + offs, rounded, mask=mask)
        h = rounded.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(h * h, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LATE:
        y = h * inv * w
    else:
        y = w * (h * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, when x is given); returns weight * rmsnorm(residual). An
    fp32 weight with a lower-precision residual multiplies before the rounding."""
    if not (residual.is_contiguous() and weight.is_contiguous()) or (x is not None and not x.is_contiguous()):
        raise ValueError("add_rms_norm: contiguous tensors only")
    if weight.dtype not in (residual.dtype, torch.float32):
        raise ValueError(f"add_rms_norm: the weight is {residual.dtype} or fp32, got {weight.dtype}")
    n = residual.shape[-1]
    rows = residual.numel() // n
    out = torch.empty_like(residual)
    if rows:
        block = triton.next_power_of_2(n)
        late = weight.dtype == torch.float32 and residual.dtype != torch.float32
        _add_rms_norm_kernel[(rows,)](residual if x is None else x, residual, weight, out, n, eps,
                                      ADD=x is not None, LATE=late, BLOCK=block, num_warps=_warps(block))
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(gu_ptr + row * 2 * n + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n + offs, (act * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gate_up = [gate | up] along the last dimension."""
    gu = gate_up.contiguous()
    n = gu.shape[-1] // 2
    rows = gu.numel() // (2 * n) if n else 0
    out = torch.empty(*gu.shape[:-1], n, dtype=gu.dtype, device=gu.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gu, out, n, BLOCK=block, num_warps=_warps(block))
    return out


@triton.jit
def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, norm_ptr, q_ptr, k_ptr, row_stride, eps,
                    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                    NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    turns = offs < ROT
    half = ROT // 2
    partner = tl.where(offs < half, offs + half, offs - half)  # the other dim of a turning pair
    src = qkv_ptr + t * row_stride + h * D
    x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=turns, other=0.0).to(tl.float32)
    if NORM:  # the head RMS-normed in fp32, times its weight, rounded once
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(norm_ptr + h * D + offs, mask=mask, other=0.0)
        wp = tl.load(norm_ptr + h * D + partner, mask=turns, other=0.0)
        x = (x * inv * w).to(q_ptr.dtype.element_ty).to(tl.float32)
        xp = (xp * inv * wp).to(q_ptr.dtype.element_ty).to(tl.float32)
    c = tl.load(cos_ptr + t * ROT + offs, mask=turns, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + t * ROT + offs, mask=turns, other=0.0).to(tl.float32)
    sign = tl.where(offs < half, -1.0, 1.0)
    y = tl.where(turns, x * c + sign * xp * s, x).to(q_ptr.dtype.element_ty)
    if h < H:
        tl.store(q_ptr + (t * H + h) * D + offs, y, mask=mask)
    else:
        tl.store(k_ptr + (t * HKV + h - H) * D + offs, y, mask=mask)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int, norm: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary q [n, H, D] and k [n, Hkv, D] from a fused qkv projection; cos/sin [n, rot],
    rot <= D: a partial rotary turns the first rot dims of each head and keeps the rest.
    `norm` (fp32 [H + Hkv, D]): each head RMS-normed (fp32, times its weight, rounded
    once) before it turns."""
    n, rot = qkv.shape[0], cos.shape[-1]
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < (num_heads + num_kv_heads) * head_dim:
        raise ValueError("rope_qk: qkv is [n, (H + 2 Hkv) D] with dense rows")
    if rot > head_dim or rot % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("rope_qk: rotary dims even and at most head_dim, cos/sin [n, rot] contiguous")
    if norm is not None and (norm.dtype != torch.float32 or norm.numel() != (num_heads + num_kv_heads) * head_dim):
        raise ValueError("rope_qk: norm is fp32 [H + Hkv, D]")
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(n, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n:
        block = triton.next_power_of_2(head_dim)
        _rope_qk_kernel[(n, num_heads + num_kv_heads)](
            qkv, cos, sin, norm.contiguous() if norm is not None else qkv, q, k, qkv.stride(0), eps,
            H=num_heads, HKV=num_kv_heads, D=head_dim, ROT=rot, NORM=norm is not None, BLOCK_D=block,
            num_warps=_warps(block))
    return q, k
