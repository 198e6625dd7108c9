"""Where a GGUF file's GEMM weights and embedding go in our model, read from the file
itself: which tensors fill each of our projections, their block bytes, and the rows
llama.cpp's converter reordered. Two readers share it: `quantization: gguf`, which
computes on the blocks (engine/models/quantize.py), and the dense paths, which dequantize
them into the model's own dtype at load (engine/models/gguf_dense.py). Either way the
converted directory holds only the tensors that stay dense (engine/models/gguf_convert.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from engine.errors import ParamError
from engine.models import gguf_index, mxfp4
from engine.models.gguf_tensors import GGUF_EXPERTS, PERMUTED, TILED, grouped_order, unpermuted_order
from engine.models.weights import rotary_order
from kernels import quant

# Our fused projections and the GGUF tensors that fill them, in order; Phi-3's files hold
# the fused tensors themselves (attn_qkv, and ffn_up with gate and up).
GGUF_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
GGUF_FUSED_PARTS = {"self_attn.qkv_proj": ("attn_qkv",), "self_attn.o_proj": ("attn_output",),
                    "mlp.gate_up_proj": ("ffn_up",), "mlp.down_proj": ("ffn_down",)}
# A Qwen2-MoE shared expert's GGUF tensors; the routed experts' are merged per layer.
GGUF_SHARED_PARTS = {"mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
                     "mlp.shared_expert.down_proj": ("ffn_down_shexp",)}
# A state-keeping layer's projections: Qwen3.5's linear attention (in_proj_qkv, in_proj_z,
# in_proj_b and in_proj_a as one GEMM) and LFM2's short convolution.
GGUF_LINEAR_PARTS = {"linear_attn.in_proj": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
                     "linear_attn.out_proj": ("ssm_out",)}
GGUF_BA_PARTS = ("attn_qkv", "attn_gate", "ssm_ba")  # Qwen3-Next's in_proj
GGUF_CONV_PARTS = {"conv.in_proj": ("shortconv.in_proj",), "conv.out_proj": ("shortconv.out_proj",)}
# Every GGUF tensor read here (as `<name>.weight`), and our parameters they fill.
GGUF_ON_BLOCKS = frozenset({part for table in (GGUF_PARTS, GGUF_FUSED_PARTS, GGUF_SHARED_PARTS, GGUF_LINEAR_PARTS,
                                               GGUF_CONV_PARTS)
                            for parts in table.values() for part in parts}
                           | {"token_embd", "output", *GGUF_EXPERTS, *GGUF_BA_PARTS})
REPLACED = (".qkv_proj.weight", ".o_proj.weight", ".gate_up_proj.weight", ".down_proj.weight", ".experts_gate_up",
            ".experts_down", *(f".{ours}.weight" for ours in (*GGUF_LINEAR_PARTS, *GGUF_CONV_PARTS)))


# Types some quantizers keep beside the blocks (the embedding or the head, or small
# projections such as Qwen3.5's ssm_alpha and ssm_beta): served dense, in fp32.
DENSE = {0: "F32", 1: "F16", 30: "BF16"}


class Projection(NamedTuple):
    """One dense projection of the model's layers and the GGUF tensors that fill it."""

    path: str  # under model.layers
    names: tuple[str, ...]  # the tensors whose rows make it, in order
    # {tensor: row index} where a tensor's rows come in another order than the model's
    # (Llama's interleaved q and k; Qwen3.5's tiled value heads): ours are file[index]
    rows: dict[str, torch.Tensor]
    # The input columns' order where the file's differ (Qwen3.5's out_proj, whose inputs are
    # the tiled value heads): our column j is the file's column cols[j]. Blocks cannot be cut
    # across their columns, so the quantized path reorders the activations instead.
    cols: torch.Tensor | None = None


def on_blocks(name: str) -> bool:
    """Whether this GGUF tensor is read from the file at load rather than converted: a
    conversion leaves it out (engine/models/gguf_convert.py)."""
    if not name.endswith(".weight"):
        return False
    stem = name.removesuffix(".weight")
    return (stem.split(".", 2)[2] if stem.startswith("blk.") else stem) in GGUF_ON_BLOCKS


