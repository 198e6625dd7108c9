"""The native panel GEMM (kernels/csrc/gemm.cpp) in fp32 and bf16 against torch's product
of the same values, its gate/up form with silu(gate) * up in the epilogue against the GEMM
and silu_mul, and PackedLinear's choice of them. Where the CPU lacks the instructions
(AVX-512; AVX512_BF16 for bf16) the op says so and PackedLinear keeps oneDNN."""

from __future__ import annotations

import pytest
import torch

from engine.models.packed_linear import PackedLinear, glu_available, supported
from kernels import cpu


BF16 = torch.bfloat16
DTYPES = [torch.float32, BF16]


def test_the_panels_hold_each_step_of_k_side_by_side_per_channel():
    w = torch.arange(100 * 34, dtype=torch.float32).view(100, 34)  # 100 channels: 3 panels, 44 of zeros
    for dtype, kp in [(BF16, 2), (torch.float32, 1)]:
        p = cpu.gemm_pack(w.to(dtype))
        assert p.shape == (3, 34 // kp, 48, kp) and p.dtype == dtype
        for n, k in [(0, 0), (5, 7), (47, 33), (48, 0), (99, 20)]:
            assert p[n // 48, k // kp, n % 48, k % kp] == w[n, k].to(dtype)
        assert not p[2, :, 100 - 96:].any()
    with pytest.raises(RuntimeError, match="in_features must be even"):
        cpu.gemm_pack(torch.zeros(4, 5, dtype=BF16))
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        cpu.gemm_pack(torch.zeros(4, 4, dtype=torch.float16))


def expect_unavailable(dtype, k, panels, n):
    with pytest.raises(RuntimeError, match="needs AVX-512"):
        cpu.gemm(torch.zeros(1, k, dtype=dtype), panels, n, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(960, 576), (100, 34), (48, 2), (7, 1536)])
def test_every_row_count_against_torch(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).mul_(k ** -0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    panels = cpu.gemm_pack(w)
    if not cpu.gemm_available(dtype):
        return expect_unavailable(dtype, k, panels, n)
    for m in [0, 1, 7, 8, 9, 16, 63, 64, 65, 130, 300]:  # 300: AMX's second block of 256 rows, a partial tile
        # rows 2k apart: a strided view, as the engine's qkv slices are
        x = torch.randn(m, 2 * k, generator=gen).to(dtype)[:, :k]
        for b in (None, bias):
            want = x.double() @ w.double().T + (0 if b is None else b.double())
            got = cpu.gemm(x, panels, n, b)
            assert got.dtype == dtype and got.shape == (m, n)
            if dtype == BF16:  # fp32 accumulation, one rounding to bf16 at the end
                torch.testing.assert_close(got.float(), want.to(BF16).float(), rtol=1.6e-2, atol=1e-2)
            else:  # one fp32 chain per output: a few ulps of the sum's magnitude
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        cpu.gemm(torch.zeros(1, k, dtype=torch.float32 if dtype == BF16 else BF16), panels, n, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_does_not_depend_on_its_batch(dtype):
    """Seeded sampling and preemption replay need a request's logits independent of who
    else is in the step: every row is one dot-product chain in k order, whatever M."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 576, generator=gen).to(dtype)
    panels = cpu.gemm_pack(w)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    if not cpu.gemm_available(dtype):
        return expect_unavailable(dtype, 576, panels, 200)
    full = cpu.gemm(x, panels, 200, None)
    for lo, hi in [(0, 1), (3, 12), (37, 100), (64, 65), (250, 300)]:
        assert torch.equal(cpu.gemm(x[lo:hi], panels, 200, None), full[lo:hi])


def test_bf16_runs_on_amx_tiles_where_the_cpu_has_them():
    """On a Xeon with AMX the AVX-512 bf16 tile ran at a tenth of oneDNN's rate from 16
    rows up; there every bf16 weight whose in_features is a multiple of 32 runs on the
    tiles instead, at every row count (a row's values never depend on its batch: the
    tests above cover both paths where the CPU has both). Other weights, and fp32, keep
    the AVX-512 tile."""
    from pathlib import Path

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    amx = {"amx_tile", "amx_bf16"} <= set(flags) and cpu.gemm_available(BF16)
    assert cpu.gemm_tiles(BF16, 576) == amx and cpu.gemm_tiles(BF16, 1536) == amx
    assert not cpu.gemm_tiles(BF16, 34) and not cpu.gemm_tiles(torch.float32, 576)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_packed_linear_takes_the_native_gemm_where_built(dtype):
    """Native panels where the build has them, oneDNN's packing elsewhere, and where this CPU
    has neither for dtype (bf16 on AVX2) a refusal naming it: the loader asks `supported`
    first and keeps nn.Linear there (test_a_cpu_that_cannot_pack_bf16_keeps_plain_linears)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    if not supported(torch.device("cpu"), dtype):
        assert dtype == BF16  # fp32 packs on every CPU oneDNN runs on
        with pytest.raises(ValueError, match="cannot pack torch.bfloat16"):
            PackedLinear(w, None)
        return
    layer = PackedLinear(w, None)
    native = cpu.gemm_available(dtype)
    assert (layer.panels is not None) == native and (layer.packed is None) == native
    x = torch.randn(2, 5, 64, generator=gen).to(dtype)  # leading dims beyond one
    want = (x.double() @ w.double().T).to(dtype)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == BF16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x), want, **tol)
    if dtype == torch.float32:  # fp32 packs any in_features; bf16 needs whole pairs of k
        w = torch.randn(40, 33, generator=gen)
        odd = PackedLinear(w, None)
        assert (odd.panels is not None) == native
        x = torch.randn(3, 33, generator=gen)
        torch.testing.assert_close(odd(x), (x.double() @ w.double().T).float(), **tol)


def test_a_glu_panel_holds_gate_then_up_channels():
    i, k = 30, 4  # 30 outputs: two panels of 24 gate + 24 up channels, the second 18 short
    w = torch.arange(2 * i * k, dtype=torch.float32).view(2 * i, k)
    p = cpu.gemm_pack_glu(w)
    assert p.shape == (2, k, 48, 1)
    for g, c in [(0, 0), (0, 23), (1, 5)]:
        assert torch.equal(p[g, :, c, 0], w[24 * g + c])  # gate row
        assert torch.equal(p[g, :, 24 + c, 0], w[i + 24 * g + c])  # its up row
    assert not p[1, :, 6:24].any() and not p[1, :, 30:].any()
    with pytest.raises(RuntimeError, match="gate/up weight"):
        cpu.gemm_pack_glu(torch.zeros(5, 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("i,k", [(1536, 576), (40, 64), (100, 34)])
def test_glu_gemm_equals_the_gemm_then_silu_mul(dtype, i, k):
    """The fused epilogue rounds where the two ops round, so a model gives the same bits
    with it or without; partial last panels and tail rows included."""
    gen = torch.Generator().manual_seed(i + k)
    w = (torch.randn(2 * i, k, generator=gen) * k ** -0.5).to(dtype)
    bias = torch.randn(2 * i, generator=gen).to(dtype)
    plain, fused = cpu.gemm_pack(w), cpu.gemm_pack_glu(w)
    if not cpu.gemm_available(dtype):
        with pytest.raises(RuntimeError, match="needs AVX-512"):
            cpu.gemm_glu(torch.zeros(1, k, dtype=dtype), fused, i, None)
        return
    for m in [1, 7, 9, 64, 130]:
        x = (torch.randn(m, k, generator=gen) * 3).to(dtype)
        for b in (None, bias):
            got = cpu.gemm_glu(x, fused, i, b)
            assert got.shape == (m, i) and got.dtype == dtype
            assert torch.equal(got, cpu.silu_mul(cpu.gemm(x, plain, 2 * i, b)))
    with pytest.raises(RuntimeError, match="one value per weight row"):
        cpu.gemm_glu(x, fused, i, bias[:i])


def test_packed_linear_glu_returns_the_activation():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(2 * 64, 96, generator=gen), torch.randn(2 * 64, generator=gen)
    x = torch.randn(2, 5, 96, generator=gen)
    if not glu_available(torch.float32):
        with pytest.raises(ValueError, match="native fp32 GEMM"):
            PackedLinear(w, b, glu=True)
        return
    layer = PackedLinear(w, b, glu=True)
    y = x.double() @ w.double().T + b.double()
    want = torch.nn.functional.silu(y[..., :64]) * y[..., 64:]
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert not glu_available(BF16)  # bf16 keeps the separate pass (packed_linear.glu_available)
    with pytest.raises(ValueError, match="native fp32 GEMM"):
        PackedLinear(w.to(BF16), None, glu=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden, inter", [(100, 40), (128, 64), (128, 40)])  # on AMX: neither, both, gate/up on tiles
def test_the_grouped_expert_call_equals_each_experts_own_gemms(dtype, hidden, inter):
    """moe_glu runs every expert of a layer in one call: each expert's rows give the bits
    of its own gemm_glu then gemm, whatever the others hold: experts with no row, one
    row, tail rows and several row blocks, partial last panels. Offsets that do not
    describe the rows are refused."""
    gen = torch.Generator().manual_seed(7)
    experts = 6
    gate_up = [(torch.randn(2 * inter, hidden, generator=gen) * 0.2).to(dtype) for _ in range(experts)]
    down = [(torch.randn(hidden, inter, generator=gen) * 0.2).to(dtype) for _ in range(experts)]
    counts = [3, 0, 70, 1, 0, 9]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    x = torch.randn(sum(counts), hidden, generator=gen).to(dtype)
    if not cpu.gemm_available(dtype):
        with pytest.raises(RuntimeError, match="needs AVX-512"):
            cpu.moe_glu(x, offsets, torch.zeros(1, 1, 1, 48, 1), torch.zeros(1, 1, 1, 48, 1), hidden)
        return
    stacked = (torch.stack([cpu.gemm_pack_glu(w) for w in gate_up]), torch.stack([cpu.gemm_pack(w) for w in down]))
    got = cpu.moe_glu(x, offsets, *stacked, hidden)
    assert got.shape == (sum(counts), hidden) and got.dtype == dtype
    for e in range(experts):
        rows = x[offsets[e]:offsets[e + 1]]
        if len(rows):
            want = cpu.gemm(cpu.gemm_glu(rows, cpu.gemm_pack_glu(gate_up[e]), inter, None), cpu.gemm_pack(down[e]),
                            hidden, None)
            assert torch.equal(got[offsets[e]:offsets[e + 1]], want)
    assert cpu.moe_glu(x[:0], torch.zeros(experts + 1, dtype=torch.long), *stacked, hidden).shape == (0, hidden)
    for bad, words in ((offsets.flip(0), "from 0 to the row count"), (offsets[:-1], r"\[E \+ 1\]"),
                       (torch.tensor([0, 5, 3, 80, 80, 80, 83]), "never decrease")):
        with pytest.raises(RuntimeError, match=words):
            cpu.moe_glu(x, bad, *stacked, hidden)
