"""Soak a live server with a long mixed load, then check it kept every promise.

    python scripts/soak.py --url http://127.0.0.1:3000 --key $LLM_API_KEY --pid <bentoml serve pid> \
        --requests 2000 --concurrency 64 --out benchmarks/soak.json

The load: completions (token-id prompts) and chats of random sizes, streamed or not,
with ignore_eos so each valid request's output length is known; 10% are streams the
client cuts after a few events; 5% are invalid bodies. Run it against a server whose
preset bounds the waiting queue (service.queue) low enough for the opening burst to
pass it, so some requests are turned away with 429 (the client then backs off for the
Retry-After it was given, at most a second, as a polite client would).

It passes (exit 0) when every valid, uncut request either completed with exactly its
max_tokens on every choice or was answered 429 with Retry-After, every invalid one got
a 4xx, nothing got a 5xx, some got 429, every KV block is free once the server is idle,
and the server's resident memory (the process tree of --pid) grew less than 5% between
the midpoint and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil

WORDS = "the a river city light stone paper music garden window engine cloud road story".split()
INVALID = [
    b'{"model": "m", "prompt": "hi", "max_tokens": "12"}',
    b'{"prompt": "hi", "n": 2.0}',
    b'{"prompt": "hi", "temperature": -1}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": "caf\\udce9"}',
    b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"prompt": "hi", "logit_bias": {"99999999": 5}}',
    b'not json at all',
]


@dataclass
class Tally:
    completed: int = 0
    rejected_429: int = 0
    cut: int = 0
    invalid_4xx: int = 0
    server_errors: int = 0
    wrong: list[str] = field(default_factory=list)  # what broke a promise, one line each

    def fail(self, why: str) -> None:
        if len(self.wrong) < 50:
            self.wrong.append(why)


def tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def make_request(rng: random.Random, model: str, max_out: int, max_prompt: int) -> tuple[str, str, dict | bytes, int]:
    """(kind, path, body, max_tokens) for one request."""
    roll = rng.random()
    if roll < 0.05:
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        return "invalid", path, rng.choice(INVALID), 0
    max_tokens = rng.randint(1, max_out)
    common = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "n": rng.choice([1, 1, 1, 2]),
              "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randint(0, 1000)}
    cut = roll < 0.15
    stream = cut or rng.random() < 0.5
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if rng.random() < 0.5:
        prompt = [rng.randint(100, 40000) for _ in range(rng.randint(8, max_prompt))]
        body, path = {**common, "prompt": prompt}, "/v1/completions"
    else:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, max_prompt // 2)))
        body, path = {**common, "messages": [{"role": "user", "content": text}]}, "/v1/chat/completions"
    return ("cut" if cut else "valid"), path, body, max_tokens


async def run_one(client: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally,
                  args: argparse.Namespace) -> None:
    kind, path, body, max_tokens = make_request(rng, model, args.max_tokens, args.max_prompt)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    try:
        async with client.stream("POST", path, content=content, headers=headers) as r:
            if r.status_code >= 500:
                tally.server_errors += 1
                tally.fail(f"{r.status_code} on {kind} {path}: {(await r.aread())[:200]!r}")
                return
            if kind == "invalid":
                if 400 <= r.status_code < 500 and "error" in json.loads(await r.aread()):
                    tally.invalid_4xx += 1
                else:
                    tally.fail(f"invalid body answered {r.status_code}")
                return
            if r.status_code == 429:
                tally.rejected_429 += 1
                if "retry-after" not in r.headers:
                    tally.fail("429 without Retry-After")
                    return
                await asyncio.sleep(min(float(r.headers["retry-after"]), 1.0))  # a polite client backs off
                return
            if r.status_code != 200:
                tally.fail(f"valid {path} answered {r.status_code}: {(await r.aread())[:200]!r}")
                return
            if kind == "cut":
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= rng.randint(1, 3):
                        break  # leaving the block closes the connection mid-stream
                tally.cut += 1
                return
            if body.get("stream"):
                usage, finishes = None, {}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        tally.fail(f"stream error event: {chunk['error']}")
                        return
                    for c in chunk.get("choices", []):
                        if c.get("finish_reason"):
                            finishes[c["index"]] = c["finish_reason"]
                    usage = chunk.get("usage") or usage
            else:
                data = json.loads(await r.aread())
                usage = data["usage"]
                finishes = {c["index"]: c["finish_reason"] for c in data["choices"]}
            n = body["n"]
            if usage is None or usage["completion_tokens"] != n * max_tokens or finishes != {
                    i: "length" for i in range(n)}:
                tally.fail(f"{path} n={n} max_tokens={max_tokens}: usage {usage}, finishes {finishes}")
                return
            tally.completed += 1
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        tally.fail(f"{kind} {path}: {exc!r}")


async def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    tally = Tally()
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rss = {"start": tree_rss(args.pid)} if args.pid else {}
        issued = 0
        started = time.monotonic()

        async def worker() -> None:
            nonlocal issued
            while issued < args.requests:
                issued += 1
                if issued == args.requests // 2 and args.pid:
                    rss["mid"] = tree_rss(args.pid)
                await run_one(client, rng, model, tally, args)

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 60
        while True:  # idle: aborted streams are freed at the next step
            stats = (await client.get("/stats")).json()
            if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        if args.pid:
            rss["end"] = tree_rss(args.pid)
    growth = (rss["end"] - rss["mid"]) / rss["mid"] if "mid" in rss else None
    checks = {
        "no_5xx": tally.server_errors == 0,
        "every_promise_kept": not tally.wrong,
        "some_429": tally.rejected_429 > 0,
        "kv_blocks_free_when_idle": stats["blocks_used"] == 0,
        "rss_growth_under_5pct": growth is None or growth < 0.05,
    }
    return {"requests": args.requests, "concurrency": args.concurrency, "seconds": round(elapsed, 1),
            **asdict(tally), "blocks_used_idle": stats["blocks_used"], "rss_bytes": rss,
            "rss_growth_mid_to_end": growth, "checks": checks, "passed": all(checks.values())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:3000")
    p.add_argument("--key", default=None, help="API key, when the server has LLM_API_KEY set")
    p.add_argument("--pid", type=int, default=None, help="the server's pid, for its memory (process tree)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=16, help="outputs are 1..this many tokens")
    p.add_argument("--max-prompt", type=int, default=256, help="prompts are 8..this many tokens")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    result = asyncio.run(soak(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
