"""Resident memory against the variety of batch shapes, with and without GEMM row bucketing.

    python scripts/memory_shapes.py            # both measurements, bucketed then not
    python scripts/memory_shapes.py --gemm     # only the GEMM sweep

A serving engine runs its GEMMs at every row count from 1 to its token budget, and
oneDNN keeps JIT kernels and state per shape. Two measurements, each in a fresh child
process so neither inherits the other's caches:
- gemm: the packed qkv, o and gate_up GEMMs of SmolLM2-135M at every M in 1..512, twice;
  RSS before, after the first sweep and after the second;
- engine: the offline LLM on rounds of 150 random requests (prompts 8-256 tokens,
  outputs 1-16, n 1-2); RSS after each round.
Each runs with engine/models/packed_linear.ROWS as shipped and with bucketing off. The
bucketing is oneDNN's: where the native GEMM runs instead (kernels/csrc/gemm.cpp, AVX-512
CPUs), it keeps no state per shape and runs every row count as it comes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def gemm() -> list[int]:
    import psutil
    import torch

    from engine.models.packed_linear import PackedLinear

    torch.manual_seed(0)
    proc = psutil.Process()
    layers = [PackedLinear(torch.randn(o, i), None) for o, i in [(960, 576), (576, 576), (3072, 576)]]
    rss = [proc.memory_info().rss >> 20]
    for _ in range(2):
        for m in range(1, 513):
            x = torch.randn(m, 576)
            for layer in layers:
                layer(x)
        rss.append(proc.memory_info().rss >> 20)
    return rss


def engine(rounds: int) -> list[int]:
    import random

    import psutil

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(None, dtype="float32", max_num_seqs=32, max_num_batched_tokens=512, max_model_len=512,
              kv_cache_memory_bytes=90 << 20)
    rng, proc, rss = random.Random(0), psutil.Process(), []
    for _ in range(rounds):
        prompts = [[rng.randint(100, 40000) for _ in range(rng.randint(8, 256))] for _ in range(150)]
        params = [SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True, n=rng.choice([1, 1, 1, 2]),
                                 temperature=rng.choice([0.0, 1.0])) for _ in prompts]
        llm.generate(prompts, params, use_tqdm=False)
        rss.append(proc.memory_info().rss >> 20)
    return rss


def child(what: str, bucketed: bool, rounds: int) -> None:
    from engine.models import packed_linear

    if not bucketed:
        packed_linear.ROWS = 1 << 30  # every row count exact, as before the bucketing
    print(json.dumps(gemm() if what == "gemm" else engine(rounds)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemm", action="store_true", help="only the GEMM sweep")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--child", nargs=2, metavar=("WHAT", "BUCKETED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1] == "1", args.rounds)
        return 0
    for what in ["gemm"] + ([] if args.gemm else ["engine"]):
        for bucketed in (True, False):
            out = subprocess.run([sys.executable, __file__, "--rounds", str(args.rounds), "--child", what,
                                  str(int(bucketed))], capture_output=True, text=True, check=True)
            rss = json.loads(out.stdout.strip().splitlines()[-1])
            label = "bucketed" if bucketed else "exact rows"
            print(f"{what:6s} {label:10s} RSS MB: {' -> '.join(map(str, rss))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
