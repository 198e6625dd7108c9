"""The quantized GEMM kernels (kernels/csrc/quant.cpp, qgemm.cpp) alone, against the
fp32 GEMM the engine uses otherwise (oneDNN, prepacked weights), on the embedded model's
shapes, or with `--shape` a benchmark shape's (scripts/model_shapes.py; its K are whole
256-weight superblocks, so the K-quants run there too).

For each row count M it reports milliseconds per pass over all of one layer's GEMMs plus
the head, the weight bytes read per second, and the ratio to fp32 in the same run; with
`--both`, also each kernel forced on every row count (few rows: quant.cpp's; many:
qgemm.cpp's), whose crossover sets quant.cpp's few_rows_kernel.

    python scripts/bench_quant.py
    python scripts/bench_quant.py --rows 1,2,4,16,64,256 --types Q4_1,Q8_0,int8
    python scripts/bench_quant.py --rows 8,12,16,24,32,48,64 --both
    python scripts/bench_quant.py --rss
    python scripts/bench_quant.py --shape qwen3-0.6b --rows 1 --types Q4_K,Q6_K,Q8_0,Q4_0

`--rss` instead loads the embedded model (or `--model`) with each setting (`--modes`,
default null, gguf, int8) in a fresh process and reports its resident memory after
loading and its peak during the load, beside the weight bytes the engine reports: what a
replica costs before any KV cache. `--first-load` starts each in an empty conversion
cache, so a GGUF converts (the first start of a model), and adds what the cache holds.

    python scripts/bench_quant.py --rss --model /tmp/gpt-oss-shape --modes ,mxfp4
    python scripts/bench_quant.py --rss --first-load --model /tmp/q17-q4km.gguf --modes gguf
    python scripts/bench_quant.py --rss --first-load --model /tmp/q17-q4km.gguf --modes '' --dtype bfloat16

`--cold` times one decode row through each of a layer's GEMMs as a model step meets
them: `--layers` copies of each weight on huge pages as the engine has them, called in
turn, so every block comes from DRAM (the hot loop above reads weights a cache may
hold); it prints each GEMM's read rate with int8 activations, the median over passes.

    python scripts/bench_quant.py --cold --shape qwen3-0.6b --types Q4_K,Q6_K
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from timing import best  # scripts/ is on sys.path when run as a script
from engine.models import packed_linear
from kernels import pages, quant

# (N, K) of SmolLM2-135M's GEMMs: qkv, o, gate_up, down; the head separately.
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
NAMES = {f.name: qtype for qtype, f in quant.FORMATS.items()}  # Q4_0 ... MXFP4, and "int8"


def blocks(qtype: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    if qtype == quant.INT8_ROWS:
        return quant.quantize_int8(torch.randn(n, k, generator=gen))
    f = quant.FORMATS[qtype]
    raw = torch.randint(0, 256, (n * (k // f.block), f.bytes), dtype=torch.uint8, generator=gen)
    if qtype == quant.MXFP4:
        raw[:, 0] = 120  # 2^-7
        return raw.reshape(n, quant.row_bytes(qtype, k)), None
    at = 208 if qtype == quant.Q6_K else 0
    raw[:, at:at + 2] = torch.full((raw.shape[0],), 0.01, dtype=torch.float16).view(torch.uint8).reshape(-1, 2)
    if qtype in (quant.Q4_1, quant.Q5_1, quant.Q4_K, quant.Q5_K):
        raw[:, 2:4] = raw[:, 0:2]
    return raw.reshape(n, quant.row_bytes(qtype, k)), None


def shape_gemms(name: str) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(N, K) of a dense benchmark shape's layer GEMMs (qkv, o, gate_up, down) and its head."""
    from model_shapes import SHAPES  # scripts/ is on sys.path when run as a script

    s = SHAPES[name]
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    inter = s["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)], (s["vocab_size"], h)


def best_ms(fn, repeats: int) -> float:
    return best(fn, repeats) * 1e3


LOAD = """
import json, sys, time
from engine import LLM
t = time.perf_counter()
llm = LLM(sys.argv[2] or None, dtype=sys.argv[3], quantization=sys.argv[1] or None, kv_cache_memory_bytes=64 << 20, max_model_len=256)
seconds = time.perf_counter() - t
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
rss, peak = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
print(json.dumps({"rss_mb": rss, "peak_mb": peak, "load_s": seconds, "weight_mb": llm.stats().weight_bytes / 1e6}))
"""


def rss(model: str, modes: str, first_load: bool, dtype: str) -> None:
    """Each setting in its own process: RSS after loading and its peak during the load,
    against the weights' own bytes; `first_load`: each in an empty conversion cache, with
    what the cache then holds."""
    print(f"{'setting':>8} {'weights MB':>11} {'RSS MB':>8} {'peak MB':>8} {'load s':>7}"
          + (f" {'cache MB':>9}" if first_load else ""))
    for mode in modes.split(","):
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as cache:
            env = dict(os.environ, PAGEDSERVE_CACHE=cache) if first_load else None
            out = subprocess.run([sys.executable, "-c", LOAD, mode, model, dtype], capture_output=True, text=True,
                                 check=True, env=env)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            held = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file()) / 1e6
        print(f"{mode or 'null':>8} {r['weight_mb']:11.1f} {r['rss_mb']:8.1f} {r['peak_mb']:8.1f} {r['load_s']:7.1f}"
              + (f" {held:9.1f}" if first_load else ""))


