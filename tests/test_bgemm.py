"""The native bf16 GEMM (kernels/csrc/bgemm.cpp) against an fp32 product of the same bf16
values, and PackedLinear's choice of it. Where the CPU has no AVX512_BF16 the kernel is
not built: the op says so and PackedLinear keeps oneDNN."""

from __future__ import annotations

import pytest
import torch

from engine.models.packed_linear import PackedLinear
from kernels import cpu

pytestmark = pytest.mark.unit

BF16 = torch.bfloat16


def test_the_panels_hold_each_pair_of_k_side_by_side_per_channel():
    w = torch.arange(100 * 34, dtype=torch.float32).view(100, 34).to(BF16)  # 100 channels: 3 panels, 44 of zeros
    p = cpu.bgemm_pack(w)
    assert p.shape == (3, 17, 48, 2)
    for n, k in [(0, 0), (5, 7), (47, 33), (48, 0), (99, 20)]:
        assert p[n // 48, k // 2, n % 48, k % 2] == w[n, k]
    assert not p[2, :, 100 - 96:].any()
    with pytest.raises(RuntimeError, match="in_features must be even"):
        cpu.bgemm_pack(torch.zeros(4, 5, dtype=BF16))


@pytest.mark.parametrize("n,k", [(960, 576), (100, 34), (48, 2), (7, 1536)])
def test_every_row_count_against_the_fp32_product(n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).mul_(k ** -0.5).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    panels = cpu.bgemm_pack(w)
    if not cpu.bgemm_available():
        with pytest.raises(RuntimeError, match="needs AVX512_BF16"):
            cpu.bgemm(torch.zeros(1, k, dtype=BF16), panels, n, None)
        return
    for m in [0, 1, 7, 8, 9, 16, 63, 64, 65, 130]:
        # rows 2k apart: a strided view, as the engine's qkv slices are
        x = torch.randn(m, 2 * k, generator=gen).to(BF16)[:, :k]
        for b in (None, bias):
            want = x.float() @ w.float().T + (0 if b is None else b.float())
            got = cpu.bgemm(x, panels, n, b)
            assert got.dtype == BF16 and got.shape == (m, n)
            # fp32 accumulation, one rounding to bf16 at the end
            torch.testing.assert_close(got.float(), want.to(BF16).float(), rtol=1.6e-2, atol=1e-2)


def test_a_row_does_not_depend_on_its_batch():
    """Seeded sampling and preemption replay need a request's logits independent of who
    else is in the step: every row is one dot-product chain in k order, whatever M."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 576, generator=gen).to(BF16)
    panels = cpu.bgemm_pack(w)
    x = torch.randn(100, 576, generator=gen).to(BF16)
    if not cpu.bgemm_available():
        with pytest.raises(RuntimeError, match="needs AVX512_BF16"):
            cpu.bgemm(x, panels, 200, None)
        return
    full = cpu.bgemm(x, panels, 200, None)
    for lo, hi in [(0, 1), (3, 12), (37, 100), (64, 65)]:
        assert torch.equal(cpu.bgemm(x[lo:hi], panels, 200, None), full[lo:hi])


def test_packed_linear_takes_the_native_gemm_in_bf16_where_built():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).to(BF16)
    layer = PackedLinear(w, None)
    assert (layer.panels is not None) == cpu.bgemm_available()
    assert (layer.packed is None) == cpu.bgemm_available()
    x = torch.randn(2, 5, 64, generator=gen).to(BF16)  # leading dims beyond one
    torch.testing.assert_close(layer(x).float(), (x.float() @ w.float().T).to(BF16).float(), rtol=1.6e-2, atol=1e-2)
    assert PackedLinear(w.float(), None).panels is None  # fp32 stays on oneDNN
