"""A GGUF's GEMM weights and embedding dequantized into the dense model at load, one
tensor at a time, in the model's own dtype.

The dense paths (bf16, fp32 without `quantization: gguf`, `int8` from a GGUF) used to
read an fp32 copy of the whole model that the first load wrote to the cache: four times
the file on disk, and the whole fp32 model held in memory while it was written (a 1.1 GB
Qwen3-1.7B Q4_K_M file: 6.9 GB on disk, a 14 GB peak). Here the converted directory holds
only what stays dense (norms, biases, routers), as under `gguf`, and each GEMM tensor is
dequantized from the file's blocks straight into its parameter. The values are the same
to the bit: the kernels' dequantization is the gguf package's (tests/unit/
test_quant_kernels.py), and the types no kernel reads (F16, BF16, Q2_K, ...) go through
the gguf package itself, as transformers' reader does.

One rank's parameters are whole tensors; under tensor parallelism each rank holds a
slice, so those engines still read the fp32 conversion (engine/models/loader.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.errors import ParamError
from engine.models import gguf_blocks
from kernels import cpu, quant


def fill(model: Any, source: str, config: Any, dtype: torch.dtype) -> None:
    """Every parameter gguf_blocks.replaced names, from the GGUF `source`, in `dtype`; a
    ParamError naming any the file leaves unfilled, never uninitialized memory."""
    found = gguf_blocks.tensors(source)
    params = dict(model.named_parameters())
    filled: set[int] = set()

    def put(param: torch.nn.Parameter, value: torch.Tensor, what: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ParamError("model", f"{source}: GGUF tensor {what} gives shape {tuple(value.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data = value.to(device=param.device, dtype=dtype)
        filled.add(id(param))

    for proj in gguf_blocks.projections(model, found, config):
        rows = [_dense(found, name) for name in proj.names]
        rows = [r[proj.rows[n]] if n in proj.rows else r for n, r in zip(proj.names, rows)]
        weight = torch.cat(rows) if len(rows) > 1 else rows[0]
        put(params[f"layers.{proj.path}.weight"], weight if proj.cols is None else weight[:, proj.cols],
            " + ".join(proj.names))
    for moe, names in gguf_blocks.experts(model):
        _experts(moe, found, names, dtype, put)
    # Absent where another pipeline stage holds them, or the head when it is the embedding;
    # a classifier's head is never read (loader.build_model zeroes it).
    unread = {"lm_head.weight"} if model.headless else set()
    for param, name in (("embed_tokens.weight", "token_embd.weight"), ("lm_head.weight", "output.weight")):
        if param in params and param not in unread:
            put(params[param], _dense(found, name), name)
    gguf_blocks.release()
    unfilled = [name for name, p in model.named_parameters()
                if gguf_blocks.replaced(name) and id(p) not in filled and name not in unread]
    if unfilled:
        raise ParamError("model", f"{source}: no GGUF tensor filled {unfilled[:3]}")


def _experts(moe: Any, found: dict[str, Any], names: tuple[str, str, str], dtype: torch.dtype, put: Any) -> None:
    """An expert layer's stacks, [E, 2 I, hidden] gate then up and [E, hidden, I], from its
    merged tensors, whose rows run expert after expert."""
    e, i = moe.spec.experts, moe.inter
    gate, up, down = names
    hidden = moe.experts_gate_up.shape[-1]
    stack = torch.empty(e, 2 * i, hidden, dtype=dtype)
    stack[:, :i] = _dense(found, gate).view(e, i, hidden)
    stack[:, i:] = _dense(found, up).view(e, i, hidden)
    put(moe.experts_gate_up, stack, f"{gate} + {up}")
    put(moe.experts_down, _dense(found, down).view(e, hidden, i), down)


def _dense(found: dict[str, Any], name: str) -> torch.Tensor:
    """One GGUF tensor as fp32 [N, K]: by the kernels where they read its type, else by the
    gguf package (F32, F16, BF16, and block types no kernel reads)."""
    t = found.get(name)
    if t is None:
        raise ParamError("model", f"the GGUF file has no tensor {name!r}")
    kind = int(t.tensor_type)
    if kind in quant.FORMATS and kind != quant.INT8_ROWS:
        kind, data, k = gguf_blocks.blocks(found, name)
        if cpu.available():  # the same values, on every core
            return quant.dequant_rows(data, None, torch.arange(data.shape[0]), kind, k)
        return quant.dequantize(data, None, kind, k)
    import gguf

    values = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return torch.from_numpy(values).reshape(-1, int(t.shape[0]))


def rows(source: str, name: str, ids: list[int]) -> torch.Tensor:
    """Rows `ids` of one GGUF tensor in fp32, dequantized by the gguf package (a scoring
    head's yes/no rows: two rows, not the whole vocabulary)."""
    import gguf

    t = gguf_blocks.tensors(source).get(name)
    if t is None:
        raise ParamError("model", f"{source}: the GGUF file has no tensor {name!r} for the scoring head")
    picked = np.asarray(t.data)[np.asarray(ids)]  # [rows, K] values or [rows, row bytes] blocks
    return torch.from_numpy(np.array(gguf.quants.dequantize(picked, t.tensor_type), dtype=np.float32))
