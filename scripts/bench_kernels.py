#!/usr/bin/env python
"""Achieved bandwidth and rate of the Triton paged-attention kernels, next to torch SDPA.

Decode attention reads every cached K/V byte once per step, so its ceiling is memory
bandwidth. For each (batch, context) this times one decode step of a Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16) and reports the bytes it must
move (K/V of every sequence + block table + q + out) over the kernel time, as GB/s and as a
share of the bandwidth of a large device-to-device tensor copy measured on the same GPU.
Prefill (every token of each sequence new, causal) reads q, K and V and writes out once, but
does L^2 work per sequence: its table gives both the bytes over time and TFLOP/s.

Times are medians of CUDA-graph replays, as the engine's decode steps run: an eager launch
of a Triton kernel costs tens of microseconds of host time, more than a batch-1 kernel
itself, and timing eager launches measured the host. A case whose bytes fit in the L2
cache says so: its GB/s is the cache's, not HBM's.

The paged cache and SDPA's contiguous cache are the same memory: a contiguous
[batch, ctx, kv_heads, head_dim] tensor viewed as blocks, with each sequence's blocks handed
out in shuffled order through the block table. Attention over a whole sequence is invariant
under permuting the keys and values together, so the two outputs must agree, and the table
prints their largest difference as a check.

    python scripts/bench_kernels.py [--out results.md]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # kernels/, when run as a script

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
COLUMNS = ["batch", "ctx", "splits", "paged us", "paged GB/s", "% of copy BW", "sdpa us",
           "paged/sdpa", "max |diff|", "note"]
PREFILL_COLUMNS = ["batch", "len", "paged us", "paged TFLOP/s", "% of copy BW", "sdpa us", "paged/sdpa",
                   "max |diff|", "note"]


def bench_ms(fn) -> float:
    """Median ms of one call, replayed from a CUDA graph (no host launch time in it)."""
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()  # it runs fn on a stream of its own, unordered after the inputs' writes
    return do_bench_cudagraph(fn, rep=100, return_mode="median")


def in_l2(nbytes: int) -> bool:
    return nbytes < torch.cuda.get_device_properties(0).L2_cache_size


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + bytes written)."""
    from triton.testing import do_bench

    x = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median")
    del x, y
    return 2 * (1 << 30) / (ms * 1e-3) / 1e9


def run_case(batch: int, ctx: int, copy_gbs: float) -> dict[str, str]:
    from kernels import triton_attention

    row = {"batch": str(batch), "ctx": str(ctx)}
    elem = torch.finfo(DTYPE).bits // 8
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * elem
    free, _ = torch.cuda.mem_get_info()
    if ctx % BLOCK_SIZE:
        row["note"] = f"skipped: ctx must be a multiple of block_size {BLOCK_SIZE}"
        return row
    if kv_bytes > 0.85 * free:
        row["note"] = f"skipped: K+V need {kv_bytes / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
        return row
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, ctx, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    blocks_per_seq = ctx // BLOCK_SIZE
    k_cache = k.view(batch * blocks_per_seq, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    v_cache = v.view(k_cache.shape)
    shuffle = torch.rand(batch, blocks_per_seq, device="cuda", generator=gen).argsort(dim=1)
    offsets = torch.arange(batch, device="cuda")[:, None] * blocks_per_seq
    block_tables = (offsets + shuffle).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(HEAD_DIM)
    out = torch.empty_like(q)
    splits = triton_attention.choose_num_splits(batch, NUM_KV_HEADS, ctx, q.device)

    def paged() -> torch.Tensor:
        return triton_attention.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                       seq_lens, scale, out=out)

    moved = kv_bytes + block_tables.numel() * 4 + 2 * q.numel() * elem
    paged_ms = bench_ms(paged)
    gbs = moved / (paged_ms * 1e-3) / 1e9
    row.update({"splits": str(splits), "paged us": f"{paged_ms * 1e3:.1f}",
                "paged GB/s": f"{gbs:.0f}", "% of copy BW": f"{100 * gbs / copy_gbs:.0f}%"})
    if in_l2(moved):
        row["note"] = "fits in L2"

    # SDPA over the contiguous cache: [B, H, 1, D] x [B, Hkv, L, D] views, GQA without copies.
    q4, k4, v4 = q[:, :, None], k.transpose(1, 2), v.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale,
                                                                enable_gqa=True)

    try:
        sdpa_ms = bench_ms(sdpa)
        diff = (paged().float() - sdpa()[:, :, 0].float()).abs().max().item()
        row.update({"sdpa us": f"{sdpa_ms * 1e3:.1f}", "paged/sdpa": f"{paged_ms / sdpa_ms:.2f}",
                    "max |diff|": f"{diff:.1e}"})
    except torch.OutOfMemoryError:
        row["note"] = "sdpa: out of memory"
    del k, v, k_cache, v_cache
    torch.cuda.empty_cache()
    return row


