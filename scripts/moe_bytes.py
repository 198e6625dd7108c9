"""Weight bytes a batch-1 decode step reads, against the model's active parameters: does a
mixture-of-experts step read the routed experts' weights and no others?

Every GEMM entry point the model calls (the native quantized kernel, the packed fp32
GEMMs, a layer's native expert call, torch's linear) and the embedding lookup are wrapped to add the bytes of the
weight they were handed; one decode token of one request is counted. The expectation
comes from the weights themselves: every non-expert GEMM weight whole, one embedding
row, and of each expert layer exactly top-k experts' share of its experts.

    python scripts/moe_bytes.py --model /tmp/moe-q4km.gguf --quantization gguf
    python scripts/moe_bytes.py --model /tmp/moe-q4km.gguf            # its dense fp32 weights
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine import LLM, SamplingParams  # noqa: E402
from engine.models import packed_linear  # noqa: E402
from engine.models.layers.moe import SparseMoE  # noqa: E402
from engine.models.packed_linear import PackedLinear  # noqa: E402
from engine.models.quantize import QuantConcat, QuantLinear  # noqa: E402
from kernels import cpu, quant  # noqa: E402


class Counter:
    """Wraps the GEMM entry points; `bytes` is what the calls since the last reset read."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.saved = (quant.qlinear, quant.dequant_rows, packed_linear.linear, packed_linear.panel_linear, F.linear,
                      F.embedding, cpu.moe_glu)

    def __enter__(self) -> Counter:
        q, rows, lin, panel, flin, emb, moe = self.saved

        def qlinear(x, w, scales, qtype, k, kernel="auto", int8_activations=False):
            self._add(w.nbytes + (0 if scales is None else scales.nbytes))
            return q(x, w, scales, qtype, k, kernel, int8_activations)

        def dequant_rows(w, scales, ids, qtype, k):
            self._add(ids.numel() * w.shape[1] + (0 if scales is None else ids.numel() * 4))
            return rows(w, scales, ids, qtype, k)

        def linear(x, packed, bias):
            self._add(packed.nbytes)
            return lin(x, packed, bias)

        def panel_linear(x, panels, n, bias, glu=False):
            self._add(panels.nbytes)
            return panel(x, panels, n, bias, glu)

        def flinear(x, weight, bias=None):
            self._add(weight.nbytes)
            return flin(x, weight, bias)

        def embedding(ids, weight, *args, **kwargs):
            self._add(ids.numel() * weight.shape[1] * weight.element_size())
            return emb(ids, weight, *args, **kwargs)

        def moe_glu(x, offsets, gate_up, down, n):  # the panels of the experts given rows
            used = (offsets[1:] > offsets[:-1]).nonzero().flatten().tolist()
            self._add(sum(gate_up[e].nbytes + down[e].nbytes for e in used))
            return moe(x, offsets, gate_up, down, n)

        quant.qlinear, quant.dequant_rows = qlinear, dequant_rows
        packed_linear.linear, packed_linear.panel_linear = linear, panel_linear
        F.linear, F.embedding, cpu.moe_glu = flinear, embedding, moe_glu
        return self

    def __exit__(self, *exc) -> None:
        (quant.qlinear, quant.dequant_rows, packed_linear.linear, packed_linear.panel_linear, F.linear,
         F.embedding, cpu.moe_glu) = self.saved

    def _add(self, n: int) -> None:
        self.bytes += n
        self.calls += 1


def gemm_bytes(mod) -> int:
    """The bytes one GEMM's weight takes, as its kernel reads them."""
    if isinstance(mod, QuantConcat):
        return sum(gemm_bytes(p) for p in mod.parts)
    if isinstance(mod, QuantLinear):
        return mod.qweight.nbytes + (0 if mod.scales is None else mod.scales.nbytes)
    if isinstance(mod, PackedLinear):
        return (mod.panels if mod.panels is not None else mod.packed).nbytes
    return mod.weight.nbytes  # nn.Linear, nn.Embedding


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes of every GEMM weight outside the experts, of every expert, of the experts a
    token reads: top-k of each expert layer's) as the model holds them."""
    experts = active = 0
    for moe in (m for m in model.modules() if isinstance(m, SparseMoE)):
        if moe.native is not None:  # every expert's panels, stacked for one native call
            size = sum(t.nbytes for t in moe.native)
        elif moe.packed:  # each expert's two GEMMs, packed or quantized (their callables' owners)
            size = sum(gemm_bytes(call.__self__) for pair in moe.packed for call in pair)
        else:
            size = moe.experts_gate_up.nbytes + moe.experts_down.nbytes
        experts += size
        active += size * moe.spec.top_k // moe.spec.experts
    dense: dict[int, int] = {}  # by module: a tied head and embedding share one table
    for name, mod in model.named_modules():
        if ".expert_modules." in name or (name == "lm_head" and hasattr(model, "head")):
            continue  # an expert's (counted above); the unpacked LM head kept for loading
        if isinstance(mod, (QuantLinear, PackedLinear, nn.Linear, nn.Embedding)):
            dense[id(mod)] = gemm_bytes(mod)
    return sum(dense.values()), experts, active


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=256,
              enable_prefix_caching=False)
    model = llm.engine.executor.runner.model
    eng = llm.engine
    vocab = llm.engine.hf_config.vocab_size
    eng.add_request("b", [(7919 * i) % vocab for i in range(1, 33)],
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.step()  # the prefill, and the first token
    with Counter() as c:
        eng.step()  # one decode token
    while eng.has_unfinished():
        eng.step()
    dense, experts, active = weight_bytes(model)
    # The embedding table is read one row a token (counted by the lookup), not whole, unless
    # it is also the head: quantized and tied, or unpacked and tied.
    table = getattr(model.embed_tokens, "table", model.embed_tokens)
    head = getattr(model, "head", None)
    shared = head is table or (head is None and model.tie)
    table_bytes = gemm_bytes(table)
    row = table_bytes // (table.qweight if hasattr(table, "qweight") else table.weight).shape[0]
    expected = dense - (0 if shared else table_bytes) + active + row
    mib = 1 / 2**20
    print(f"model: {args.model}, quantization {args.quantization}, dtype {args.dtype}")
    print(f"weights held: {(dense + experts) * mib:.1f} MiB ({experts * mib:.1f} MiB of experts)")
    print(f"expected per token: {expected * mib:.2f} MiB (every non-expert GEMM, one embedding row, "
          f"top-k of each expert layer)")
    print(f"measured per decode token: {c.bytes * mib:.2f} MiB in {c.calls} weight reads "
          f"= {c.bytes / expected:.4f}x expected, {c.bytes / (dense + experts):.3f}x of all weights")


if __name__ == "__main__":
    main()
