"""The few-rows kernel with activations rounded to int8 (kernels/csrc/quant_a8.cpp) against
its float64 oracle (kernels/quant.py a8_reference), and the rounding's error against the
exact product, on every block type it streams."""

from __future__ import annotations

import pytest
import torch

from kernels import quant
from tests.unit.test_quant_kernels import STREAMED, weights


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows as a model's are: mostly small, one outlier channel far above the rest (which
    sets its group's step), and a group of exact zeros."""
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 40
    x[:, 32:64] = 0
    return x


def fp32_bound(x: torch.Tensor, dense: torch.Tensor, k: int) -> torch.Tensor:
    return 4 * k ** 0.5 * 2.0 ** -24 * (x.double().abs() @ dense.double().abs().T)


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda t: quant.FORMATS[t].name)
def test_int8_activations_give_the_rounded_product(qtype):
    gen = torch.Generator().manual_seed(qtype + 40)
    # 32-block types: eight blocks at a time and a tail of three; two whole panels of four
    # output channels and a ragged one.
    k, n = (352 if quant.FORMATS[qtype].block == 32 else 512), 2 * 4 + 3
    w, scales = weights(qtype, n, k, gen)
    dense = quant.dequantize(w, scales, qtype, k)
    streams = quant.few_rows_available(qtype, k)
    for m in (1, 2, 3, 4, 5):
        x = activations(m, k, gen)
        got = quant.qlinear(x, w, scales, qtype, k, kernel="few" if streams else "auto",
                            int8_activations=True).double()
        if not streams:  # no AVX2: the fp32 many-rows kernel, exact
            want = x.double() @ dense.double().T
        else:
            want = quant.a8_reference(x, w, scales, qtype, k)
        bound = fp32_bound(quant.round_activations(x).abs() + x.abs(), dense, k)
        assert torch.all((got - want).abs() <= bound), (m, (got - want).abs().max())


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda t: quant.FORMATS[t].name)
def test_the_rounding_costs_at_most_half_a_step_per_activation(qtype):
    """A user's guarantee: each output is off the exact product by at most the sum over K
    of |w| times half its group's step (max|x| / 254), plus fp32's own rounding."""
    gen = torch.Generator().manual_seed(qtype + 50)
    k, n, m = 512, 9, 3
    w, scales = weights(qtype, n, k, gen)
    dense = quant.dequantize(w, scales, qtype, k).double()
    x = activations(m, k, gen)
    got = quant.qlinear(x, w, scales, qtype, k, kernel="few" if quant.few_rows_available(qtype, k) else "auto",
                        int8_activations=True).double()
    exact = x.double() @ dense.T
    half_step = (x.reshape(m, -1, 32).abs().amax(-1) / 254).repeat_interleave(32, dim=1).double()
    bound = half_step @ dense.abs().T * (1 + 1e-6) + fp32_bound(x.abs() * 2, dense, k)
    err = (got - exact).abs()
    assert torch.all(err <= bound), (err / bound).max()
    assert err.max() > 0 or not quant.few_rows_available(qtype, k)  # the rounding did happen


def test_rounded_activations_are_int8_steps_of_their_group():
    x = activations(2, 128, torch.Generator().manual_seed(3))
    r = quant.round_activations(x)
    step = x.reshape(2, -1, 32).abs().amax(-1, keepdim=True) / 127
    q = r.reshape(2, -1, 32) / torch.where(step > 0, step, 1)
    assert torch.allclose(q, q.round(), atol=1e-3) and q.abs().max() <= 127 + 1e-3
    assert torch.all(r[:, 32:64] == 0)  # a group of zeros stays zeros (no 0 / 0)
    assert torch.all((r - x).abs().reshape(2, -1, 32) <= step / 2 * (1 + 1e-5))


def test_many_rows_keep_fp32_activations():
    """Past the few-rows kernel's rows (prefill, large batches) the product stays exact."""
    gen = torch.Generator().manual_seed(9)
    k, n = 256, 20
    w, _ = weights(quant.Q4_K, n, k * 2, gen)
    x = torch.randn(64, 2 * k, generator=gen)
    assert torch.equal(quant.qlinear(x, w, None, quant.Q4_K, 2 * k, int8_activations=True),
                       quant.qlinear(x, w, None, quant.Q4_K, 2 * k))
