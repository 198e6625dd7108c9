"""The batch-1 trap: one request at a time, ours against transformers' contiguous KV cache.

Paged attention pays for its indirection when only one sequence runs. This measures
time to first token for a 500-token prompt and then the decode rate of that lone
request, for our engine and for transformers `generate` (contiguous cache), same model,
same dtype, same run. Each side is measured `--repeats` times and the median reported;
each of our engines runs in a process of its own. `--quantization gguf,int8` adds our
engine on quantized weights (engine/models/quantize.py) to the same run; `--profile`
then decodes once more per engine under StepProfile and prints where a batch-1 step's
time goes; `--no-hf` leaves transformers out; `--peer llama` adds llama.cpp's
llama-server on the same GGUF file and the same token ids, with every core
(scripts/peers/setup_llama_server.sh builds it under .peers/).

Speculative decoding: `--workload grounded` (requests that copy their input: rewrite,
extract, quote, edit code) or `--workload chat` (open chat) from scripts/workloads.py,
each request greedy until eos or --new-tokens, and `--speculative` a JSON list of
speculative_config values, each an engine of its own beside the unspeculated one.
Greedy output is the same with and without speculation, so every side decodes the same
tokens. `--rounds N` repeats all sides N times in turn and prints each round's ratio.

    python scripts/bench_latency.py --dtype float32
    python scripts/bench_latency.py --prompt-len 256 --quantization gguf,int8 --no-hf --peer llama
    python scripts/bench_latency.py --model /tmp/moe-q4km.gguf --quantization gguf --no-hf --peer llama
    python scripts/bench_latency.py --workload grounded --no-hf --rounds 3 \
        --speculative '[{"method": "ngram"}, {"method": "draft", "quantization": "gguf"}]'

Beam search: `--beam-width W` times our in-engine beam search against vLLM's design, a
loop of one request per beam per step over our engine with prefix caching
(scripts/beam_bench.py), on the random prompt, eos ignored.

    python scripts/bench_latency.py --beam-width 4 --rounds 3
    python scripts/bench_latency.py --beam-blocks 2,4,8 --prompt-len 400 --new-tokens 48

`--isa avx2` runs both sides' AVX2 code on an AVX-512 machine, for the CPUs without
AVX-512 that many deployments (and CI) run on: our kernels built for x86-64-v3
(kernels/cpu.py PAGEDSERVE_CPU_MARCH), ATen and oneDNN held to AVX2, and llama-server
built without AVX-512 (`scripts/peers/setup_llama_server.sh avx2`). The same code then
runs on wider, faster cores than an AVX2 CPU's, so it shows the two programs' ratio, not
an AVX2 machine's speed.

    python scripts/bench_latency.py --isa avx2 --model /tmp/moe-q4km.gguf --quantization gguf-a8 --no-hf --peer llama
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from engine import LLM, SamplingParams
from engine.models import loader


def ours(llm: LLM, prompt: list[int], new: int, ignore_eos: bool = True) -> tuple[float, float, int]:
    """(TTFT s, decode s, tokens) from the engine's own step loop."""
    eng = llm.engine
    eng.add_request("lat", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=ignore_eos))
    start = time.perf_counter()
    first = None
    tokens = 0
    while eng.has_unfinished():
        step = eng.step()
        tokens += sum(len(d.token_ids) for o in step.outputs for d in o.deltas)
        if first is None and tokens:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - start, end - first, tokens


