"""Quantized weights for the CPU: every GEMM of the model (the projections, the MLP or
each expert, and the head) and the embedding computed on quantized weights by the native
kernels (kernels/csrc/quant.cpp for few rows, qgemm.cpp for many), at every row count;
an expert layer's router stays dense.

- "gguf": the GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and
  gpt-oss's MXFP4: every type the Q4_K_M, Q5_K_M, Q8_0 and legacy files hold), so the
  values are exactly those the file holds, which are the ones the fp32 path dequantizes;
  tensors the file keeps in F32, F16 or BF16 beside them compute dense, in fp32;
- "mxfp4": a checkpoint's MXFP4 experts (gpt-oss as OpenAI ships it) on their own blocks,
  read as GGML's MXFP4 (engine/models/mxfp4.py to_gguf_blocks) and never dequantized;
  every other GEMM stays dense, and so does the embedding;
- "int8": per-output-channel symmetric int8, quantized at load from the fp32 weights of
  any checkpoint (a GGUF's dequantized values included).

Activations and sums stay fp32. Anything that cannot be served is a ParamError naming
`quantization`, never a silent fallback to fp32.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import ParamError
from engine.models import gguf_blocks, packed_linear
from kernels import pages, quant

MODES = ("gguf", "mxfp4", "int8")
# An expert layer's router and a shared expert's gate: kept dense under every mode.
ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) with W quantized: fp32 or bf16 in, the same out."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor | None, qtype: int, in_features: int,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.qtype, self.in_features, self.out_features = qtype, in_features, qweight.shape[0]
        self.register_buffer("qweight", pages.move(qweight.contiguous()))  # streamed every step
        self.register_buffer("scales", None if scales is None else scales.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.int8_activations = False
        self._plain()

    def _plain(self) -> None:
        # The buffers again as a plain tuple: a decode step makes 121 of these calls, and each
        # buffer read through nn.Module's __getattr__ costs about a microsecond.
        self.plain = (self.qweight, self.scales, self.qtype, self.in_features, self.bias, self.int8_activations)

    def use_int8_activations(self) -> None:
        """Decode rows' activations rounded to int8 per 32 values (kernels/csrc/quant_a8.cpp)."""
        self.int8_activations = True
        self._plain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, scales, qtype, k, bias, a8 = self.plain
        y = quant.qlinear(x, w, scales, qtype, k, "auto", a8)
        return y if bias is None else y.add_(bias)

    def dequantized(self) -> torch.Tensor:
        return quant.dequantize(self.qweight, self.scales, self.qtype, self.in_features)

    def extra_repr(self) -> str:
        a8 = ", int8 activations" if self.int8_activations else ""
        return f"{quant.FORMATS[self.qtype].name}, in={self.in_features}, out={self.out_features}{a8}"


class DenseRows(nn.Module):
    """Rows a GGUF file keeps unquantized beside its blocks (gguf_blocks.DENSE), in fp32:
    exactly the file's values, on the dense GEMM (prepacked where PackedLinear runs). The
    fp32 weight itself is kept only where it is read: an embedding table, or no packing."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, table: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        packs = packed_linear.supported(torch.device("cpu"), torch.float32)
        self.packed = packed_linear.PackedLinear(weight, self.bias) if packs else None
        self.register_buffer("weight", weight if table or not packs else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # a bf16 model's rows: the file's values, in fp32, rounded once
            return self.forward(x.float()).to(x.dtype)
        if self.packed is not None:
            return self.packed(x)
        return nn.functional.linear(x, self.weight, self.bias)

    def nbytes(self) -> int:
        held = [self.weight] + ([self.packed.panels, self.packed.packed] if self.packed is not None else [])
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def extra_repr(self) -> str:
        return f"dense fp32, in={self.in_features}, out={self.out_features}"


class QuantConcat(nn.Module):
    """A fused projection whose GGUF parts hold different block types (Q4_K_M files keep
    attn_v in Q6_K beside a Q4_K attn_q and attn_k), or some none (DenseRows): each part
    on its own blocks, their outputs side by side, as the fused weight would give them."""

    def __init__(self, parts: list[QuantLinear | DenseRows]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.calls = tuple(p.forward for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([call(x) for call in self.calls], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])


class InputOrder(nn.Module):
    """A quantized projection whose blocks hold its input columns in another order than the
    model's activations (Qwen3.5's out_proj over llama.cpp's tiled value heads): the
    activations are put in the file's order, since blocks cannot be cut across columns."""

    def __init__(self, linear: QuantLinear | QuantConcat, order: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("order", order)  # the file's column j is our column order[j]
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.order))

    def dequantized(self) -> torch.Tensor:
        return self.linear.dequantized()[:, torch.argsort(self.order)]