def replaced(param: str) -> bool:
    """Whether this parameter of our model is filled from the file's tensors (a GEMM
    weight, an expert stack, the embedding or the head): one a blocks-only directory
    does not fill."""
    return param in ("embed_tokens.weight", "lm_head.weight") or param.endswith(REPLACED)


def reader(source: str) -> gguf_index.Index:
    """The GGUF file itself, or the one a model directory holds (scripts/import_model.py
    keeps the file next to the dequantized weights when it imports a GGUF)."""
    path = Path(source)
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        path = found[0] if len(found) == 1 else path
    if path.suffix != ".gguf" or not path.is_file():
        raise ParamError("quantization", f"quantization 'gguf' computes on a GGUF file's blocks; the model "
                         f"{source!r} is not a .gguf file nor a directory holding one (use 'int8' for other "
                         "checkpoints; scripts/import_model.py keeps an imported GGUF next to its weights)")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _READERS:  # preflight and the load read the same file: index it once
        _READERS.clear()
        try:
            _READERS[key] = gguf_index.read(path)
        except ValueError as exc:
            raise ParamError("model", str(exc)) from None
    return _READERS[key]


_READERS: dict[tuple[str, int, int], gguf_index.Index] = {}  # the last file's tensor directory


def release() -> None:
    """Drop the tensor directory and its mapping of the file, once every tensor is read."""
    _READERS.clear()


def tensors(source: str) -> dict[str, gguf_index.Tensor]:
    return {t.name: t for t in reader(source).tensors}


def preflight(source: str) -> None:
    """Refuse a file the kernels cannot serve before the loader spends seconds to minutes
    on it: every GEMM tensor's type is read from the header, and a file with no blocks
    among them (all F16, say) is for the dense path."""
    found = tensors(source)
    kinds = {qtype(found, name) for name in found if on_blocks(name)}
    if kinds and kinds <= set(DENSE):
        raise ParamError("quantization", f"quantization 'gguf' computes on a GGUF file's blocks; every GEMM tensor "
                         f"of {source!r} is {' or '.join(sorted(DENSE[k] for k in kinds))} (serve it with "
                         "quantization null)")


def qtype(found: dict[str, gguf_index.Tensor], name: str) -> int:
    """The GGUF type of one tensor, refused if no kernel reads it."""
    t = found.get(name)
    if t is None:
        raise ParamError("quantization", f"the GGUF file has no tensor {name!r}")
    kind = int(t.tensor_type)
    if kind in DENSE:
        return kind
    if kind not in quant.FORMATS or kind == quant.INT8_ROWS:
        supported = ", ".join([f.name for q, f in quant.FORMATS.items() if q != quant.INT8_ROWS] + list(DENSE.values()))
        raise ParamError("quantization", f"GGUF tensor {name!r} is {t.tensor_type.name}; quantization 'gguf' "
                         f"serves {supported}")
    return kind


def blocks(found: dict[str, gguf_index.Tensor], name: str) -> tuple[int, torch.Tensor, int]:
    """(type, data, K) of one GGUF tensor, copied out of the mapping: its [N, row_bytes]
    block bytes, or for a type in DENSE its values, [N, K] in fp32 (exactly)."""
    kind, t = qtype(found, name), found[name]
    k = int(t.shape[0])
    if kind in DENSE:
        import gguf

        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        return kind, torch.from_numpy(values.reshape(-1, k).copy()), k
    data = torch.from_numpy(t.data.copy()).view(torch.uint8).reshape(-1, quant.row_bytes(kind, k))
    if kind == quant.MXFP4:  # a NaN scale would compute silently
        try:
            mxfp4.check_gguf_blocks(data, name)
        except ValueError as e:
            raise ParamError("model", str(e)) from None
    return kind, data, k