def ours_workload(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(mean TTFT s, decode tok/s over every request's tokens after its first)."""
    runs = [ours(llm, p, new, ignore_eos=False) for p in prompts]
    return statistics.mean(r[0] for r in runs), sum(r[2] - 1 for r in runs) / sum(r[1] for r in runs)


def profile(llm: LLM, prompt: list[int], new: int) -> str:
    """Milliseconds per decode step by share (scripts/profile_step.py), prefill left out."""
    from profile_step import StepProfile  # scripts/ is on sys.path when run as a script

    eng = llm.engine
    eng.add_request("prof", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    eng.step()  # the prefill
    with StepProfile(llm) as prof:
        while eng.has_unfinished():
            eng.step()
    steps = new - 1
    s = prof.spent
    parts = {"GEMMs": s["gemm"], "attention": s["attention"],
             "other model ops": s["model forward"] - s["gemm"] - s["attention"],
             "sampler, inputs, Python": s["step"] - s["model forward"]}
    return f"{s['step'] / steps * 1e3:.2f} ms/step: " + ", ".join(
        f"{k} {v / steps * 1e3:.2f}" for k, v in parts.items())


@torch.inference_mode()
def hf(model, prompt: list[int], new: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s): a one-token generate, then the rest timed as a difference."""
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    whole = time.perf_counter() - t
    return ttft, (new - 1) / max(whole - ttft, 1e-9)


@contextlib.contextmanager
def llama_server(gguf: Path, ctx: int, isa: str) -> Iterator[str]:
    """llama-server on the GGUF with one slot of `ctx` tokens and every core; its AVX2 build
    for `isa` avx2."""
    from servers import LLAMA_SERVER, LLAMA_SERVER_AVX2, start_llama, stop, wait_ready  # scripts/ is on sys.path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(tempfile.gettempdir()) / "bench_latency_llama.log"
    proc = start_llama(gguf, port, 1, ctx, False, log, LLAMA_SERVER_AVX2 if isa == "avx2" else LLAMA_SERVER)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 300, log)
        yield url
    finally:
        stop(proc)


# An AVX-512 machine running AVX2 code: our kernels' target, ATen's dispatch, oneDNN's JIT.
AVX2_ENV = {"PAGEDSERVE_CPU_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def llama(url: str, prompt: list[int], new: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s) from llama-server's token stream, the same token ids as ours."""
    body = {"prompt": prompt, "n_predict": new, "stream": True, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False}
    start = time.perf_counter()
    stamps = []
    with httpx.stream("POST", f"{url}/completion", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and not json.loads(line[6:]).get("stop"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def one_side(args, prompt: list[int]) -> None:
    """One engine (fp, `--one gguf|int8`, or `--spec` one speculative_config) in this process:
    warm, measure, print JSON."""
    spec = json.loads(args.spec) if args.spec else None
    mode, a8 = args.one.removesuffix("-a8"), args.one.endswith("-a8")  # gguf-a8: gguf with int8 activations
    llm = LLM(args.model, dtype=args.dtype, quantization=mode or None, int8_activations=a8,
              enable_prefix_caching=False, max_model_len=2048, speculative_config=spec)
    ours(llm, prompt[:32], 4)
    if args.workload == "random":
        runs = []
        for _ in range(args.repeats):
            ttft, decode, tokens = ours(llm, prompt, args.new_tokens)
            runs.append((ttft, (tokens - 1) / decode))
    else:
        from workloads import prompts  # scripts/ is on sys.path when run as a script

        runs = [ours_workload(llm, prompts(llm.tokenizer, args.workload), args.new_tokens)
                for _ in range(args.repeats)]
    text = profile(llm, prompt, args.new_tokens) if args.profile else ""
    s = llm.stats()
    accept = (f"acceptance {s.spec_acceptance_rate:.1%}, {s.spec_mean_accepted_length:.2f} tokens a step, "
              f"per position {s.spec_accepted_per_pos}" if spec else "")
    print(json.dumps({"runs": runs, "profile": text, "acceptance": accept}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF file (scripts/shape_gguf.py writes the benchmark shapes); "
                    "default: the embedded model")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quantization", default="", help="comma list of gguf,int8 (an -a8 suffix adds "
                    "int8_activations: gguf-a8): also run these")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--peer", choices=["llama"], help="also llama-server on the same GGUF")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native",
                    help="avx2: both sides run AVX2 code on this machine (see below)")
    ap.add_argument("--profile", action="store_true", help="per-step breakdown of each engine's decode")
    ap.add_argument("--workload", default="random", choices=["random", "chat", "grounded"],
                    help="random: one --prompt-len prompt of random tokens, ignoring eos; chat/grounded: "
                         "scripts/workloads.py, until eos or --new-tokens")
    ap.add_argument("--speculative", default="[]", help="JSON list of speculative_config values to add")
    ap.add_argument("--rounds", type=int, default=1, help="run every side this many times in turn")
    ap.add_argument("--beam-width", type=int, default=0, help="time beam search of this width instead")
    ap.add_argument("--beam-blocks", help="comma list of beam widths: print their peak KV blocks instead")
    ap.add_argument("--beam-side", help=argparse.SUPPRESS)  # internal: measure one beam-search side
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one engine side, print JSON
    ap.add_argument("--spec", help=argparse.SUPPRESS)  # internal: that side's speculative_config
    args = ap.parse_args()

    if args.isa == "avx2":  # before any engine side starts: they inherit it
        os.environ.update(AVX2_ENV)
    files = loader.resolve(args.model, blocks=args.no_hf)  # the dense conversion only for transformers
    vocab = loader.load_config(files).vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    if args.one is not None:
        return one_side(args, prompt)
    if args.beam_blocks:
        import beam_bench  # scripts/ is on sys.path when run as a script

        return beam_bench.blocks(args.prompt_len, [int(w) for w in args.beam_blocks.split(",")], args.new_tokens,
                                 args.dtype)
    if args.beam_width:
        import beam_bench  # scripts/ is on sys.path when run as a script

        if args.beam_side:
            return beam_bench.one_side(args.beam_side, prompt, args.beam_width, args.new_tokens, args.repeats,
                                       args.dtype)
        return beam_bench.run(__file__, args.prompt_len, args.beam_width, args.new_tokens, args.repeats,
                              args.rounds, args.dtype)
    if args.workload != "random" and (not args.no_hf or args.peer):
        ap.error("--workload chat/grounded compares our engines only: add --no-hf, leave out --peer")
    # Each engine runs in a process of its own: engines sharing one process slowed the
    # second one's prefill by about 20% (its dequantized GEMMs), which no user sees.
    sides: list[tuple[str, object, object]] = [("engine", None, ("", ""))]
    sides += [(f"engine {mode}", None, (mode, "")) for mode in filter(None, args.quantization.split(","))]
    for spec in json.loads(args.speculative):
        label = spec["method"] + "".join(f" {k}={v}" for k, v in spec.items() if k != "method")
        sides.append((f"engine spec {label}", None, ("", json.dumps(spec))))
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(files.path, dtype=getattr(torch, args.dtype)).eval()
        sides.append(("transformers", hf, model))
    stack = contextlib.ExitStack()
    if args.peer == "llama":
        sides.append(("llama-server", llama, stack.enter_context(
            llama_server(Path(args.model) if args.model else loader.default_model_path(),
                         max(2048, args.prompt_len + args.new_tokens), args.isa))))
    width = max(len(name) for name, _, _ in sides)
    rounds: list[dict[str, tuple[float, float]]] = []
    profiles, accepts = {}, {}
    for r in range(args.rounds):
        results: dict[str, tuple[float, float]] = {}
        for name, fn, target in sides:
            if fn is None:
                mode, spec = target  # type: ignore[misc]
                out = json.loads(subprocess.run(
                    [sys.executable, __file__, "--one", mode, "--dtype", args.dtype,
                     *(["--model", args.model] if args.model else []), "--prompt-len",
                     str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                     "--workload", args.workload] + (["--spec", spec] if spec else [])
                    + (["--profile"] if args.profile else []),
                    capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
                runs, profiles[name], accepts[name] = out["runs"], out["profile"], out["acceptance"]
            else:
                fn(target, prompt[:32], 4)  # warm
                runs = [fn(target, prompt, args.new_tokens) for _ in range(args.repeats)]
            ttft = statistics.median(r[0] for r in runs)
            rate = statistics.median(r[1] for r in runs)
            spread = (max(r[1] for r in runs) - min(r[1] for r in runs)) / rate
            results[name] = (ttft, rate)
            print(f"{name:{width}s} TTFT {ttft * 1000:7.1f} ms   decode {rate:6.1f} tok/s   "
                  f"(decode spread {spread:.1%})" + (f"   {accepts[name]}" if accepts.get(name) else ""))
        rounds.append(results)
        if args.rounds > 1:
            print(f"-- round {r + 1} of {args.rounds} done")
    stack.close()
    for name, text in profiles.items():
        if text:
            print(f"{name}: {text}")
    results = rounds[-1]
    for name in results:
        if name == "engine":
            continue
        decode = [rd[name][1] / rd["engine"][1] for rd in rounds]
        ttft = [rd["engine"][0] / rd[name][0] for rd in rounds]
        print(f"{name} / engine fp: decode {statistics.median(decode):.2f}x "
              f"(rounds: {', '.join(f'{x:.2f}' for x in decode)}), TTFT {statistics.median(ttft):.2f}x "
              "(higher is better)")
    if "llama-server" in results:  # every round's pair, not the last one's alone
        for name in results:
            if name.startswith("engine"):
                decode = [rd[name][1] / rd["llama-server"][1] for rd in rounds]
                ttft = [rd["llama-server"][0] / rd[name][0] for rd in rounds]
                print(f"{name} / llama-server: decode {statistics.median(decode):.2f}x "
                      f"(rounds: {', '.join(f'{x:.2f}' for x in decode)}), TTFT {statistics.median(ttft):.2f}x "
                      "(higher is better)")


if __name__ == "__main__":
    main()
