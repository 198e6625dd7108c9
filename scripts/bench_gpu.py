#!/usr/bin/env python
"""Offline throughput and batch-1 decode on a CUDA device, at a realistic shape with random
weights (scripts/model_shapes.py; `load_format="dummy"`), all in one run on one device:

- ours in bf16 with CUDA graphs, and with `enforce_eager`;
- transformers' batched `generate` on the same shape and dtype (random weights too);
- the batch-1 decode step against its floor: the weights' bytes over the device's measured
  copy bandwidth (a decode step reads every weight once).

    python scripts/bench_gpu.py [--shape qwen3-1.7b] [--requests 64] [--pairs 2] [--out results.md]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the engine, when run as a script

import model_shapes  # noqa: E402  (scripts/ is on sys.path when run as a script)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy, read and written both counted."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 4 / (start.elapsed_time(end) / 1e3)


def timed(fn) -> float:
    """Wall seconds of fn, the device's queued work included."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def start(path: Path, num_prompts: int, eager: bool):
    """Our engine on the device as every timing here runs it: bf16 random weights, the
    Triton kernels, CUDA graphs unless eager, no prefix caching."""
    from engine import LLM

    return LLM(str(path), load_format="dummy", dtype="bfloat16", device="cuda", attention_backend="triton",
               max_model_len=2048, max_num_seqs=max(64, num_prompts), gpu_memory_utilization=0.6,
               enforce_eager=eager, enable_prefix_caching=False)


def ours(path: Path, prompts: list[list[int]], out_len: int, eager: bool) -> dict[str, float]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    with start(path, len(prompts), eager) as llm:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up: every kernel specialisation the
        llm.generate(prompts[:1], one, use_tqdm=False)  # timings below meet is compiled here
        llm.generate(prompts[:1], params, use_tqdm=False)
        batch = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
        first = timed(lambda: llm.generate(prompts[:1], one, use_tqdm=False))
        single = timed(lambda: llm.generate(prompts[:1], params, use_tqdm=False))
    gc.collect()
    torch.cuda.empty_cache()
    return {"tok/s": len(prompts) * out_len / batch, "step ms": (single - first) / (out_len - 1) * 1e3}


def transformers_generate(path: Path, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts, device="cuda")

    def gen(x: torch.Tensor, n: int) -> None:
        with torch.no_grad():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)

    # Warmed up as ours is, the whole batch at full length: a 4-token warm-up left its first
    # timed batch 2.4x slower than its second (session 26).
    gen(ids, out_len)
    gen(ids[:1], out_len)
    batch = timed(lambda: gen(ids, out_len))
    first = timed(lambda: gen(ids[:1], 1))
    single = timed(lambda: gen(ids[:1], out_len))
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    model = None
    gc.collect()
    torch.cuda.empty_cache()
    return {"tok/s": len(prompts) * out_len / batch, "step ms": (single - first) / (out_len - 1) * 1e3,
            "weights": weights}


ENGINES = ("ours, CUDA graphs", "ours, enforce_eager", "transformers generate")


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / min(values)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(model_shapes.SHAPES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2, help="runs of the three, back to back (a ratio needs several)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    path = model_shapes.write(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    gen = torch.Generator().manual_seed(0)
    vocab = model_shapes.SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(3, vocab, (args.requests, args.input_len), generator=gen).tolist()
    bw = copy_bandwidth()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
    for _ in range(args.pairs):  # each pair: the three, back to back, so drift hits them alike
        runs["ours, CUDA graphs"].append(ours(path, prompts, args.output_len, eager=False))
        runs["ours, enforce_eager"].append(ours(path, prompts, args.output_len, eager=True))
        runs["transformers generate"].append(transformers_generate(path, prompts, args.output_len))
    floor_ms = runs["transformers generate"][0]["weights"] / bw * 1e3
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.shape} random weights, bf16; "
             f"{args.requests} requests x {args.input_len} prompt + {args.output_len} output tokens; copy bandwidth "
             f"{bw / 1e12:.2f} TB/s, so a batch-1 step's floor (weights / bandwidth) is {floor_ms:.2f} ms; "
             f"{args.pairs} run(s) of each, listed in order", "",
             "| engine | throughput (output tok/s) | spread | batch-1 decode step (ms) | spread | floor / best step |",
             "|---|---|---|---|---|---|"]
    for name, rs in runs.items():
        tps, steps = [r["tok/s"] for r in rs], [r["step ms"] for r in rs]
        lines.append(f"| {name} | {' / '.join(f'{v:.0f}' for v in tps)} | {spread(tps):.0%} | "
                     f"{' / '.join(f'{v:.2f}' for v in steps)} | {spread(steps):.0%} | {floor_ms / min(steps):.0%} |")
    g, e, t = (runs[name] for name in ENGINES)
    lines += ["", "per run: throughput graphs / transformers " + ", ".join(
                  f"{a['tok/s'] / c['tok/s']:.2f}x" for a, c in zip(g, t))
              + "; throughput graphs / eager " + ", ".join(f"{a['tok/s'] / b['tok/s']:.2f}x" for a, b in zip(g, e))
              + "; batch-1 step eager / graphs " + ", ".join(f"{b['step ms'] / a['step ms']:.2f}x"
                                                           for a, b in zip(g, e))]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
