#!/usr/bin/env python
"""The native CPU paged-attention kernel against the torch reference path, same shapes,
same run: one decode step of many sequences, and whole-prompt prefills (8 x 256 is one
2,048-token step of the served benchmark's prompts; 1 x 2,048 one long prompt).

The reference (kernels/reference.py) gathers each sequence's blocks into a dense tensor
and calls torch's SDPA; it is what the engine runs without a compiler. Shapes follow
the embedded SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64, block 16); block
tables are shuffled. Reports the minimum over repeats (this VM's timings are noisy),
the bytes of K/V read per second for decode, and the ratio.

Those caches fit in L3 (64 x 300 tokens is 29 MB in fp32). `--cold` instead times decode
as a model step meets it: 64 sequences of 350 tokens, one call per layer over 30 layers'
caches in turn, so each layer's K/V comes from DRAM; it prints the read rate of each of
eight passes over the 30 layers, and their median. `--decode-one` times a lone sequence's
decode, as batch-1 serving meets it, on Qwen3-0.6B's attention (16 query heads, 8 KV
heads, head_dim 128) over 28 layers' caches, at several context lengths. `--long-prompts`
times whole prompts of 2,048 and 4,096 tokens in four head layouts (bf16 takes the AMX
tiles where the CPU has them; PAGEDSERVE_GEMM_TILES=0 keeps the AVX-512 kernel).

    python scripts/bench_cpu_attention.py [--dtype float32] [--repeats 50]
    python scripts/bench_cpu_attention.py --cold [--dtype bfloat16]
    python scripts/bench_cpu_attention.py --cold --qwen3 16,400   # 16 sequences of 400 tokens, Qwen3's heads
    python scripts/bench_cpu_attention.py --decode-one
    python scripts/bench_cpu_attention.py --long-prompts --dtype bfloat16   # PAGEDSERVE_GEMM_TILES=0: without AMX
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu, reference
from timing import best  # scripts/ is on sys.path when run as a script

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [("decode", 64, 300, 1), ("decode", 64, 600, 1), ("decode", 8, 300, 1), ("decode", 1, 300, 1),
         ("prefill", 1, 500, 500), ("prefill", 4, 512, 512), ("prefill", 8, 256, 256), ("prefill", 1, 2048, 2048)]


def make(seqs: int, ctx: int, q_len: int, dtype: torch.dtype, gen: torch.Generator,
         heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM)):
    h, hkv, d = heads
    nb = (ctx + BLOCK - 1) // BLOCK
    k = torch.randn(seqs * nb + 1, BLOCK, hkv, d, generator=gen).to(dtype)
    v = torch.randn(k.shape, generator=gen).to(dtype)
    tables = torch.randperm(seqs * nb, generator=gen).to(torch.int32).view(seqs, nb)
    q = torch.randn(seqs * q_len, h, d, generator=gen).to(dtype)
    qsl = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    return q, k, v, tables, qsl, lens


def cold(dtype: torch.dtype, gen: torch.Generator, seqs: int = 64, ctx: int = 350, layers: int = 30,
         heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM)) -> None:
    scale = heads[2] ** -0.5
    caches = [make(seqs, ctx, 1, dtype, gen, heads) for _ in range(layers)]
    kv_bytes = layers * 2 * seqs * ctx * heads[1] * heads[2] * caches[0][1].element_size()
    rates = []
    for _ in range(8):
        t = time.perf_counter()
        for q, k, v, tables, qsl, lens in caches:
            cpu.paged_attention(q, k, v, tables, qsl, lens, scale)
        rates.append(kv_bytes / (time.perf_counter() - t) / 1e9)
    print(f"decode, {seqs} x {ctx} tokens, {layers} layers' caches ({kv_bytes / 2**30:.2f} GiB): GB/s per pass "
          + " ".join(f"{r:.1f}" for r in rates) + f"; median {statistics.median(rates):.1f}")


def decode_one(dtype: torch.dtype, gen: torch.Generator, layers: int = 28) -> None:
    heads = (16, 8, 128)
    for ctx in (64, 190, 512, 2048):
        caches = [make(1, ctx, 1, dtype, gen, heads) for _ in range(layers)]
        kv_bytes = 2 * ctx * heads[1] * heads[2] * caches[0][1].element_size()
        passes = []
        for _ in range(20):
            t = time.perf_counter()
            for q, k, v, tables, qsl, lens in caches:
                cpu.paged_attention(q, k, v, tables, qsl, lens, heads[2] ** -0.5)
            passes.append((time.perf_counter() - t) / layers)
        per_layer = statistics.median(passes)
        print(f"one sequence, {ctx:5d} tokens: {per_layer * 1e6:6.1f} us a layer, {kv_bytes / per_layer / 1e9:5.1f} GB/s")


def long_prompts(dtype: torch.dtype, gen: torch.Generator, repeats: int = 3) -> None:
    """One whole prompt of 2,048 and 4,096 tokens, causal, per head layout: milliseconds a
    layer and GFLOP/s (4 * ctx^2 / 2 * heads * head_dim, the causal half)."""
    for heads in ((9, 3, 64), (16, 8, 128), (16, 8, 64), (16, 16, 128)):
        for ctx in (2048, 4096):
            q, k, v, tables, qsl, lens = make(1, ctx, ctx, dtype, gen, heads)
            secs = best(lambda: cpu.paged_attention(q, k, v, tables, qsl, lens, heads[2] ** -0.5), repeats)
            flops = 4 * ctx * ctx / 2 * heads[0] * heads[2]
            print(f"heads {heads[0]:2d}/{heads[1]:2d} x {heads[2]:3d}, {ctx:5d} tokens: {secs * 1e3:7.1f} ms a layer, "
                  f"{flops / secs / 1e9:6.0f} GFLOP/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--cold", action="store_true", help="decode over 30 layers' caches, from DRAM")
    ap.add_argument("--decode-one", action="store_true", help="one sequence's decode, Qwen3-0.6B heads")
    ap.add_argument("--qwen3", metavar="SEQS,CTX", help="--cold on Qwen3's heads (16, 8 KV, head_dim 128), 28 layers")
    ap.add_argument("--long-prompts", action="store_true", help="whole 2,048- and 4,096-token prompts, four head layouts")
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit("the native CPU kernels could not be built")
    dtype = getattr(torch, args.dtype)
    scale = HEAD_DIM**-0.5
    gen = torch.Generator().manual_seed(0)
    if args.cold and args.qwen3:
        seqs, ctx = (int(x) for x in args.qwen3.split(","))
        return cold(dtype, gen, seqs, ctx, 28, (16, 8, 128))
    if args.long_prompts:
        return long_prompts(dtype, gen)
    if args.cold or args.decode_one:
        (cold if args.cold else decode_one)(dtype, gen)
        return
    print(f"torch threads {torch.get_num_threads()}, {args.dtype}")
    print(f"{'case':8s} {'seqs':>5s} {'ctx':>5s} {'native ms':>10s} {'torch ms':>9s} {'speed-up':>9s} {'native GB/s':>12s}")
    for kind, seqs, ctx, q_len in CASES:
        q, k, v, tables, qsl, lens = make(seqs, ctx, q_len, dtype, gen)
        reps = args.repeats if kind == "decode" else max(3, args.repeats // 10)
        native = best(lambda: cpu.paged_attention(q, k, v, tables, qsl, lens, scale), reps)
        if kind == "decode":
            ref = best(lambda: reference.paged_attention_decode(q, k, v, tables, lens, scale), reps)
        else:
            ref = best(lambda: reference.paged_attention_prefill(q, k, v, tables, qsl, lens, scale), reps)
        kv_bytes = 2 * seqs * ctx * KV_HEADS * HEAD_DIM * k.element_size()
        gbs = f"{kv_bytes / native / 1e9:12.1f}" if kind == "decode" else f"{'':12s}"
        print(f"{kind:8s} {seqs:5d} {ctx:5d} {native * 1e3:10.2f} {ref * 1e3:9.2f} {ref / native:8.2f}x {gbs}")


if __name__ == "__main__":
    main()
