"""The weights a CPU step streams sit on 2 MiB pages where the kernel gives them
(kernels/pages.py), hold the same values, and give their memory back when dropped."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from engine.models.packed_linear import PackedLinear
from engine.models.quantize import QuantLinear
from kernels import cpu, pages, quant


def _mapping(address: int) -> dict[str, int] | None:
    """The kB fields of the mapping of this process that holds address, or None."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            found = {} if lo <= address < hi else None
        elif found is not None and line.endswith(" kB"):
            found[head.rstrip(":")] = int(line.split()[1])
        elif found is not None and found:
            return found
    return found


def _huge_kb(t: torch.Tensor) -> int:
    fields = _mapping(t.data_ptr())
    assert fields is not None
    return fields.get("AnonHugePages", 0)


def test_move_keeps_every_value_and_starts_on_a_huge_page() -> None:
    t = torch.randn(3, 1 << 19).to(torch.bfloat16)  # 3 MiB
    moved = pages.move(t)
    assert moved.dtype == t.dtype and moved.shape == t.shape and torch.equal(moved, t)
    if pages.available():
        assert moved.data_ptr() != t.data_ptr() and moved.data_ptr() % pages.HUGE == 0
        assert _huge_kb(moved) >= 2048  # the whole first 2 MiB; the partial rest stays small
    else:
        assert moved is t  # nothing to gain: the tensor as it was


def test_small_tensors_stay_where_they_are() -> None:
    small = torch.ones(1000)
    assert pages.move(small) is small
    assert torch.equal(pages.empty((10, 10), torch.float32), torch.zeros(10, 10))


def test_empty_is_zeros_of_the_shape() -> None:
    t = pages.empty((5, 1 << 18), torch.float32)  # 5 MiB
    assert t.shape == (5, 1 << 18) and t.dtype == torch.float32 and not t.any()
    t.fill_(1.0)
    assert t.sum().item() == 5 * (1 << 18)


def test_the_memory_goes_back_when_the_tensor_is_dropped() -> None:
    t = pages.move(torch.ones(1 << 21))  # 8 MiB
    address = t.data_ptr()
    assert _mapping(address) is not None
    del t
    gc.collect()
    if pages.available():  # its own mapping, unmapped with its last view
        assert _mapping(address) is None


def test_packed_and_quantized_weights_are_placed_on_huge_pages() -> None:
    weight = torch.randn(3072, 2048)  # int8 rows: 6 MiB; fp32 panels: 24 MiB
    x = torch.randn(4, 2048)
    q, scales = quant.quantize_int8(weight)
    placed = [QuantLinear(q, scales, quant.INT8_ROWS, 2048).qweight]
    if cpu.gemm_available(torch.float32):  # AVX-512: the native GEMM's panels (elsewhere oneDNN's own)
        packed = PackedLinear(weight, None)
        torch.testing.assert_close(packed(x), x @ weight.T, rtol=1e-4, atol=1e-3)
        placed.append(packed.panels)
    if pages.available():
        for tensor in placed:
            assert tensor.data_ptr() % pages.HUGE == 0 and _huge_kb(tensor) >= 4096
