"""Run the throughput workload through vLLM's offline LLM; print one JSON line a run.

Runs inside vLLM's own virtual environment (.peers/vllm, see scripts/setup_vllm_peer.sh),
never the project's: `scripts/bench_throughput.py --peer vllm` starts it as a subprocess
with the workload in a JSON file, so both engines see exactly the same token ids. Once
loaded it prints `{"startup": ...}`, then reads run counts from stdin, one a line, and
times that many runs of the workload for each, so that the caller can alternate it with
its own engine while both stay loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="HF directory (the same weights our engine loads)")
    ap.add_argument("--workload", required=True, help="JSON: [[prompt_ids, max_tokens], ...]")
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--load-format", default="auto", help="dummy: random weights of the config's shape")
    ap.add_argument("--max-model-len", type=int, default=1024, help="the longest prompt plus output it must take")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = json.load(open(args.workload))
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=0,
              load_format=args.load_format)
    startup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    llm.generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    print(json.dumps({"startup": startup}), flush=True)
    for line in sys.stdin:
        for _ in range(int(line)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            produced = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"elapsed": elapsed, "produced": produced}), flush=True)


if __name__ == "__main__":
    main()
