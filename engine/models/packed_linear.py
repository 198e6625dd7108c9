"""Linear layers with their weights prepacked once, for the CPU.

`F.linear` in fp32 goes to MKL's sgemm, which on AMD CPUs takes slow code paths; the
same product through oneDNN with a weight reordered once at load (what Inductor's
freezing pass emits) runs 2-3x faster here. On CPUs with AVX-512 the native panel GEMM
(kernels/csrc/gemm.cpp) replaces oneDNN, in fp32 and (with AVX512_BF16) in bf16: at the
1-64 rows of decode steps 1.0-2.0x oneDNN's rate in fp32 and 1.1-3.3x in bf16, level
from 256 rows up (`scripts/bench_gemm.py`); in fp32 the offline workload runs level
with oneDNN (benchmarks/LOG.md, session 16). On Xeons with AMX its bf16 products run on
the AMX tiles over the same panels (0.8-0.95x oneDNN's rate from 256 rows up, 1.1-1.3x at
1-16 rows; the AVX-512 tile there ran at a tenth of oneDNN's from 16 rows up: LOG, session
42). The packed weight is opaque, so the original stays for loading and for the
weight-tied embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import cpu, pages


ROWS = 16  # past this many rows, GEMMs run on a multiple of it...
FINE = 64  # ...except up to this many, which run on a multiple of 4


def rows_for(m: int) -> int:
    """The row count a GEMM of m rows runs on (see linear)."""
    if m <= ROWS:
        return m
    step = 4 if m <= FINE else ROWS
    return -(-m // step) * step


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One prepacked GEMM (module-level so profilers can wrap it).

    oneDNN keeps JIT kernels and state for every row count it has seen, about a
    megabyte each, and a serving engine sees every count from 1 to the token budget: the
    engine process grew by gigabytes under a soak. Rounding the rows up bounds the
    shapes to budget/ROWS + 24. Decode batches (17-64 rows) round to a multiple of 4
    only: padding 33 rows to 48 made a layer's GEMMs 60% slower in bf16 and 39% in
    fp32, while large products grow by under 1/ROWS of M.
    """
    m = x.shape[0]
    pad = rows_for(m) - m
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out[:m] if pad else out


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                 glu: bool = False) -> torch.Tensor:
    """One native GEMM (module-level so profilers can wrap it); with glu, on gemm_pack_glu's
    panels, silu(gate) * up of it. It keeps no state per row count, so rows are never padded."""
    gemm = cpu.gemm_glu if glu else cpu.gemm
    if x.dim() == 2 and x.stride(1) == 1:
        return gemm(x, panels, n, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    return gemm(flat, panels, n, bias).view(*x.shape[:-1], n)


def glu_available(dtype: torch.dtype) -> bool:
    """Whether a gate/up projection takes the activation into its GEMM (gemm_glu): in fp32,
    where it saves the pass over the [M, 2 I] product (1.00-1.12x at 1-2,048 rows,
    `scripts/bench_gemm.py --glu`); not in bf16, where the tile is twice as fast and the
    epilogue's exp and division cost about what the pass saves (0.98-1.09x)."""
    return dtype == torch.float32 and cpu.gemm_available(dtype)


class PackedLinear(nn.Module):
    """`glu`: the weight is a gate/up projection [2 I, K] (gate rows first) and forward
    returns silu(gate) * up [.., I] instead of the product (native GEMM only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, glu: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().contiguous()
        self.glu = glu
        self.panels = None  # the native GEMM's packing, where it runs
        self.packed = None  # oneDNN's, everywhere else
        if glu:
            if not glu_available(w.dtype):
                raise ValueError(f"a fused gate/up GEMM needs the native fp32 GEMM, not {w.dtype}")
            self.out_features //= 2
            self.panels = pages.move(cpu.gemm_pack_glu(w))
        elif cpu.gemm_available(w.dtype) and (w.dtype != torch.bfloat16 or self.in_features % 2 == 0):
            self.panels = pages.move(cpu.gemm_pack(w))
        else:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
            except RuntimeError as exc:  # bf16 without AVX-512 or AVX-NE-CONVERT
                raise ValueError(f"this CPU cannot pack {w.dtype} weights (see `supported`): "
                                 f"{str(exc).splitlines()[0]}") from exc
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return panel_linear(x, self.panels, self.out_features, self.bias, self.glu)
        return linear(x, self.packed, self.bias)


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether PackedLinear takes dtype on this device. The native GEMM packs fp32 on AVX-512
    and bf16 on AVX512_BF16; oneDNN packs fp32 everywhere and bf16 only on CPUs with AVX-512
    (BW, VL, DQ) or AVX-NE-CONVERT. Elsewhere (bf16 on an AVX2 CPU) the model keeps
    nn.Linear, whose bf16 GEMM ATen runs on any CPU."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if cpu.gemm_available(dtype):
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
    except RuntimeError:  # e.g. "bf16 path needs avx512bw ..."
        return False
    return True


def pack(module: nn.Module) -> None:
    """Replace every nn.Linear below module with a PackedLinear, in place."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child.weight, child.bias))
        else:
            pack(child)
