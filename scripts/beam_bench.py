"""In-engine beam search against vLLM's design for it, over the same engine: the
`--beam-width` mode of scripts/bench_latency.py.

vLLM v1 runs beam search outside its engine (LLM.beam_search in its entrypoints): every
step it submits one request per live beam, whose prompt is the original prompt plus the
beam's tokens so far, with max_tokens=1 and logprobs=2·W; prefix caching spares it
recomputing what the beams share; of the W × 2W continuations it keeps the best W by
cumulative logprob. `loop_beams` does that over our LLMEngine with prefix caching on.
Our engine instead forks a request's beams as sequences on shared blocks (engine/beam.py).

Both sides ignore eos, so both keep the best W by cumulative logprob at every step and
must end with the same beams; the benchmark checks that they do. Each side runs in a
process of its own, `--repeats` times per round, and every round prints its ratio.

`blocks` (`--beam-blocks`) measures what the search holds instead: the peak KV blocks of
beam searches of several widths against one sequence over the same prompt.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from engine import LLM, BeamSearchParams, SamplingParams

Beam = tuple[list[int], float]  # output token ids, cumulative logprob


def loop_beams(llm: LLM, prompt: list[int], width: int, new: int) -> list[Beam]:
    """vLLM's loop: one single-token request per beam per step (eos ignored)."""
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    beams: list[Beam] = [([], 0.0)]
    for step in range(new):
        ids = [f"s{step}b{i}" for i in range(len(beams))]
        for rid, (tokens, _) in zip(ids, beams):
            eng.add_request(rid, prompt + tokens, params)
        top: dict[str, list[tuple[int, float]]] = {}
        while eng.has_unfinished():
            for out in eng.step().outputs:
                for d in out.deltas:
                    if d.logprobs:
                        top[out.request_id] = d.logprobs[0].top
        grown = [(tokens + [tok], cum + lp) for rid, (tokens, cum) in zip(ids, beams) for tok, lp in top[rid]]
        beams = sorted(grown, key=lambda b: -b[1])[:width]
    return beams


def engine_beams(llm: LLM, prompt: list[int], width: int, new: int) -> list[Beam]:
    out = llm.beam_search([prompt], BeamSearchParams(width, new, ignore_eos=True))[0]
    return [(s.output_token_ids, s.cum_logprob) for s in out.sequences]


SIDES = {"engine beam search": engine_beams, "per-beam request loop": loop_beams}


def peak_blocks(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
    """(the most KV blocks in use while the request ran, its output token count as
    `usage` reports it), the request running alone."""
    eng, pool = llm.engine, llm.engine.kv_manager.pool
    eng.add_request("peak", prompt, params)
    most, out = 0, None
    while eng.has_unfinished():
        for o in eng.step().outputs:
            out = o
        most = max(most, pool.num_blocks - pool.num_free)
    assert out is not None and out.finished
    return most, out.num_output_tokens


def blocks(prompt_len: int, widths: list[int], new: int, dtype: str) -> None:
    """Peak KV blocks of one greedy sequence and of beam searches over the same prompt
    (the workloads' passage, repeated), prefix caching off, eos ignored."""
    from workloads import PASSAGE  # scripts/ is on sys.path when run as a script

    llm = LLM(None, dtype=dtype, max_model_len=prompt_len + new + 16, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(PASSAGE, add_special_tokens=False)
    prompt = (ids * (prompt_len // len(ids) + 1))[:prompt_len]
    single, used = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    print(f"one sequence: {single} blocks at peak, {used} positions computed")
    for width in widths:
        most, used = peak_blocks(llm, prompt, SamplingParams(n=width, temperature=0, max_tokens=new, ignore_eos=True,
                                                             use_beam_search=True))
        print(f"beam search W={width}: {most} blocks at peak ({most / single:.2f}x), {used} positions computed")


def one_side(name: str, prompt: list[int], width: int, new: int, repeats: int, dtype: str) -> None:
    """Warm, then time `repeats` searches in this process; print JSON."""
    llm = LLM(None, dtype=dtype, enable_prefix_caching=True, max_model_len=2048)
    fn = SIDES[name]
    fn(llm, prompt[:32], width, 4)
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        beams = fn(llm, prompt, width, new)
        walls.append(time.perf_counter() - start)
    print(json.dumps({"walls": walls, "beams": [b[0] for b in beams]}))


def run(script: str, prompt_len: int, width: int, new: int, repeats: int, rounds: int, dtype: str) -> None:
    """Both sides, `rounds` times in turn, each in a fresh process of `script`."""
    ratios = []
    for r in range(rounds):
        walls: dict[str, float] = {}
        found: dict[str, list[list[int]]] = {}
        for name in SIDES:
            out = json.loads(subprocess.run(
                [sys.executable, script, "--beam-side", name, "--beam-width", str(width), "--dtype", dtype,
                 "--prompt-len", str(prompt_len), "--new-tokens", str(new), "--repeats", str(repeats)],
                capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            walls[name], found[name] = statistics.median(out["walls"]), out["beams"]
            spread = (max(out["walls"]) - min(out["walls"])) / walls[name]
            print(f"{name:22s} W={width} {new} tokens: {walls[name]:6.2f} s median of {repeats} "
                  f"(spread {spread:.1%})")
        a, b = found.values()
        same = sorted(map(tuple, a)) == sorted(map(tuple, b))
        ratios.append(walls["per-beam request loop"] / walls["engine beam search"])
        print(f"-- round {r + 1}: loop / engine wall time {ratios[-1]:.2f}x, beams equal: {same}")
    print(f"in-engine beam search is {statistics.median(ratios):.2f}x faster than the per-beam loop "
          f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
