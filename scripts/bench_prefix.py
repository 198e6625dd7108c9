"""Shared-prefix workload: prefix caching on against off, in one run.

A 1,000-token system prompt followed by 32 different questions, all submitted at once.
Reports mean and p50 time to first token and the prompt tokens the model computed, for
the engine with automatic prefix caching on and off, and the ratios.

    python scripts/bench_prefix.py --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


from engine import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "How do I reverse a list in Python?", "Why is the sky blue?",
    "Name three primary colours.", "What is 17 times 23?", "Explain photosynthesis briefly.",
    "Who wrote Pride and Prejudice?", "What does HTTP stand for?", "How many legs does a spider have?",
    "Give me a synonym for happy.", "What is the boiling point of water?", "Define entropy.",
    "What is a prime number?", "Translate 'good morning' to Spanish.", "What is the speed of light?",
    "Suggest a name for a cat.", "What is the largest ocean?", "How does a vaccine work?",
    "What is machine learning?", "Write a haiku about rain.", "What is the square root of 144?",
    "Who painted the Mona Lisa?", "What causes tides?", "What is an API?",
    "How many continents are there?", "What is the chemical symbol for gold?", "Explain recursion.",
    "What year did World War II end?", "What is a black hole?", "How do bees make honey?",
    "What is inflation?", "Recommend a good book.",
]


def system_prompt(tokenizer, length: int) -> str:
    base = ("You are a meticulous assistant for a large company. Follow the policies below. "
            "Policy {i}: answer politely, cite sources when you can, never reveal secrets, "
            "prefer short answers, and ask for clarification when a question is ambiguous. ")
    text, i = "", 0
    while len(tokenizer.encode(text)) < length:
        text += base.format(i=i)
        i += 1
    ids = tokenizer.encode(text)[:length]
    return tokenizer.decode(ids)


def run(caching: bool, args) -> dict:
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, max_num_seqs=32,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_bytes)
    tok = llm.tokenizer
    system = system_prompt(tok, args.prefix_tokens)
    prompts = [llm.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in QUESTIONS[: args.num_questions]]
    llm.generate([prompts[0][:50]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm up
    llm.reset_prefix_cache()
    before = llm.stats().prompt_tokens_computed
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    s = llm.stats()
    return {
        "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": s.prompt_tokens_computed - before,
        "hit_tokens": s.prefix_cache_hit_tokens, "wall_s": elapsed,
        "texts": [o.outputs[0].text for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--num-questions", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--json")
    args = ap.parse_args()

    res = {"off": run(False, args), "on": run(True, args)}
    for name in ("off", "on"):
        r = res[name]
        print(f"caching {name:3}: TTFT mean {r['ttft_mean_s']:.3f}s p50 {r['ttft_p50_s']:.3f}s, "
              f"prompt tokens computed {r['prompt_tokens_computed']} of {r['prompt_tokens']}, "
              f"hits {r['hit_tokens']}, wall {r['wall_s']:.1f}s")
    on, off = res["on"], res["off"]
    print(f"TTFT mean ratio (off/on): {off['ttft_mean_s'] / on['ttft_mean_s']:.1f}x")
    print(f"prompt tokens computed ratio (off/on): "
          f"{off['prompt_tokens_computed'] / on['prompt_tokens_computed']:.1f}x")
    same = on["texts"] == off["texts"]
    print(f"greedy outputs identical with caching on and off: {same}")
    if args.json:
        for r in res.values():
            r.pop("texts")
        Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