def quant_rows(rows: list[torch.Tensor], qtypes: list[int], k: int, bias: torch.Tensor | None
               ) -> QuantLinear | DenseRows | QuantConcat:
    """One projection from the row blocks of its parts (or their fp32 rows, for a type in
    gguf_blocks.DENSE): one module where the parts share a type, else a QuantConcat of one
    per part (the bias split with them)."""
    if len(set(qtypes)) == 1:
        return _part(torch.cat(rows), qtypes[0], k, bias)
    sizes = [r.shape[0] for r in rows]
    biases = bias.split(sizes) if bias is not None else [None] * len(rows)
    return QuantConcat([_part(r, q, k, b) for r, q, b in zip(rows, qtypes, biases)])


def _part(rows: torch.Tensor, qtype: int, k: int, bias: torch.Tensor | None, table: bool = False
          ) -> QuantLinear | DenseRows:
    """One part's module: its blocks, or its fp32 rows for a type in gguf_blocks.DENSE
    (`table`: an embedding, whose rows are looked up)."""
    if qtype in gguf_blocks.DENSE:
        return DenseRows(rows, bias, table)
    return QuantLinear(rows, None, qtype, k, bias)


class QuantEmbedding(nn.Module):
    """Rows of a quantized matrix, dequantized as they are looked up (or of a DenseRows
    table, read as they are); it can share its weights with the head (tied embeddings)."""

    def __init__(self, table: QuantLinear | DenseRows, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype  # dtype: the model's activations

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        if isinstance(t, DenseRows):
            rows = nn.functional.embedding(ids, t.weight)
        else:
            rows = quant.dequant_rows(t.qweight, t.scales, ids, t.qtype, t.in_features)
        return rows.to(self.dtype)


def settle(config: Any) -> Any:
    """An EngineConfig with quantization "auto" replaced by what it stands for here
    (`auto`), and a "gguf" file whose GEMM tensors lack a kernel refused before any
    conversion: what the engine and the process that starts it both resolve the model by."""
    from engine.models import loader

    if config.quantization == "gguf":
        gguf_blocks.preflight(loader.named_file(config.model))
        return config
    if config.quantization != "auto":
        return config
    config = config.model_copy(update={"quantization": auto(config)})
    if config.int8_activations and config.quantization is None:
        logging.getLogger(__name__).info("int8_activations: quantization 'auto' chose the dense weights here, "
                                         "whose activations are not rounded")
    return config


def auto(config: Any) -> str | None:
    """What quantization "auto" means for an EngineConfig: "gguf" for a GGUF model whose
    activations are fp32 anyway (dtype float32, or auto on a CPU without native bf16), on
    one CPU process, when every GEMM tensor has a kernel; None (the dense weights)
    otherwise. There the blocks decode about 3x faster than fp32 and prefill and large
    batches run as fast (benchmarks/LOG.md); where the CPU has native bf16, the dense
    bf16 GEMMs outrun fp32-activation ones 1.5x at 64 requests, so dense wins."""
    from engine.config import _device, _dtype
    from engine.models import loader

    device = _device(config.device)
    if device.type != "cpu" or config.tensor_parallel_size * config.pipeline_parallel_size != 1:
        return None
    if _dtype(config.dtype, device) != torch.float32:
        return None
    if _mxfp4_checkpoint(loader.named_file(config.model)):
        return "mxfp4"
    try:
        gguf_blocks.preflight(loader.named_file(config.model))
    except ParamError:  # not a GGUF, or a block type without a kernel
        gguf_blocks.release()  # no apply() will read the header preflight parsed
        return None
    return "gguf"


def _mxfp4_checkpoint(source: str) -> bool:
    """Whether `source` is a model directory whose config says its experts are MXFP4."""
    import json

    config = Path(source) / "config.json"
    if not config.is_file():
        return False
    try:
        qc = json.loads(config.read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(qc, dict) and qc.get("quant_method") == "mxfp4"


def check(mode: str | None, device: torch.device, tp: int, pp: int) -> None:
    """What can be decided from the config alone. Either CPU dtype serves: fp32 activations
    are exact against the dequantized file, bf16 ones run many rows on the AMX tiles where
    the CPU has them."""
    if mode is None:
        return
    if mode not in MODES:
        raise ParamError("quantization", f"quantization must be null, {' or '.join(map(repr, MODES))}; got {mode!r}")
    if device.type != "cpu":
        raise ParamError("quantization", f"quantization {mode!r} runs on the CPU kernels; the device is {device.type}")
    if tp * pp != 1:
        raise ParamError("quantization", f"quantization {mode!r} is not served under tensor or pipeline "
                         "parallelism yet")


def apply(model: Any, mode: str, source: str, config: Any, int8_activations: bool = False) -> None:
    """Swap the model's fp32 GEMM weights and embedding for quantized ones, in place; the
    fp32 tensors are released. `int8_activations`: every quantized GEMM (the experts' and
    the head's included) rounds its decode rows' activations to int8."""
    from engine.models.layers.moe import SparseMoE

    if mode == "mxfp4":
        _mxfp4_experts(model, source, int8_activations)
        return
    tensors = gguf_blocks.tensors(source) if mode == "gguf" else {}
    if mode == "gguf":
        parts = _gguf_layers(model, tensors, config)
    else:  # a router (and a shared expert's gate) keeps its dense weights: it picks, it does not compute
        parts = {name: _int8(mod) for name, mod in model.layers.named_modules()
                 if isinstance(mod, nn.Linear) and not name.endswith(ROUTERS)}
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.use_experts([_int8_expert(layer.mlp, e) for e in range(layer.mlp.spec.experts)])
    for name, new in parts.items():
        owner, leaf = name.rsplit(".", 1)
        setattr(model.layers.get_submodule(owner), leaf, new)
    table = _gguf_table(tensors, "token_embd") if mode == "gguf" else _int8(model.embed_tokens)
    if not model.tie:
        model.head = _gguf_table(tensors, "output", table=False) if mode == "gguf" else _int8(model.lm_head)
        del model.lm_head
    else:
        model.head = table
    model.embed_tokens = QuantEmbedding(table, model.embed_tokens.weight.dtype)
    gguf_blocks.release()  # its mapping of the file: every block is copied out by now
    if int8_activations:
        for mod in model.modules():  # the experts are modules of their layer too
            if isinstance(mod, QuantLinear):
                mod.use_int8_activations()


def _mxfp4_experts(model: Any, source: str, int8_activations: bool) -> None:
    """Every expert layer onto the MXFP4 blocks the loader kept (engine/models/weights.py),
    with its biases; the dense expert tensors, never written, are dropped."""
    from engine.models.layers.moe import SparseMoE

    moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoE)]
    if not moes or any(set(moe.kept_mxfp4) != {"gate_up", "down"} for moe in moes):
        raise ParamError("quantization", f"quantization 'mxfp4' computes on a checkpoint's MXFP4 experts "
                         f"(gpt-oss's `*_blocks` and `*_scales`); {source!r} has none (a GGUF file takes 'gguf')")
    for moe in moes:
        hidden = moe.gate.in_features
        pairs = [(QuantLinear(gate_up, None, quant.MXFP4, hidden, moe.expert_bias("gate_up", e)),
                  QuantLinear(down, None, quant.MXFP4, moe.inter, moe.expert_bias("down", e)))
                 for e, (gate_up, down) in enumerate(zip(moe.kept_mxfp4["gate_up"], moe.kept_mxfp4["down"]))]
        if int8_activations:
            for linear in (m for pair in pairs for m in pair):
                linear.use_int8_activations()
        moe.kept_mxfp4 = {}
        moe.use_experts(pairs)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a quantized model's weights: its blocks (the head counted once when tied)
    and every parameter left dense (norms, routers; under `mxfp4` all but the experts).
    0 for a model without quantized weights."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):  # a QuantConcat's parts are among the modules
            seen[id(mod)] = mod.qweight.numel() * mod.qweight.element_size()
        elif isinstance(mod, DenseRows):
            seen[id(mod)] = mod.nbytes()
    if not seen:
        return 0
    return sum(seen.values()) + sum(p.numel() * p.element_size() for p in model.parameters())


