"""The quantized GEMM kernels (kernels/csrc/quant.cpp) against their torch reference
(kernels/quant.py), and the reference against the `gguf` package's own dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import quant

pytestmark = pytest.mark.unit

TYPES = [quant.Q8_0, quant.Q4_0, quant.Q4_1, quant.Q4_K, quant.Q6_K]


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes in the block layout, with the fp16 scales set to sane values (random
    bytes would make infs and NaNs)."""
    f = quant.FORMATS[qtype]
    blocks = torch.randint(0, 256, (n * (k // f.block), f.bytes), dtype=torch.uint8, generator=gen)
    halves = {quant.Q8_0: [0], quant.Q4_0: [0], quant.Q4_1: [0, 2], quant.Q4_K: [0, 2], quant.Q6_K: [208]}[qtype]
    for at in halves:
        scale = (torch.rand(blocks.shape[0], generator=gen) * 0.02 + 0.001).to(torch.float16)
        blocks[:, at:at + 2] = scale.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, quant.row_bytes(qtype, k))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: quant.FORMATS[t].name)
def test_the_reference_is_the_gguf_packages_dequantization(qtype):
    gen = torch.Generator().manual_seed(qtype)
    w = random_blocks(qtype, 5, 512, gen)
    want = gguf.dequantize(w.numpy(), gguf.GGMLQuantizationType(qtype)).reshape(5, 512)
    got = quant.dequantize(w, None, qtype, 512)
    np.testing.assert_array_equal(got.numpy(), want.astype(np.float32))


@pytest.mark.parametrize("qtype", TYPES + [quant.INT8_ROWS], ids=lambda t: quant.FORMATS[t].name)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 65, 130])
def test_qlinear_matches_the_reference_on_ragged_shapes(qtype, m):
    gen = torch.Generator().manual_seed(1000 * qtype + m)
    k = 512 if quant.FORMATS[qtype].block == 256 else 96
    n = 4 * 5 + 3  # a ragged last panel of output channels
    if qtype == quant.INT8_ROWS:
        k += 5 if m % 2 == 0 else 0  # odd m: the few-rows path (K of 32s); even m: K not a multiple of 8
        w, scales = quant.quantize_int8(torch.randn(n, k, generator=gen))
    else:
        w, scales = random_blocks(qtype, n, k, gen), None
    x = torch.randn(m, k, generator=gen)
    dense = quant.dequantize(w, scales, qtype, k).double()
    want = x.double() @ dense.T
    got = quant.qlinear(x, w, scales, qtype, k).double()
    # fp32 sums in another order than float64's: a few sqrt(K) roundings of the terms' magnitude.
    bound = 4 * k ** 0.5 * 2.0 ** -24 * (x.double().abs() @ dense.abs().T)
    assert torch.all((got - want).abs() <= bound), (got - want).abs().max()


@pytest.mark.parametrize("qtype", TYPES + [quant.INT8_ROWS], ids=lambda t: quant.FORMATS[t].name)
def test_dequant_rows_is_an_embedding_lookup(qtype):
    gen = torch.Generator().manual_seed(qtype + 7)
    k = 256
    if qtype == quant.INT8_ROWS:
        w, scales = quant.quantize_int8(torch.randn(40, k, generator=gen))
    else:
        w, scales = random_blocks(qtype, 40, k, gen), None
    ids = torch.tensor([3, 0, 39, 3, 17])
    got = quant.dequant_rows(w, scales, ids, qtype, k)
    torch.testing.assert_close(got, quant.dequantize(w, scales, qtype, k)[ids], rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q6_K, quant.INT8_ROWS], ids=lambda t: quant.FORMATS[t].name)
def test_many_rows_go_through_onednn_whole_and_in_slices(qtype, monkeypatch):
    """From MANY_ROWS on, QuantLinear multiplies a dequantized weight with oneDNN; a matrix
    larger than the scratch (the head) goes in slices of output channels."""
    from engine.models import quantize

    gen = torch.Generator().manual_seed(qtype + 3)
    n, k = 40, 256
    if qtype == quant.INT8_ROWS:
        w, scales = quant.quantize_int8(torch.randn(n, k, generator=gen))
    else:
        w, scales = random_blocks(qtype, n, k, gen), None
    bias = torch.randn(n, generator=gen)
    layer = quantize.QuantLinear(w, scales, qtype, k, bias)
    x = torch.randn(70, k, generator=gen)
    dense = quant.dequantize(w, scales, qtype, k).double()
    want = x.double() @ dense.T + bias.double()
    bound = 4 * k ** 0.5 * 2.0 ** -24 * (x.double().abs() @ dense.abs().T + bias.double().abs())
    for scratch in (quantize.SCRATCH_VALUES, 16 * k):  # whole; slices of 16 channels
        monkeypatch.setattr(quantize, "SCRATCH_VALUES", scratch)
        got = layer(x).double()
        assert torch.all((got - want).abs() <= bound), (scratch, (got - want).abs().max())


def test_int8_is_per_channel_symmetric_and_close():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(64, 300, generator=gen) * torch.logspace(-3, 1, 64)[:, None]  # channels of any scale
    q, scales = quant.quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scales.shape == (64,)
    err = (quant.dequantize(q, scales, quant.INT8_ROWS, 300) - w).abs().amax(dim=1)
    assert torch.all(err <= scales / 2 * (1 + 1e-5))  # half a step per channel, at most (and fp32 rounding)


def test_bad_shapes_are_refused():
    w = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="row_bytes|bytes"):
        quant.qlinear(torch.zeros(1, 64), w, None, quant.Q4_1, 64)  # 64 needs 40 bytes a row
    with pytest.raises(RuntimeError, match="multiple"):
        quant.qlinear(torch.zeros(1, 40), torch.zeros(4, 25, dtype=torch.uint8), None, quant.Q4_1, 40)
