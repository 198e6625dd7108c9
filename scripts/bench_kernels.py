#!/usr/bin/env python
"""Achieved HBM bandwidth of the Triton paged decode kernel, next to torch SDPA.

Decode attention reads every cached K/V byte once per step, so its ceiling is memory
bandwidth. For each (batch, context) this times one decode step of a Llama-3-8B-shaped layer
(32 query heads, 8 KV heads, head_dim 128, bf16, block_size 16) and reports the bytes it must
move (K/V of every sequence + block table + q + out) over the kernel time, as GB/s and as a
share of the bandwidth of a large device-to-device tensor copy measured on the same GPU.

The paged cache and SDPA's contiguous cache are the same memory: a contiguous
[batch, ctx, kv_heads, head_dim] tensor viewed as blocks, with each sequence's blocks handed
out in shuffled order through the block table. Decode attention over a whole context is
invariant under permuting the keys and values together, so the two outputs must agree, and
the table prints their largest difference as a check.

    python scripts/bench_kernels.py [--out results.md]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch


NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
COLUMNS = ["batch", "ctx", "splits", "paged us", "paged GB/s", "% of copy BW", "sdpa us",
           "paged/sdpa", "max |diff|", "note"]


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median")  # flushes L2 between runs


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read + bytes written)."""
    x = torch.empty(1 << 29, dtype=torch.int16, device="cuda").random_()
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
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


def markdown(rows: list[dict[str, str]], header: str) -> str:
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r.get(c, "") for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--contexts", default="512,4096,32768")
    parser.add_argument("--out", type=Path, help="also write the table as markdown here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py measures GPU memory bandwidth and needs a CUDA device; "
              "torch.cuda.is_available() is False here. Nothing was measured.", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    copy_gbs = copy_bandwidth()
    header = (f"Paged decode attention on {name}: {NUM_HEADS} q heads, {NUM_KV_HEADS} kv heads, "
              f"head_dim {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')}, block_size "
              f"{BLOCK_SIZE}. Device copy bandwidth: {copy_gbs:.0f} GB/s.")
    print(header, flush=True)
    print(" ".join(f"{c:>12}" for c in COLUMNS[:-1]), "note", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            row = run_case(batch, ctx, copy_gbs)
            rows.append(row)
            print(" ".join(f"{row.get(c, '-'):>12}" for c in COLUMNS[:-1]), row.get("note", ""),
                  flush=True)
    if args.out:
        args.out.write_text(markdown(rows, header))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