def _int8(linear: nn.Module) -> QuantLinear:
    return _int8_weight(linear.weight, getattr(linear, "bias", None))


def _int8_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
    q, scales = quant.quantize_int8(weight)
    return QuantLinear(q, scales, quant.INT8_ROWS, weight.shape[1], bias)


def _int8_expert(moe: Any, e: int) -> tuple[QuantLinear, QuantLinear]:
    gate_up, down = moe.expert_weights(e)
    return _int8_weight(gate_up, moe.expert_bias("gate_up", e)), _int8_weight(down, moe.expert_bias("down", e))


# -- GGUF -------------------------------------------------------------------------------
def _gguf_table(tensors: dict[str, Any], name: str, table: bool = True) -> QuantLinear | DenseRows:
    """The embedding (`table`: its rows are looked up) or an untied head."""
    qtype, data, k = gguf_blocks.blocks(tensors, f"{name}.weight")
    return _part(data, qtype, k, None, table)


def _gguf_layers(model: Any, tensors: dict[str, Any], config: Any) -> dict[str, nn.Module]:
    for moe, names in gguf_blocks.experts(model):
        moe.use_experts(_gguf_experts(tensors, names, moe))
    out: dict[str, nn.Module] = {}
    for proj in gguf_blocks.projections(model, tensors, config):
        blocks = [gguf_blocks.blocks(tensors, name) for name in proj.names]
        rows = [b[1][proj.rows[n]] if n in proj.rows else b[1] for n, b in zip(proj.names, blocks)]
        bias = getattr(model.layers.get_submodule(proj.path), "bias", None)
        linear = quant_rows(rows, [b[0] for b in blocks], blocks[0][2], bias)
        out[proj.path] = linear if proj.cols is None else InputOrder(linear, torch.argsort(proj.cols))
    return out


def _gguf_experts(tensors: dict[str, Any], names: tuple[str, str, str], moe: Any
                  ) -> list[tuple[nn.Module, nn.Module]]:
    """Each expert's gate/up and down on the file's own blocks (gpt-oss's biases beside
    them), cut from the layer's merged tensors."""
    (qg, gate, k), (qu, up, _), (qd, down, inter) = (gguf_blocks.blocks(tensors, name) for name in names)
    n, i = moe.spec.experts, moe.inter
    return [(quant_rows([gate[e * i:(e + 1) * i], up[e * i:(e + 1) * i]], [qg, qu], k, moe.expert_bias("gate_up", e)),
             _part(down[e * k:(e + 1) * k], qd, inter, moe.expert_bias("down", e))) for e in range(n)]