def projections(model: Any, found: dict[str, Any], config: Any) -> Iterator[Projection]:
    """Each dense projection of the model's layers; an expert layer's routed experts are
    not among them (`experts`)."""
    from engine.models.layers.moe import SparseMoE

    first, _end = model.layer_range
    attn = first + next((i for i, layer in enumerate(model.layers) if not layer.is_linear), 0)
    table = dict(GGUF_FUSED_PARTS if f"blk.{attn}.attn_qkv.weight" in found else GGUF_PARTS)
    if f"blk.{first}.ffn_gate.weight" not in found:  # gate and up fused (GLM-4, as Phi-3), or no gate (Arcee)
        table["mlp.gate_up_proj"] = GGUF_FUSED_PARTS["mlp.gate_up_proj"]
    orders = _qk_orders(model, config)
    for i, layer in enumerate(model.layers):
        parts = dict(table)
        if layer.is_linear:  # its mixer's projections in place of the attention's
            parts = {k: v for k, v in parts.items() if k.startswith("mlp.")}
            parts.update(GGUF_LINEAR_PARTS if hasattr(layer, "linear_attn") else GGUF_CONV_PARTS)
        if isinstance(layer.mlp, SparseMoE):
            parts = {k: v for k, v in parts.items() if not k.startswith("mlp.")}
            if layer.mlp.spec.shared_inter:
                parts.update(GGUF_SHARED_PARTS)
        if f"blk.{first + i}.ssm_ba.weight" in found:  # Qwen3-Next's b and a, one tensor
            parts["linear_attn.in_proj"] = GGUF_BA_PARTS
        for ours, theirs in parts.items():
            names = tuple(f"blk.{first + i}.{name}.weight" for name in theirs)
            rows = {n: orders[p] for n, p in zip(names, theirs) if p in orders}
            cols = None
            if theirs == GGUF_BA_PARTS:
                rows = {names[-1]: _ba_order(layer.linear_attn.spec)}
            elif ours.startswith("linear_attn.") and config.model_type in TILED:
                rows, cols = _value_head_orders(layer.linear_attn.spec, names)
            yield Projection(f"{i}.{ours}", names, rows, cols)


def _ba_order(spec: Any) -> torch.Tensor:
    """Qwen3-Next's ssm_ba rows (each key head's b for its value heads, then their a) as
    in_proj's b rows then a rows."""
    per = spec.value_heads // spec.key_heads
    rows = torch.arange(2 * spec.value_heads).view(spec.key_heads, 2, per)
    return torch.cat([rows[:, 0].reshape(-1), rows[:, 1].reshape(-1)])


def _value_head_orders(spec: Any, names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """A Qwen3.5 linear-attention projection's orders, where its file tiled the value heads
    (gguf_tensors.grouped_order): in_proj's value rows, z rows and b and a rows, and
    out_proj's input columns."""
    if spec.key_heads == spec.value_heads:
        return {}, None
    heads, dv = (spec.key_heads, spec.value_heads), spec.value_dim
    if len(names) == 1:  # out_proj
        return {}, grouped_order(*heads, dv)
    qk = 2 * spec.key_heads * spec.key_dim
    qkv = torch.cat([torch.arange(qk), qk + grouped_order(*heads, dv)])
    return dict(zip(names, (qkv, grouped_order(*heads, dv), grouped_order(*heads, 1), grouped_order(*heads, 1)))), None


def _qk_orders(model: Any, config: Any) -> dict[str, torch.Tensor]:
    """{attn_q / attn_k: row index} where the file's q and k rows are not in the model's
    order: the Llama family's, which the converter interleaved, and those of models whose
    rotary pairs adjacent dims (GLM-4, ERNIE 4.5, Command R), which the loader turns to
    rotate-half's pairs as it does a checkpoint's (engine/models/weights.py)."""
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    d = model.attention.head_dim
    if config.model_type in PERMUTED:
        return {p: unpermuted_order(h * d, h) for p, h in heads.items()}
    if model.arch.rope_interleaved:
        return {p: rotary_order(model, h) for p, h in heads.items()}
    return {}


def experts(model: Any) -> Iterator[tuple[Any, tuple[str, str, str]]]:
    """Each expert layer of the model with its merged GGUF tensors (gate, up, down):
    llama.cpp merges a layer's experts into one tensor per projection, expert after
    expert, so expert e's output channels are rows [e * out, (e + 1) * out) of it."""
    from engine.models.layers.moe import SparseMoE

    first, _end = model.layer_range
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, SparseMoE):
            yield layer.mlp, tuple(f"blk.{first + i}.{n}.weight" for n in GGUF_EXPERTS)
