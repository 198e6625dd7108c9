#!/usr/bin/env python
"""Serving benchmark: streaming load against OpenAI-compatible servers, ours and a peer.

Our client sends streaming `/v1/completions` requests with token-id prompts (so every
server sees exactly the same tokens), `ignore_eos`, greedy, over scripts/sse_client.py
(it shares the server's cores, so it is kept lean), and measures per request the time to
first token (TTFT), the gaps between streamed chunks (ITL), time per output token after
the first (TPOT) and end-to-end latency; per load level the output tok/s and the
goodput under an SLO. Load is a fixed concurrency (a sweep, which always includes c=1
for the batch-1 inter-token latency) or Poisson arrivals. `--clients ours,vllm` also
drives each server with vLLM's own load generator (`vllm bench serve`: text prompts,
the server's default sampling), as a vLLM user would measure it; both clients' records
go through the same summary.

Servers (scripts/servers.py): `--url` measures one that is already running; otherwise
`--servers` starts ours (`bentoml serve` on a preset written from the flags,
`--quantization` included), vLLM's CPU server (`vllm serve` from .peers/vllm) on the
same weights, dtype and scheduler limits, with every core as ours gets unless
`--peer-defaults` (vLLM's out-of-the-box choice: one core kept for its API process),
and/or llama.cpp's `llama-server` on the same GGUF file, started afresh for each level
with `--parallel` equal to its concurrency; one at a time on the same cores.
`--offline` also runs our engine in-process on the last level's requests, so the cost
of serving shows as a ratio.

Writes JSON and PNG plots (latency against throughput; TTFT and ITL distributions).

    python scripts/bench_serving.py --servers ours,vllm --clients ours,vllm --concurrency 1,16,64 --offline
    python scripts/bench_serving.py --url http://localhost:3000 --request-rate 4
    python scripts/bench_serving.py --servers ours,llama --quantization gguf --concurrency 1,16,64
    python scripts/bench_serving.py --servers ours,llama --model /tmp/q06-q4km.gguf --dtype bfloat16 \
        --quantization gguf --int8-activations --concurrency 16,64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench_throughput import workload as synthetic_workload  # noqa: E402  (scripts/ is on sys.path)
from sse_client import HTTPStatusError, sse_post  # noqa: E402
from servers import VLLM_PYTHON, all_cores, start_llama, start_ours, start_vllm, stop, wait_ready  # noqa: E402

PERCENTILES = (50, 90, 99)


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


# -- workloads ------------------------------------------------------------------------
def make_workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    n = args.num_prompts

    def ids(k: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(k)]

    if args.workload == "synthetic":  # bench_throughput's mix of lengths
        return synthetic_workload(n, args.seed, vocab)
    if args.workload == "random":
        return [(ids(args.input_len), args.output_len) for _ in range(n)]
    prefix = ids(args.prefix_len)  # shared-prefix: one system prompt, different questions
    return [(prefix + ids(args.input_len - args.prefix_len), args.output_len) for _ in range(n)]


# -- one request ----------------------------------------------------------------------
async def one_request(url: str, model: str, prompt: list[int], max_tokens: int) -> Result:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    last = start
    res = Result(ok=False)
    chunks = 0
    try:
        async with contextlib.aclosing(sse_post(url + "/v1/completions", body)) as events:
            async for payload in events:
                if payload == b"[DONE]":
                    continue
                data = json.loads(payload)
                if "error" in data:
                    res.error = str(data["error"])[:200]
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                if data.get("choices") and data["choices"][0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itls.append(now - last)
                    last = now
                    chunks += 1
    except (OSError, asyncio.IncompleteReadError, HTTPStatusError, ValueError) as exc:
        res.error = repr(exc)[:200]
        return res
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = res.output_tokens == max_tokens
    if not res.ok and not res.error:
        res.error = f"got {res.output_tokens} of {max_tokens} tokens"
    return res


async def run_level(url: str, model: str, reqs, concurrency: int | None, rate: float | None, seed: int
                    ) -> tuple[list[Result], float]:
    """All requests at a fixed concurrency, or with Poisson arrivals at `rate` per second."""
    rng = np.random.default_rng(seed)
    sem = asyncio.Semaphore(concurrency or len(reqs))

    async def limited(prompt, n):
        async with sem:
            return await one_request(url, model, prompt, n)

    start = time.perf_counter()
    tasks = []
    for prompt, n in reqs:
        tasks.append(asyncio.create_task(limited(prompt, n)))
        if rate:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def summarize(results: list[Result], duration: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if r.ok]

    def pct(xs: list[float]) -> dict[str, float]:
        if not xs:
            return {f"p{p}": float("nan") for p in PERCENTILES} | {"mean": float("nan")}
        a = np.asarray(xs) * 1000.0
        return {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES} | {"mean": float(a.mean())}

    good = [r for r in ok if r.ttft * 1000 <= slo_ttft and r.tpot * 1000 <= slo_tpot]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "output_tok_s": out_tokens / duration, "request_s": len(ok) / duration,
        "goodput_req_s": len(good) / duration, "slo_met": len(good) / max(1, len(results)),
        "ttft_ms": pct([r.ttft for r in ok]), "itl_ms": pct([x for r in ok for x in r.itls]),
        "tpot_ms": pct([r.tpot for r in ok if r.output_tokens > 1]), "e2e_ms": pct([r.e2e for r in ok]),
        "_ttft_all": [r.ttft * 1000 for r in ok], "_itl_all": [x * 1000 for r in ok for x in r.itls],
    }


# -- the other client: vLLM's own load generator ----------------------------------------
def vllm_bench(url: str, model: str, tokenizer: Path, c: int | None, rate: float | None, n: int, args
               ) -> tuple[list[Result], float]:
    """One level driven by `vllm bench serve`, as a vLLM user measures a server: text
    prompts from its random dataset (the same for every server), sampling left to the
    server's defaults (it sends no temperature), streaming /v1/completions with usage.
    Its per-request record goes through the same summary as our client's."""
    if not VLLM_PYTHON.is_file():
        raise SystemExit("vLLM peer missing: run scripts/setup_vllm_peer.sh first")
    out = Path(tempfile.mkdtemp())
    cmd = [str(VLLM_PYTHON), str(ROOT / "scripts" / "peers" / "vllm_cli.py"), "bench", "serve",
           "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(n),
           "--seed", str(args.seed), "--save-result", "--save-detailed", "--result-dir", str(out),
           "--result-filename", "result.json", "--disable-tqdm"]
    cmd += ["--max-concurrency", str(c)] if c else ["--request-rate", str(rate)]
    done = subprocess.run(cmd, cwd="/tmp", capture_output=True, text=True, preexec_fn=all_cores)
    if done.returncode != 0 or not (out / "result.json").is_file():
        raise SystemExit(f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    data = json.loads((out / "result.json").read_text())
    results = [Result(ok=not err and n_out == args.output_len, ttft=ttft, e2e=e2e, output_tokens=n_out or 0,
                      itls=list(itl), error=(err or ("" if n_out == args.output_len else f"got {n_out} tokens"))[:200])
               for ttft, e2e, n_out, itl, err in zip(data["ttfts"], data["latencies"], data["output_lens"],
                                                     data["itls"], data["errors"])]
    return results, data["duration"]


def offline_tok_s(args, reqs) -> float:
    """Our engine in-process on the same requests: what serving is compared with."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              int8_activations=args.int8_activations, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=args.kv_bytes,
              enable_prefix_caching=args.prefix_caching, max_model_len=1024)
    llm.generate([reqs[0][0]], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)], use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    start = time.perf_counter()
    llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    return sum(n for _, n in reqs) / (time.perf_counter() - start)


# -- report ---------------------------------------------------------------------------
def plot(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for server, levels in report["servers"].items():
        xs = [lv["output_tok_s"] for lv in levels]
        for ax, metric in zip(axes, ("ttft_ms", "itl_ms")):
            for p, style in (("p50", "-o"), ("p99", "--x")):
                ax.plot(xs, [lv[metric][p] for lv in levels], style, label=f"{server} {p}")
            for lv in levels:
                ax.annotate(lv["label"], (lv["output_tok_s"], lv[metric]["p99"]), fontsize=7)
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set(xlabel="output tok/s", ylabel=f"{name} (ms)", yscale="log", title=f"{name} against throughput")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "_latency_throughput.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for server, levels in report["servers"].items():
        for lv in levels:
            for ax, key in zip(axes, ("_ttft_all", "_itl_all")):
                xs = np.sort(lv[key])
                if len(xs):
                    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"{server} {lv['label']}")
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", xscale="log", title=f"{name} distribution")
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out.with_name(out.stem + "_distributions.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def print_table(report: dict) -> None:
    print(f"{'server':18s} {'load':>8s} {'tok/s':>8s} {'TTFT p50':>9s} {'p99':>8s} {'ITL mean':>9s} {'p50':>7s} "
          f"{'p99':>8s} {'TPOT p50':>9s} {'E2E p99':>9s} {'good/s':>7s} {'fail':>5s}")
    for server, levels in report["servers"].items():
        for lv in levels:
            print(f"{server:18s} {lv['label']:>8s} {lv['output_tok_s']:8.1f} {lv['ttft_ms']['p50']:9.0f} "
                  f"{lv['ttft_ms']['p99']:8.0f} {lv['itl_ms']['mean']:9.1f} {lv['itl_ms']['p50']:7.1f} "
                  f"{lv['itl_ms']['p99']:8.1f} {lv['tpot_ms']['p50']:9.1f} {lv['e2e_ms']['p99']:9.0f} "
                  f"{lv['goodput_req_s']:7.2f} {lv['failed']:5d}")
            for err in lv["errors"]:
                print(f"    error: {err}")
    for name, levels in report["servers"].items():  # ours against each peer, under the same client
        server, _, client = name.partition(" / ")
        if server == "ours":
            continue
        for la, lb in zip(report["servers"].get(f"ours / {client}", []), levels):
            print(f"{client:>10s} {la['label']:>6s}: ours/{server} tok/s {la['output_tok_s'] / lb['output_tok_s']:.2f}x, "
                  f"TTFT p99 {la['ttft_ms']['p99']:.0f} vs {lb['ttft_ms']['p99']:.0f} ms, "
                  f"ITL mean {la['itl_ms']['mean']:.1f} vs {lb['itl_ms']['mean']:.1f} ms")
    if "offline_tok_s" in report:  # offline ran the last level's requests
        for name, levels in report["servers"].items():
            if name.startswith("ours"):
                lv = levels[-1]
                print(f"{name:>18s} {lv['label']:>6s}: served/offline {lv['output_tok_s'] / report['offline_tok_s']:.1%}")


def measure(args, server: str, files, workloads: dict, levels: list, clients: list[str]) -> dict[str, list[dict]]:
    """Start `server` (unless --url), warm it, run each load level under each client in
    turn, stop it. Returns the levels' summaries by "server / client"."""
    log = Path(tempfile.gettempdir()) / f"bench_serving_{server}.log"
    proc = None
    url = args.url or f"http://127.0.0.1:{args.port}"
    t0 = time.perf_counter()
    if server == "ours":
        proc = start_ours(args, args.port, log)
    elif server == "vllm":
        proc = start_vllm(args, files.path, args.port, log)
    elif server == "llama":
        from engine.models import default_model_path

        gguf = Path(args.model) if args.model else default_model_path()
        proc = start_llama(gguf, args.port, levels[0][1] or args.max_num_seqs, 1024, args.prefix_caching, log)
    results: dict[str, list[dict]] = {}
    try:
        model = wait_ready(url, proc, 900, log)
        print(f"{server}: ready in {time.perf_counter() - t0:.0f}s, model {model!r}")
        warm = workloads[levels[0][0]][:2]
        asyncio.run(run_level(url, model, warm, 2, None, args.seed))
        for client in clients:
            for label, c, rate in levels:
                if client == "ours":
                    res, duration = asyncio.run(run_level(url, model, workloads[label], c, rate, args.seed))
                else:
                    res, duration = vllm_bench(url, model, files.path, c, rate, len(workloads[label]), args)
                summary = summarize(res, duration, args.slo_ttft_ms, args.slo_tpot_ms)
                summary["label"] = label
                results.setdefault(f"{server} / {client}", []).append(summary)
                print(f"{server} / {client} {label}: {summary['output_tok_s']:.1f} tok/s, TTFT p99 "
                      f"{summary['ttft_ms']['p99']:.0f} ms, ITL mean {summary['itl_ms']['mean']:.1f} ms, "
                      f"{summary['failed']} failed", flush=True)
    finally:
        if proc is not None:
            stop(proc)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="measure this running server instead of starting any")
    ap.add_argument("--servers", default="ours", help="comma list of ours,vllm,llama to start and measure in turn")
    ap.add_argument("--quantization", default=None, choices=["gguf", "int8"], help="our engine's weights")
    ap.add_argument("--int8-activations", action="store_true", help="with --quantization: decode rows' "
                    "activations rounded to int8, as llama.cpp's kernels round them")
    ap.add_argument("--model", default=None, help="HF dir or GGUF; default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--workload", default="random", choices=["random", "synthetic", "shared-prefix"])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=192, help="shared-prefix: tokens every prompt shares")
    ap.add_argument("--num-prompts", type=int, default=0, help="per load level; 0: 2 x concurrency, at least 8")
    ap.add_argument("--concurrency", default="1,16,64", help="comma list: a sweep of fixed concurrency")
    ap.add_argument("--request-rate", type=float, default=0, help="Poisson arrivals per second instead")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000)
    ap.add_argument("--slo-tpot-ms", type=float, default=200)
    ap.add_argument("--offline", action="store_true", help="also run our engine offline on the same requests")
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-bytes", type=int, default=2 << 30)
    ap.add_argument("--peer-defaults", action="store_true",
                    help="vLLM as it comes (one core kept for its API process); default: every core, as ours")
    ap.add_argument("--clients", default="ours",
                    help="comma list of load generators: ours (token-id prompts, greedy) and/or vllm "
                         "(`vllm bench serve`: text prompts, the server's default sampling)")
    ap.add_argument("--port", type=int, default=3123)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "serving.json"))
    args = ap.parse_args()

    from engine.models import loader

    files = loader.resolve(args.model)
    vocab = loader.load_config(files).vocab_size
    sweep = sorted({1, *(int(x) for x in args.concurrency.split(","))})  # c=1: the batch-1 latency, always
    levels = [(f"rate {args.request_rate:g}", None, args.request_rate)] if args.request_rate else [
        (f"c={c}", c, None) for c in sweep]
    workloads = {}
    for label, c, _ in levels:
        n = args.num_prompts or max(8, 2 * (c or 32))
        workloads[label] = make_workload(argparse.Namespace(**{**vars(args), "num_prompts": n}), vocab)

    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "args": vars(args), "servers": {}}
    if args.offline:
        biggest = workloads[levels[-1][0]]
        report["offline_tok_s"] = offline_tok_s(args, biggest)
        print(f"offline engine on the {levels[-1][0]} requests: {report['offline_tok_s']:.1f} tok/s")

    servers = ["url"] if args.url else args.servers.split(",")
    clients = args.clients.split(",")
    if "vllm" in clients and args.workload != "random":
        raise SystemExit("--clients vllm runs vLLM's random dataset: use --workload random")
    for server in servers:
        # llama-server fixes its slots at start: one process per level, --parallel = concurrency.
        groups = [[lv] for lv in levels] if server == "llama" else [levels]
        for group in groups:
            for name, results in measure(args, server, files, workloads, group, clients).items():
                report["servers"].setdefault(name, []).extend(results)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in plot(report, out):
        print("wrote", path)
    for levels_ in report["servers"].values():
        for lv in levels_:
            lv.pop("_ttft_all"), lv.pop("_itl_all")
    out.write_text(json.dumps(report, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
