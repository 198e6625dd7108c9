#!/usr/bin/env python
"""Where a decode step's time goes on a CUDA device: the host (cProfile of the engine's
Python) and the device (torch.profiler's kernel times), with CUDA graphs and eagerly, at a
realistic shape with random weights. bench_gpu.py says how fast; this says why.

    python scripts/profile_gpu.py [--shape qwen3-1.7b] [--requests 64] [--out DIR]
    python scripts/profile_gpu.py --requests 1 --output-len 128 --modes graphs   # the batch-1 step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the engine, when run as a script

import model_shapes  # noqa: E402  (scripts/ is on sys.path when run as a script)
from bench_gpu import start, timed  # noqa: E402


def profile(path: Path, prompts: list[list[int]], out_len: int, eager: bool, out: Path) -> list[str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine import SamplingParams

    mode = "eager" if eager else "graphs"
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    with start(path, len(prompts), eager) as llm:
        run = lambda n: llm.generate(prompts[:n], params, use_tqdm=False)  # noqa: E731
        run(len(prompts))
        run(1)  # every kernel specialisation either timing meets is compiled now
        lines = [f"== {mode}: batch {len(prompts)} x {out_len} tokens {timed(lambda: run(len(prompts))):.3f} s, "
                 f"batch 1 x {out_len} tokens {timed(lambda: run(1)):.3f} s"]
        prof = cProfile.Profile()
        prof.enable()
        run(len(prompts))
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(r"/(engine|kernels)/", 40)
        (out / f"host_{mode}.txt").write_text(text.getvalue())
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            wall = timed(lambda: run(len(prompts)))
        table = tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60)
        (out / f"device_{mode}.txt").write_text(table)
        busy = sum(e.self_device_time_total for e in tp.key_averages()) / 1e6
        lines.append(f"-- {mode}: device busy {busy:.3f} s of {wall:.3f} s wall (profiled); "
                     f"host_{mode}.txt and device_{mode}.txt hold the tables")
    torch.cuda.empty_cache()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-1.7b", choices=sorted(model_shapes.SHAPES))
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--modes", default="graphs,eager", help="which of graphs and eager to profile, in order")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or set(modes) - {"graphs", "eager"}:
        ap.error("--modes takes graphs, eager or both")
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    path = model_shapes.write(args.shape, Path(tempfile.mkdtemp()) / args.shape)
    gen = torch.Generator().manual_seed(0)
    vocab = model_shapes.SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(3, vocab, (args.requests, args.input_len), generator=gen).tolist()
    for mode in modes:
        print("\n".join(profile(path, prompts, args.output_len, mode == "eager", args.out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
