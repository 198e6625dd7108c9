"""What embedding requests cost the chats they share a server with.

Starts `bentoml serve` once (the embedded model, a mean pooler, prefix caching off so
every pass computes the same), then, in pairs, runs `--chats` streaming greedy chats
alone and the same chats while an embedding client sends requests of `--embed-inputs`
inputs of about `--embed-tokens` tokens, each `--embed-interval` seconds after the last
one's answer (0: back to back, the chats' worst case). Per run: the chats'
median decode rate (tokens after the first over the time after the first) and median
time to first token, the embedding inputs served, and /stats' blocks in use afterwards.
The order inside a pair alternates (rotates, with --control), so drift hits every side.

    python scripts/bench_embeddings.py --pairs 3                       # a request a second
    python scripts/bench_embeddings.py --pairs 3 --embed-interval 0    # back to back
    python scripts/bench_embeddings.py --pairs 5 --embed-inputs 1 --embed-tokens 32 --embed-delay 2 --embed-interval 3600
                                                                        # one request, mid-decode
    python scripts/bench_embeddings.py --pairs 3 --embed-tokens 32 --offline 30   # the engine's share alone
    python scripts/bench_embeddings.py --pairs 10 --control --embed-inputs 1 --embed-tokens 32 --embed-delay 2 --embed-interval 3600

`--control` adds a third run to each pair, the chats alone again, and rotates the three
runs' order from pair to pair: its ratio to the first alone run is this machine's noise
on the same measurement, to hold the embedding's ratio against.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import ROOT, all_cores, stop, wait_ready  # noqa: E402

WORDS = ("the quick brown fox jumps over a lazy dog while paged attention keeps every key and value "
         "in blocks of sixteen tokens mapped through a table ").split()


def start(port: int, log: Path, max_num_seqs: int) -> subprocess.Popen:
    preset = Path(tempfile.mkdtemp()) / "bench.yaml"
    preset.write_text(json.dumps({
        "engine": {"dtype": "float32", "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048,
                   "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30, "enable_prefix_caching": False,
                   "pooler": {"pooling_type": "mean"}},
        "service": {"traffic": {"timeout": 3600, "concurrency": 256}},
    }))
    env = {**os.environ, "PAGEDSERVE_CONFIG": str(preset)}
    cmd = [str(Path(sys.executable).parent / "bentoml"), "serve", "service:LLMService", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=all_cores)


async def chat(c: httpx.AsyncClient, i: int, tokens: int) -> tuple[float, float]:
    """(time to first token, decode tok/s) of one streamed greedy chat that ignores eos."""
    body = {"stream": True, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Tell a long story about the number {i}."}]}
    t0 = time.perf_counter()
    first = last = None
    count = 0
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
    assert first is not None and last is not None and count > 1
    return first - t0, (count - 1) / (last - first)


async def embedder(c: httpx.AsyncClient, inputs: int, tokens: int, interval: float, delay: float,
                   done: asyncio.Event) -> int:
    """Embedding requests, the first `delay` seconds in, then `interval` seconds apart, until
    the chats are done; the inputs served."""
    served = 0
    k = 0
    while not done.is_set():
        wait = interval if k else delay
        if wait:
            try:
                await asyncio.wait_for(done.wait(), wait)
                break
            except asyncio.TimeoutError:
                pass
        texts = [" ".join(WORDS[(k + j + n) % len(WORDS)] for n in range(tokens)) for j in range(inputs)]
        k += 1
        r = await c.post("/v1/embeddings", json={"input": texts, "encoding_format": "float"})
        r.raise_for_status()
        served += len(r.json()["data"])
    return served


async def run(url: str, chats: int, tokens: int, embed: bool, inputs: int, embed_tokens: int,
              interval: float, delay: float) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as c:
        done = asyncio.Event()
        side = asyncio.create_task(embedder(c, inputs, embed_tokens, interval, delay, done)) if embed else None
        results = await asyncio.gather(*(chat(c, i, tokens) for i in range(chats)))
        done.set()
        served = await side if side is not None else 0
        used = (await c.get("/stats")).json()["blocks_used"]
    return {"ttft": statistics.median(r[0] for r in results), "rate": statistics.median(r[1] for r in results),
            "embedded": served, "blocks_used": used}


def offline(pairs: int, chats: int, tokens: int, embed_tokens: int, at_step: int) -> None:
    """The engine's share alone, in this process: `chats` greedy requests stepped to the end,
    and the same with one embedding request of about `embed_tokens` tokens added before
    step `at_step`; each run's total step time and that step's, in pairs."""
    from engine import LLM, SamplingParams
    from engine.pooling import PoolingParams

    llm = LLM(None, dtype="float32", quantization=None, max_num_seqs=max(64, chats + 1), max_num_batched_tokens=2048,
              kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, pooler={"pooling_type": "mean"})
    engine = llm.engine
    text = " ".join(WORDS[n % len(WORDS)] for n in range(embed_tokens))

    def step_times(tag: str, embed: bool) -> list[float]:
        for i in range(chats):
            engine.add_request(f"{tag}-{i}", engine.tokenize(f"Tell a long story about the number {i}."),
                               SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
        times = []
        while engine.scheduler.has_work():
            if embed and len(times) == at_step:
                engine.add_request(f"{tag}-embed", engine.tokenize(text), pooling_params=PoolingParams())
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return times

    step_times("warm", True)
    for p in range(pairs):
        alone, mixed = step_times(f"a{p}", False), step_times(f"m{p}", True)
        print(f"pair {p + 1}: {len(alone)} / {len(mixed)} steps, {sum(alone) * 1e3:.0f} / {sum(mixed) * 1e3:.0f} ms "
              f"(with / alone {sum(mixed) / sum(alone):.3f}); step {at_step}: {alone[at_step] * 1e3:.1f} / "
              f"{mixed[at_step] * 1e3:.1f} ms; median step {statistics.median(alone) * 1e3:.1f} / "
              f"{statistics.median(mixed) * 1e3:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--chats", type=int, default=32)
    ap.add_argument("--chat-tokens", type=int, default=64)
    ap.add_argument("--embed-inputs", type=int, default=4, help="inputs per embedding request")
    ap.add_argument("--embed-tokens", type=int, default=64, help="about this many tokens per input")
    ap.add_argument("--embed-interval", type=float, default=1.0, help="seconds between embedding requests")
    ap.add_argument("--embed-delay", type=float, default=0.0,
                    help="seconds into each run before the first embedding request (with a long interval: one "
                         "request, in the middle of the chats' decoding)")
    ap.add_argument("--port", type=int, default=3917)
    ap.add_argument("--control", action="store_true",
                    help="a second alone run in each pair, as the noise's own ratio (see above)")
    ap.add_argument("--offline", type=int, metavar="STEP", default=None,
                    help="no server: the engine in this process, one embedding request added before this step")
    args = ap.parse_args()
    if args.offline is not None:
        return offline(args.pairs, args.chats, args.chat_tokens, args.embed_tokens, args.offline)
    log = Path(tempfile.gettempdir()) / "bench_embeddings_server.log"
    proc = start(args.port, log, max(64, args.chats + args.embed_inputs))
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url, proc, 600, log)
        asyncio.run(run(url, 4, 8, True, 2, 16, 0.0, 0.0))  # warm-up: both kinds of request once
        rows = []
        kinds = ["alone", "with", "control"] if args.control else ["alone", "with"]
        for p in range(args.pairs):
            shift = p % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                r = asyncio.run(run(url, args.chats, args.chat_tokens, kind == "with", args.embed_inputs,
                                    args.embed_tokens, args.embed_interval, args.embed_delay))
                rows.append((p, kind, r))
                label = {"alone": "chats alone    ", "with": "with embeddings", "control": "chats alone (2)"}[kind]
                print(f"pair {p + 1} {label}: decode {r['rate']:6.2f} tok/s "
                      f"per chat, TTFT {r['ttft'] * 1000:7.1f} ms, {r['embedded']} inputs embedded, "
                      f"{r['blocks_used']} blocks in use after", flush=True)
    finally:
        stop(proc)

    def ratios(key: str, kind: str) -> list[float]:
        got = {(q, k): r[key] for q, k, r in rows}
        return [got[p, kind] / got[p, "alone"] for p in range(args.pairs)]

    for name, key in (("decode tok/s per chat", "rate"), ("TTFT s", "ttft")):
        alone = [r[key] for _, k, r in rows if k == "alone"]
        mixed = [r[key] for _, k, r in rows if k == "with"]
        spread = lambda xs: (max(xs) - min(xs)) / statistics.median(xs)  # noqa: E731
        with_alone = ratios(key, "with")
        print(f"{name}: alone {min(alone):.3g}-{max(alone):.3g} (spread {spread(alone):.1%}), with embeddings "
              f"{min(mixed):.3g}-{max(mixed):.3g} (spread {spread(mixed):.1%}); with / alone per pair: "
              + ", ".join(f"{x:.3f}" for x in with_alone) + f" (mean {statistics.mean(with_alone):.3f})")
        if args.control:
            control = ratios(key, "control")
            print("  control, alone (2) / alone per pair: " + ", ".join(f"{x:.3f}" for x in control)
                  + f" (mean {statistics.mean(control):.3f}, {min(control):.3f}-{max(control):.3f})")


if __name__ == "__main__":
    main()
