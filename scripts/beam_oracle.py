"""Beam search against transformers, the oracle: same weights (the embedded model), fp32.

For the 24 chat questions of scripts/workloads.py, each of beam width 2 and 4 with
length_penalty 1.0 and 0.6, 48 new tokens and early_stopping=True, transformers'
`generate(num_beams=W, num_return_sequences=W, do_sample=False)` is run one prompt at a
time (no padding) and compared with our engine's LLM.beam_search. It prints, per
setting, on how many prompts the best beam and the set of all W beams are equal, and
for every difference where it starts and both sides' scores.

`--write` saves transformers' beams to tests/data/beam_transformers.json, which
tests/engine/test_beam.py checks the engine against (and re-checks a few against transformers
itself, so the file cannot drift from the oracle).

    python scripts/beam_oracle.py            # compare, print the table
    python scripts/beam_oracle.py --write    # also refresh the test data
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts.workloads import prompts as workload_prompts  # noqa: E402

DATA = ROOT / "tests" / "data" / "beam_transformers.json"
SETTINGS = [(2, 1.0), (2, 0.6), (4, 1.0), (4, 0.6)]
MAX_NEW = 48


def hf_beams(model, prompt: list[int], width: int, length_penalty: float, eos: list[int],
             max_new: int = MAX_NEW) -> tuple[list[list[int]], list[float]]:
    """transformers' W beams (pads after the end token removed) and their scores."""
    from transformers import GenerationConfig

    config = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                              length_penalty=length_penalty, early_stopping=True, max_new_tokens=max_new,
                              eos_token_id=eos, pad_token_id=eos[0], return_dict_in_generate=True,
                              output_scores=True)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        beams.append(row if end is None else row[:end + 1])
    return beams, out.sequences_scores.tolist()


def compare(ours: list[list[int]], theirs: list[list[int]]) -> tuple[bool, bool]:
    return ours[0] == theirs[0], sorted(map(tuple, ours)) == sorted(map(tuple, theirs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"save transformers' beams to {DATA.relative_to(ROOT)}")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from engine import LLM, BeamSearchParams

    llm = LLM(None, dtype="float32")
    eos = llm.engine.eos_token_ids
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.config.model or _default_dir(), dtype=torch.float32).eval()
    prompts = workload_prompts(llm.tokenizer, "questions")
    data: dict = {"max_new_tokens": MAX_NEW, "eos": eos, "prompts": prompts, "settings": []}
    print(f"{'W':>2} {'L':>4}  best equal  sets equal  ours s  transformers s")
    for width, lp in SETTINGS:
        t = time.perf_counter()
        outs = llm.beam_search(prompts, BeamSearchParams(width, MAX_NEW, length_penalty=lp, early_stopping=True))
        ours_s = time.perf_counter() - t
        t = time.perf_counter()
        theirs = [hf_beams(hf, p, width, lp, eos) for p in prompts]
        hf_s = time.perf_counter() - t
        best = same = 0
        for i, (out, (beams, scores)) in enumerate(zip(outs, theirs)):
            mine = [s.output_token_ids for s in out.sequences]
            b, s = compare(mine, beams)
            best, same = best + b, same + s
            if not s:
                _explain(i, mine, [x.cum_logprob for x in out.sequences], beams, scores, lp)
        print(f"{width:>2} {lp:>4}  {best:>6}/24  {same:>6}/24  {ours_s:>6.1f}  {hf_s:>14.1f}")
        data["settings"].append({"beam_width": width, "length_penalty": lp, "beams": [b for b, _ in theirs],
                                 "scores": [s for _, s in theirs]})
    if args.write:
        DATA.write_text(json.dumps(data, separators=(",", ":")) + "\n")
        print(f"wrote {DATA.relative_to(ROOT)}")


def _explain(i: int, mine: list[list[int]], cums: list[float], theirs: list[list[int]], scores: list[float],
             lp: float) -> None:
    """Where the two sides' beams part, with each side's ranking score."""
    print(f"  prompt {i}: beams differ")
    for rank, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(f"    rank {rank}: part at token {at}; ours {cums[rank] / len(a) ** lp:.6f} "
                  f"({len(a)} tokens), transformers {scores[rank]:.6f} ({len(b)} tokens)")


def _default_dir() -> str:
    from engine.models import loader

    return str(loader.resolve(None).path)


if __name__ == "__main__":
    main()
