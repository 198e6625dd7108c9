"""The decoder's fused elementwise ops (add + RMSNorm, q/k norm + rotary, SiLU-mul) in both
forms the fused layer runs: the native CPU kernels (kernels/cpu.py) and the Triton ones
(kernels/triton_fused.py; in the interpreter here, on the device under KERNELS_NATIVE=1 in
scripts/gpu_check.sh). Each against torch's own ops in the model dtype's order."""

from __future__ import annotations

import pytest

from tests.support.kernel_checks import BF16, DEVICE, F16, F32, NATIVE  # first: sets TRITON_INTERPRET

import torch  # noqa: E402

from engine.models.layers import rotary  # noqa: E402
from kernels import cpu, triton_fused  # noqa: E402

# On a CUDA device only the Triton form runs; the CPU forms are the CI's.
IMPLS = {"triton": triton_fused} if NATIVE else {"native": cpu, "triton": triton_fused}


def on(impl: str, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    device = "cpu" if impl == "native" else DEVICE
    return [None if t is None else t.to(device) for t in tensors]


def interpreted_bf16(impl: str, dtype: torch.dtype) -> bool:
    """Triton's interpreter rounds fp32 -> bf16 toward zero where a GPU rounds to nearest:
    there each rounding may be one unit off, and the norm's three roundings stack. Exact
    bf16 is checked on the device."""
    return impl == "triton" and not NATIVE and dtype == BF16


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [BF16, F16, F32])
@pytest.mark.parametrize("n", [37, 576])  # 37: a vector loop's tail, a power-of-two block's padding
def test_silu_mul_and_add_rms_norm_match_torch(impl, dtype, n):
    """silu rounded to the dtype before the product, the residual add in the dtype, the norm's
    statistics in fp32 and the weight applied after rounding back. The native silu_mul bit
    for bit in bf16 and fp16 (one rounding hides fast_exp's 2e-7), Triton's within a unit
    of the last place (its exp is the device's approximate one); the norm within one unit
    (its fp32 sum of squares runs in another order than torch's mean)."""
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(n)
    exact = dtype != F32 and impl == "native"
    ulp = {BF16: 2**-7, F16: 2**-10, F32: 1e-5}[dtype]
    gate_up = (torch.randn(33, 2 * n, generator=gen) * 4).to(dtype)
    g, u = gate_up[:, :n].float(), gate_up[:, n:].float()
    want = (torch.nn.functional.silu(g).to(dtype).float() * u).to(dtype)
    got = ops.silu_mul(*on(impl, gate_up)).cpu()
    tol = 0 if exact else (1e-5 if dtype == F32 else (2 if interpreted_bf16(impl, dtype) else 1) * ulp)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)

    x, residual = torch.randn(33, n, generator=gen).to(dtype), torch.randn(33, n, generator=gen).to(dtype)
    weight = torch.randn(n, generator=gen).to(dtype)
    h = x + residual
    hf = h.float()
    want = (weight.float() * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()).to(dtype)
    xd, rd, wd = on(impl, x, residual, weight)
    got = ops.add_rms_norm(xd, rd, wd, 1e-5).cpu()
    if interpreted_bf16(impl, dtype):
        torch.testing.assert_close(rd.cpu(), h, atol=0, rtol=ulp)
    else:
        assert torch.equal(rd.cpu(), h)  # updated in place
    torch.testing.assert_close(got, want, atol=1e-6, rtol=4 * ulp if interpreted_bf16(impl, dtype) else ulp)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rope_qk_norms_each_head_first(impl, dtype):
    """Qwen3's and Gemma 3's per-head q/k RMSNorm inside the rotary's pass: each head
    normed in fp32, times its own weight, rounded once to the dtype, then turned (a
    partial rotary here, so the unturned dims show the norm too), as the eager
    operations give it within fp32 rounding. head_dim 80 leaves a power-of-two block's
    padding unused."""
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(12)
    n, heads, kv_heads, d, rot = 5, 4, 2, 80, 32
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen) * 3).to(dtype)
    cos, sin = torch.randn(n, rot, generator=gen).to(dtype), torch.randn(n, rot, generator=gen).to(dtype)
    norm = torch.rand(heads + kv_heads, d, generator=gen) + 0.5
    qk = qkv[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d).float()
    normed = (qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + 1e-6) * norm).to(dtype)
    # the module path's rotate-half, in fp32 and rounded once, as the fused forms compute it
    turned = rotary.rotate(normed.float(), cos.float()[:, None], sin.float()[:, None]).to(dtype)
    got_q, got_k = (t.cpu() for t in ops.rope_qk(*on(impl, qkv, cos, sin), heads, kv_heads, d,
                                                   *on(impl, norm), 1e-6))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == F32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got_q, turned[:, :heads], **tol)
    torch.testing.assert_close(got_k, turned[:, heads:], **tol)
    plain_q, _ = ops.rope_qk(*on(impl, qkv, cos, sin), heads, kv_heads, d)
    assert not torch.allclose(got_q, plain_q.cpu(), atol=0.1)


@pytest.mark.parametrize("impl", IMPLS)
def test_add_rms_norm_with_an_fp32_weight_rounds_once_after_it(impl):
    """Gemma's norm in bf16: (x / rms(x)) times the fp32 weight (1 + w), rounded once,
    where Llama's rounds the normalised x before its bf16 weight multiplies it."""
    ops = IMPLS[impl]
    gen = torch.Generator().manual_seed(21)
    x, residual = torch.randn(3, 80, generator=gen).to(BF16), torch.randn(3, 80, generator=gen).to(BF16)
    weight = torch.randn(80, generator=gen) * 0.3 + 1  # fp32
    summed = residual + x
    h = summed.float()
    want = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(BF16)
    xd, rd, wd = on(impl, x, residual, weight)
    got = ops.add_rms_norm(xd, rd, wd, 1e-6).cpu()
    torch.testing.assert_close(rd.cpu(), summed, atol=0, rtol=2**-7)  # the residual add, in bf16, in place
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.01)
    early = ops.add_rms_norm(None, *on(impl, summed.clone(), weight.to(BF16)), 1e-6).cpu()  # Llama's order
    assert (got.float() - want.float()).abs().sum() < (early.float() - want.float()).abs().sum()
