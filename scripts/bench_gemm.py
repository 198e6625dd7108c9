#!/usr/bin/env python
"""The native panel GEMM (kernels/csrc/gemm.cpp) against the prepacked oneDNN GEMM the
engine otherwise runs (engine/models/packed_linear.py), on SmolLM2-135M's layer shapes,
in one process, side by side. `--glu` instead times the MLP's gate/up projection with its
activation: the GEMM then silu_mul, against gemm_glu (the activation in the GEMM's
epilogue, on panels from gemm_pack_glu), which the engine takes where
packed_linear.glu_available says so.

Weights are cold as in a real step: each case cycles through 30 layers' worth of distinct
weights (a decode step reads every layer's weights once), and the time is per layer,
best of --repeats passes. Also checks that the two agree.

    python scripts/bench_gemm.py [--dtype bfloat16|float32] [--rows 1,8,16,32,64,128,256,2048]
    python scripts/bench_gemm.py --glu --dtype float32 --rows 33,64,2048
    python scripts/bench_gemm.py --shape qwen3-0.6b --dtype float32 --rows 1,8,16 --layers 8

`--shape` takes a benchmark shape's GEMMs (scripts/model_shapes.py) instead, and each
row also gives both kernels' weight read rate in GB/s: at few rows a GEMM should stream
its weights at the memory's rate.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.models import packed_linear
from kernels import cpu

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("head", 49152, 576)]


def per_layer(fn, layers: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(layers):
            fn(i)
        best = min(best, (time.perf_counter() - t) / layers)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,2048")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--glu", action="store_true", help="gate/up + silu_mul against gemm_glu")
    ap.add_argument("--shape", help="a benchmark shape of scripts/model_shapes.py instead of SmolLM2-135M's")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not cpu.gemm_available(dtype):
        raise SystemExit(f"this CPU or build has no native {args.dtype} GEMM (AVX-512, and AVX512_BF16 for bf16)")
    gen = torch.Generator().manual_seed(0)
    if args.glu:
        return glu(args, dtype, gen)
    shapes = SHAPES
    if args.shape:
        from bench_quant import shape_gemms  # scripts/ is on sys.path when run as a script

        layer, head = shape_gemms(args.shape)
        shapes = [(name, n, k) for name, (n, k) in zip(("qkv", "o", "gate_up", "down", "head"), [*layer, head])]
    print(f"torch threads {torch.get_num_threads()}; {args.dtype}; GFLOP/s per layer GEMM, weights cold")
    print(f"{'shape':8s} {'M':>5s} {'oneDNN':>8s} {'gemm':>8s} {'ratio':>6s} {'max |diff|':>10s}"
          f" {'oneDNN GB/s':>11s} {'gemm GB/s':>9s}")
    for name, n, k in shapes:
        layers = 2 if name == "head" else args.layers
        ws = [torch.randn(n, k, generator=gen).mul_(k ** -0.5).to(dtype) for _ in range(layers)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws]
        panels = [cpu.gemm_pack(w) for w in ws]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, generator=gen).to(dtype)
            ref = packed_linear.linear(x, packed[0], None)
            got = cpu.gemm(x, panels[0], n, None)
            diff = (ref.float() - got.float()).abs().max().item()
            t_dnn = per_layer(lambda i: packed_linear.linear(x, packed[i], None), layers, args.repeats)
            t_our = per_layer(lambda i: cpu.gemm(x, panels[i], n, None), layers, args.repeats)
            flop, size = 2 * m * n * k, n * k * ws[0].element_size()
            print(f"{name:8s} {m:5d} {flop / t_dnn / 1e9:8.1f} {flop / t_our / 1e9:8.1f} {t_dnn / t_our:5.2f}x "
                  f"{diff:10.4f} {size / t_dnn / 1e9:11.1f} {size / t_our / 1e9:9.1f}")


def glu(args, dtype: torch.dtype, gen: torch.Generator) -> None:
    _, n, k = next(s for s in SHAPES if s[0] == "gate_up")
    ws = [torch.randn(n, k, generator=gen).mul_(k ** -0.5).to(dtype) for _ in range(args.layers)]
    panels = [cpu.gemm_pack(w) for w in ws]
    fused = [cpu.gemm_pack_glu(w) for w in ws]
    print(f"torch threads {torch.get_num_threads()}; {args.dtype}; gate_up {n}x{k} and silu, ms per layer, "
          "weights cold")
    print(f"{'M':>5s} {'two ops':>8s} {'fused':>8s} {'ratio':>6s} {'same bits':>9s}")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, k, generator=gen).to(dtype)
        same = torch.equal(cpu.silu_mul(cpu.gemm(x, panels[0], n, None)), cpu.gemm_glu(x, fused[0], n // 2, None))
        two, one = float("inf"), float("inf")
        for _ in range(args.repeats):  # alternated, so drift in the machine hits both alike
            two = min(two, per_layer(lambda i: cpu.silu_mul(cpu.gemm(x, panels[i], n, None)), args.layers, 1))
            one = min(one, per_layer(lambda i: cpu.gemm_glu(x, fused[i], n // 2, None), args.layers, 1))
        print(f"{m:5d} {two * 1e3:8.3f} {one * 1e3:8.3f} {two / one:5.2f}x {str(same):>9s}")


if __name__ == "__main__":
    main()