def run_prefill(batch: int, length: int, copy_gbs: float) -> dict[str, str]:
    """One causal prefill of `batch` sequences of `length` new tokens each."""
    from kernels import triton_attention

    row = {"batch": str(batch), "len": str(length)}
    if length % BLOCK_SIZE:
        row["note"] = f"skipped: len must be a multiple of block_size {BLOCK_SIZE}"
        return row
    elem = torch.finfo(DTYPE).bits // 8
    gen = torch.Generator(device="cuda").manual_seed(1)
    k = torch.randn(batch, length, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(k.shape, device="cuda", dtype=DTYPE, generator=gen)
    q = torch.randn(batch * length, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    blocks = length // BLOCK_SIZE
    # Causal attention is not invariant under permuting keys: logical block j of sequence i
    # holds its positions j*BLOCK_SIZE.., stored wherever the shuffled table says.
    block_tables = torch.randperm(batch * blocks, device="cuda", generator=gen).view(batch, blocks)
    k_cache = torch.empty(batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.empty_like(k_cache)
    k_cache[block_tables.flatten()] = k.view(k_cache.shape)
    v_cache[block_tables.flatten()] = v.view(k_cache.shape)
    block_tables = block_tables.to(torch.int32)
    starts = (torch.arange(batch + 1, device="cuda") * length).to(torch.int32)
    seq_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(HEAD_DIM)
    out = torch.empty_like(q)

    def paged() -> torch.Tensor:
        return triton_attention.paged_attention_prefill(q, k_cache, v_cache, block_tables, starts, seq_lens,
                                                        scale, out=out)

    moved = (2 * q.numel() + k.numel() + v.numel()) * elem + block_tables.numel() * 4
    flops = 2 * batch * NUM_HEADS * HEAD_DIM * length * (length + 1)  # QK^T and PV over the causal half
    paged_ms = bench_ms(paged)
    row.update({"paged us": f"{paged_ms * 1e3:.1f}", "paged TFLOP/s": f"{flops / (paged_ms * 1e-3) / 1e12:.0f}",
                "% of copy BW": f"{100 * moved / (paged_ms * 1e-3) / 1e9 / copy_gbs:.0f}%"})
    q4 = q.view(batch, length, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    k4, v4 = k.transpose(1, 2), v.transpose(1, 2)

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, scale=scale, is_causal=True,
                                                                enable_gqa=True)

    try:
        sdpa_ms = bench_ms(sdpa)
        ref = sdpa().transpose(1, 2).reshape(q.shape)
        diff = (paged().float() - ref.float()).abs().max().item()
        row.update({"sdpa us": f"{sdpa_ms * 1e3:.1f}", "paged/sdpa": f"{paged_ms / sdpa_ms:.2f}",
                    "max |diff|": f"{diff:.1e}"})
    except torch.OutOfMemoryError:
        row["note"] = "sdpa: out of memory"
    del k, v, q, k_cache, v_cache
    torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, str]], columns: list[str], header: str) -> str:
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(r.get(c, "") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_row(row: dict[str, str], columns: list[str]) -> None:
    print(" ".join(f"{row.get(c, '-'):>12}" for c in columns[:-1]), row.get("note", ""), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--prefill", default="1x512,1x4096,8x2048", help="BATCHxLEN cases; empty for none")
    parser.add_argument("--out", type=Path, help="also write the tables as markdown here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py measures GPU memory bandwidth and needs a CUDA device; "
              "torch.cuda.is_available() is False here. Nothing was measured.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    shape = (f"{NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
             f"{str(DTYPE).removeprefix('torch.')}, block_size {BLOCK_SIZE}")
    header = (f"Paged decode attention on {name}: {shape}. Device copy bandwidth: {copy_gbs:.0f} GB/s. "
              "Medians of CUDA-graph replays.")
    print(header, flush=True)
    print(" ".join(f"{c:>12}" for c in COLUMNS[:-1]), "note", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            rows.append(run_case(batch, ctx, copy_gbs))
            print_row(rows[-1], COLUMNS)
    text = table(rows, COLUMNS, header)
    if args.prefill:
        header = f"Paged causal prefill attention on {name}: {shape}."
        print(header, flush=True)
        print(" ".join(f"{c:>12}" for c in PREFILL_COLUMNS[:-1]), "note", flush=True)
        rows = []
        for case in args.prefill.split(","):
            batch, length = (int(x) for x in case.split("x"))
            rows.append(run_prefill(batch, length, copy_gbs))
            print_row(rows[-1], PREFILL_COLUMNS)
        text += "\n" + table(rows, PREFILL_COLUMNS, header)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
