"""Offline throughput: the engine against transformers `generate`, one fixed workload, one run.

The workload: 64 requests, prompts of 30-500 random tokens, outputs of 16-256 tokens,
greedy, ignoring eos so every system produces exactly the same number of tokens. It runs
three ways -- the engine, transformers one request at a time, and transformers in
static left-padded batches of 16 (each batch runs until its longest output is done;
only the requested tokens count) -- and prints output tokens/s, the ratios and the
engine's mean KV waste.

    python scripts/bench_throughput.py --dtype float32
    python scripts/bench_throughput.py --dtype bfloat16 --skip single
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch


from engine import LLM, SamplingParams
from engine.models import loader


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(30, 500))]
        reqs.append((prompt, rng.randint(16, 256)))
    return reqs


def run_engine(model_dir: str | None, dtype: str, reqs, args) -> tuple[float, dict]:
    llm = LLM(model_dir, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_bytes)
    warm = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    llm.generate([reqs[0][0]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out for _, out in reqs), "engine produced the wrong number of tokens"
    return elapsed, llm.stats()


def load_hf(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


@torch.inference_mode()
def run_hf_single(model, reqs) -> float:
    model.generate(torch.tensor([reqs[0][0]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    for prompt, out in reqs:
        ids = torch.tensor([prompt])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out, min_new_tokens=out,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf_static(model, reqs, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        longest = max(out for _, out in chunk)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF dir or GGUF; default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--skip", nargs="*", default=[], choices=["engine", "single", "static"])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    files = loader.resolve(args.model)
    config = loader.load_config(files)
    reqs = workload(args.num_requests, args.seed, config.vocab_size)
    total_out = sum(out for _, out in reqs)
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{total_out} output tokens; dtype {args.dtype}; torch threads {torch.get_num_threads()}")

    results: dict[str, float] = {}
    stats = None
    if "engine" not in args.skip:
        secs, stats = run_engine(args.model, args.dtype, reqs, args)
        results["engine"] = total_out / secs
        print(f"engine:            {results['engine']:8.1f} tok/s  ({secs:.1f}s, "
              f"mean KV waste {stats.kv_waste_mean:.2%}, preemptions {stats.num_preemptions})")
    if not {"single", "static"} <= set(args.skip):
        model = load_hf(files.path, args.dtype)
        if "static" not in args.skip:
            secs = run_hf_static(model, reqs, args.static_batch)
            results["hf_static"] = total_out / secs
            print(f"hf static batch {args.static_batch}: {results['hf_static']:8.1f} tok/s  ({secs:.1f}s)")
        if "single" not in args.skip:
            secs = run_hf_single(model, reqs)
            results["hf_single"] = total_out / secs
            print(f"hf one at a time:  {results['hf_single']:8.1f} tok/s  ({secs:.1f}s)")
    if "engine" in results:
        for peer in ("hf_single", "hf_static"):
            if peer in results:
                print(f"engine / {peer}: {results['engine'] / results[peer]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "dtype": args.dtype, "tokens_per_s": results, "kv_waste_mean": stats and stats.kv_waste_mean,
            "preemptions": stats and stats.num_preemptions, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        }, indent=2))


if __name__ == "__main__":
    main()
