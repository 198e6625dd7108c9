"""The quantized GEMM kernels (kernels/csrc/quant.cpp, qgemm.cpp) against their torch reference
(kernels/quant.py), and the reference against the `gguf` package's own dequantization."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu, quant


TYPES = [quant.Q8_0, quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.MXFP4, quant.Q4_K, quant.Q5_K, quant.Q6_K]


def random_blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes in the block layout, with the fp16 scales set to sane values (random
    bytes would make infs and NaNs), and MXFP4's scale bytes 2^-9 to 2^-5."""
    f = quant.FORMATS[qtype]
    blocks = torch.randint(0, 256, (n * (k // f.block), f.bytes), dtype=torch.uint8, generator=gen)
    if qtype == quant.MXFP4:
        blocks[:, 0] = torch.randint(118, 123, (blocks.shape[0],), dtype=torch.uint8, generator=gen)
    halves = {quant.Q8_0: [0], quant.Q4_0: [0], quant.Q4_1: [0, 2], quant.Q5_0: [0], quant.Q5_1: [0, 2],
              quant.MXFP4: [], quant.Q4_K: [0, 2], quant.Q5_K: [0, 2], quant.Q6_K: [208]}[qtype]
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


# The few-rows kernel's types (K a multiple of 32 for int8 rows), built where the CPU has AVX2.
STREAMED = TYPES + [quant.INT8_ROWS]


def weights(qtype: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    if qtype == quant.INT8_ROWS:
        return quant.quantize_int8(torch.randn(n, k, generator=gen))
    return random_blocks(qtype, n, k, gen), None


def check_product(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None, qtype: int, k: int,
                  got: torch.Tensor) -> None:
    dense = quant.dequantize(w, scales, qtype, k).double()
    want = x.double() @ dense.T
    # fp32 sums in another order than float64's: a few sqrt(K) roundings of the terms' magnitude.
    bound = 4 * k ** 0.5 * 2.0 ** -24 * (x.double().abs() @ dense.abs().T)
    assert torch.all((got.double() - want).abs() <= bound), (got.double() - want).abs().max()


@pytest.mark.parametrize("qtype", TYPES + [quant.INT8_ROWS], ids=lambda t: quant.FORMATS[t].name)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17, 25, 49, 65, 130])
def test_qlinear_matches_the_reference_on_ragged_shapes(qtype, m):
    """Whichever kernel the row count picks: the few-rows one up to 4-64 rows by type and ISA, the
    many-rows one past that."""
    gen = torch.Generator().manual_seed(1000 * qtype + m)
    k = 512 if quant.FORMATS[qtype].block == 256 else 96
    if qtype == quant.INT8_ROWS and m % 2 == 0:
        k += 5  # K not a multiple of 8: the many-rows kernel at every row count
    n = 2 * 32 + 7  # two whole groups of 32 output channels and a ragged third
    w, scales = weights(qtype, n, k, gen)
    x = torch.randn(m, k, generator=gen)
    check_product(x, w, scales, qtype, k, quant.qlinear(x, w, scales, qtype, k))


@pytest.mark.parametrize("kernel", ["few", "many"])
@pytest.mark.parametrize("qtype", STREAMED, ids=lambda t: quant.FORMATS[t].name)
def test_each_kernel_matches_the_reference_at_every_row_count(qtype, kernel):
    """Each kernel forced on row counts on both sides of where "auto" switches, with every
    remainder of the register tiles (12 rows with AVX-512, 6 with AVX2)."""
    gen = torch.Generator().manual_seed(qtype + len(kernel))
    k, n = 128 if quant.FORMATS[qtype].block == 32 else 512, 3 * 32 + 5
    w, scales = weights(qtype, n, k, gen)
    streams = quant.few_rows_available(qtype, k)  # the build's own answer, as "auto" asks it
    for m in list(range(1, 27)) + [48, 49, 64, 97]:
        x = torch.randn(m, k, generator=gen)
        if kernel == "few" and not streams:
            with pytest.raises(RuntimeError, match="few-rows kernel needs AVX2"):
                quant.qlinear(x, w, scales, qtype, k, kernel=kernel)
            continue
        check_product(x, w, scales, qtype, k, quant.qlinear(x, w, scales, qtype, k, kernel=kernel))


def test_many_rows_is_batch_invariant():
    """In the many-rows kernel a row's outputs are one FMA chain in k order, whichever tile
    it lands in: a row alone or among 100 gives the same bits."""
    gen = torch.Generator().manual_seed(11)
    k, n = 256, 70
    w, _ = weights(quant.Q4_1, n, k, gen)
    x = torch.randn(100, k, generator=gen)
    whole = quant.qlinear(x, w, None, quant.Q4_1, k, kernel="many")
    for rows in (slice(0, 1), slice(37, 50), slice(99, 100)):
        assert torch.equal(quant.qlinear(x[rows], w, None, quant.Q4_1, k, kernel="many"), whole[rows])


@pytest.mark.parametrize("qtype", STREAMED, ids=lambda t: quant.FORMATS[t].name)
def test_bf16_rows_are_the_dequantized_weights_product_rounded_once(qtype):
    """A bf16 model's rows. Few: in fp32 on the exact weights, rounded on the way out. Many
    (past 16, or past the few-rows kernel's own limit), on a CPU with AMX: on the tiles,
    the weights rounded to bf16 as a bf16 model dequantized from the same file holds them,
    and the bits of the dense bf16 GEMM over those weights (kernels/csrc/gemm.cpp);
    without AMX, as few. Every row count picks its path."""
    gen = torch.Generator().manual_seed(50 + qtype)
    k, n = (128 if quant.FORMATS[qtype].block == 32 else 512), 2 * 48 + 7  # a ragged last panel
    w, scales = weights(qtype, n, k, gen)
    dense = quant.dequantize(w, scales, qtype, k)
    panels = cpu.gemm_pack(dense.bfloat16()) if cpu.gemm_tiles(torch.bfloat16, k) else None
    for m in (1, 4, 16, 17, 33, 65, 130):
        x = torch.randn(m, k, generator=gen).bfloat16()
        got = quant.qlinear(x, w, scales, qtype, k)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        tiles = quant.bf16_tiles(qtype, m, k)
        if m > 16:  # past the few-rows kernels' best, wherever the tiles are
            assert tiles == (panels is not None)
        if tiles:
            assert torch.equal(got, cpu.gemm(x, panels, n, None))
        want = (x.double() @ (dense.bfloat16() if tiles else dense).double().T)
        # one rounding to bf16 (half a unit in its 8 bits) on a sum fp32 took in its own order
        bound = 2.0 ** -8 * want.abs() + 4 * k ** 0.5 * 2.0 ** -24 * (x.double().abs() @ dense.abs().double().T)
        assert torch.all((got.double() - want).abs() <= bound), (m, (got.double() - want).abs().max())
        if not tiles:  # the fp32 path's own product, rounded
            assert torch.equal(got, quant.qlinear(x.float(), w, scales, qtype, k).bfloat16())


def test_the_few_rows_kernel_refuses_shapes_it_cannot_stream():
    """int8 rows stream 32 weights at a time: a K off that grid takes the many-rows kernel."""
    w, scales = quant.quantize_int8(torch.randn(8, 101, generator=torch.Generator().manual_seed(3)))
    assert not quant.few_rows_available(quant.INT8_ROWS, 101)
    with pytest.raises(RuntimeError, match="few-rows kernel needs"):
        quant.qlinear(torch.randn(2, 101), w, scales, quant.INT8_ROWS, 101, kernel="few")


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
def test_quant_linear_adds_its_bias_at_any_row_count(qtype):
    from engine.models import quantize

    gen = torch.Generator().manual_seed(qtype + 3)
    n, k = 40, 256
    w, scales = weights(qtype, n, k, gen)
    bias = torch.randn(n, generator=gen)
    layer = quantize.QuantLinear(w, scales, qtype, k, bias)
    for m in (1, 70):
        x = torch.randn(m, k, generator=gen)
        torch.testing.assert_close(layer(x), quant.qlinear(x, w, scales, qtype, k) + bias, rtol=0, atol=0)


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
