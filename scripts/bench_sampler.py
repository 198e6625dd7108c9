#!/usr/bin/env python
"""The sampler's time per call on a served step's shape: 64 rows of the model's 49,152
logits, peaked as a language model's next-token scores usually are, for greedy and the
usual sampling settings. Run it in a worktree of older code (PYTHONPATH set to it) for
a before/after pair.

    python scripts/bench_sampler.py [--rows 64] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch

from timing import best  # scripts/ is on sys.path when run as a script
from engine.sampler import Sampler, SamplingRow
from engine.sampling_params import SamplingParams

SETTINGS = {
    "greedy": {"temperature": 0.0},
    "T=1": {"temperature": 1.0},
    "T=0.7 top_p=0.9": {"temperature": 0.7, "top_p": 0.9},
    "T=0.7 top_k=50": {"temperature": 0.7, "top_k": 50},
    "min_p=0.05": {"min_p": 0.05},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.vocab, generator=gen) * 2.5
    x[:, :10] += 12  # a few likely tokens per row
    sampler = Sampler([0])
    print(f"torch threads {torch.get_num_threads()}, {args.rows} rows x {args.vocab}")
    for name, kw in SETTINGS.items():
        rows = [SamplingRow(SamplingParams(**kw), None, list(range(256)), list(range(50))) for _ in range(args.rows)]
        print(f"{name:>16s} {best(lambda: sampler(x, rows), args.repeats) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
