#!/usr/bin/env python
"""Page faults of a warm engine's second pass over the same workload, with and without
kernels.cpu.keep_freed_memory, each side in fresh processes and alternated. The count is
a side effect the host shares in (a kernel that pages out cold memory, DAMON's pageout
scheme for one, adds faults from outside), so it belongs here and not in a unit test;
tests/engine/test_engine.py checks the allocator setting itself.

    python scripts/bench_page_faults.py [--model DIR] [--rounds 3]

Without --model it builds the tiny 4-layer Llama the old unit test used (random weights,
the embedded model's 49,152-token vocabulary, so a step's logits are megabytes).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKLOAD = """
import resource, sys
from kernels import cpu
if sys.argv[2] == "off":
    cpu.keep_freed_memory = lambda: False
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=64, enable_prefix_caching=False)
prompts = [[100 + i] * (8 + 5 * i) for i in range(64)]
params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True) for i in range(64)]
llm.generate(prompts, params, use_tqdm=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
llm.generate(prompts, params, use_tqdm=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def tiny_model(path: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from engine.models import loader
    from tests.support.tiny_models import build_tiny_model

    return build_tiny_model(path, loader.resolve(None).path, num_hidden_layers=4, hidden_size=128,
                            num_attention_heads=2, num_key_value_heads=1, intermediate_size=256)


def faults(model: str, mode: str) -> int:
    res = subprocess.run([sys.executable, "-c", WORKLOAD, model, mode], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return int(res.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an HF directory (default: a tiny random Llama)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(tiny_model(Path(tmp) / "tiny"))
        seen: dict[str, list[int]] = {"on": [], "off": []}
        for r in range(args.rounds):
            for mode in ("on", "off"):
                seen[mode].append(faults(model, mode))
            print(f"round {r + 1}: on {seen['on'][-1]:>8,}  off {seen['off'][-1]:>8,}", flush=True)
    for mode, counts in seen.items():
        print(f"{mode:>3}: fewest {min(counts):,}, median {statistics.median(counts):,.0f}, most {max(counts):,}")


if __name__ == "__main__":
    main()