def cold(shape: str | None, types: str, layers: int, gen: torch.Generator) -> None:
    layer = shape_gemms(shape)[0] if shape else LAYER
    print(f"{'format':>6} " + " ".join(f"{f'{n}x{k} GB/s':>14}" for n, k in layer))
    for name in types.split(","):
        qtype, rates = NAMES[name], []
        for n, k in layer:
            # on 2 MiB pages, as the engine places quantized blocks (kernels/pages.py)
            copies = [(pages.move(w), sc) for w, sc in (blocks(qtype, n, k, gen) for _ in range(layers))]
            x = torch.randn(1, k, generator=gen)
            passes = []
            for _ in range(9):
                t = time.perf_counter()
                for w, sc in copies:
                    quant.qlinear(x, w, sc, qtype, k, int8_activations=True)
                passes.append(time.perf_counter() - t)
            rates.append(layers * copies[0][0].numel() / statistics.median(passes[1:]) / 1e9)
        print(f"{name:>6} " + " ".join(f"{r:14.1f}" for r in rates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,64,256")
    ap.add_argument("--types", default="Q4_1,Q8_0,int8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--both", action="store_true", help="also each kernel forced at every row count")
    ap.add_argument("--rss", action="store_true", help="resident memory after loading, per setting")
    ap.add_argument("--model", default="", help="--rss: this model instead of the embedded one")
    ap.add_argument("--modes", default=",gguf,int8", help="--rss: the quantization settings, '' for null")
    ap.add_argument("--first-load", action="store_true", help="--rss: each setting in an empty conversion cache")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--rss: the engine's dtype (the quantized settings need float32)")
    ap.add_argument("--a8", action="store_true", help="also each type with int8 activations (decode rows)")
    ap.add_argument("--shape", help="a dense shape of scripts/model_shapes.py instead of the embedded model's")
    ap.add_argument("--cold", action="store_true", help="one decode row, each weight from DRAM (int8 activations)")
    ap.add_argument("--layers", type=int, default=28, help="--cold: copies of each weight called in turn")
    args = ap.parse_args()
    if args.rss:
        return rss(args.model, args.modes, args.first_load, args.dtype)
    gen = torch.Generator().manual_seed(0)
    if args.cold:
        return cold(args.shape, args.types, args.layers, gen)
    layer, head = shape_gemms(args.shape) if args.shape else (LAYER, HEAD)
    shapes = layer + [head]
    dense = [packed_linear.PackedLinear(torch.randn(n, k, generator=gen), None) for n, k in shapes]
    fp32_bytes = sum(n * k * 4 for n, k in shapes)
    quants = {name: [blocks(NAMES[name], n, k, gen) for n, k in shapes] for name in args.types.split(",")}
    kernels = ["auto"] + (["few", "many"] if args.both else [])
    print(f"{'rows':>5} {'format':>6} {'ms':>8} {'GB/s':>7} {'GFLOP/s':>8} {'vs fp32':>8}"
          + "".join(f" {k + ' ms':>8}" for k in kernels[1:]) + (f" {'a8 ms':>8} {'a8 GB/s':>8}" if args.a8 else ""))
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        flops = sum(2 * m * n * k for n, k in shapes)
        fp_ms = best_ms(lambda: [lin(xs[lin.in_features]) for lin in dense], args.repeats)
        print(f"{m:>5} {'fp32':>6} {fp_ms:8.3f} {fp32_bytes / fp_ms / 1e6:7.1f} {flops / fp_ms / 1e6:8.1f} {1:8.2f}")
        for name, ws in quants.items():
            qtype = NAMES[name]

            def run(kernel: str, a8: bool = False) -> None:
                for (n, k), (w, s) in zip(shapes, ws):
                    quant.qlinear(xs[k], w, s, qtype, k, kernel=kernel, int8_activations=a8)

            ms = [best_ms(lambda: run(kernel), args.repeats) for kernel in kernels]
            nbytes = sum(w.numel() for w, _ in ws)
            a8 = ""
            if args.a8:
                a8_ms = best_ms(lambda: run("auto", True), args.repeats)
                a8 = f" {a8_ms:8.3f} {nbytes / a8_ms / 1e6:8.1f}"
            print(f"{m:>5} {name:>6} {ms[0]:8.3f} {nbytes / ms[0] / 1e6:7.1f} {flops / ms[0] / 1e6:8.1f}"
                  f" {fp_ms / ms[0]:8.2f}" + "".join(f" {t:8.3f}" for t in ms[1:]) + a8)


if __name__ == "__main__":
    main()
