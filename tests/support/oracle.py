"""Greedy continuations from transformers (the oracle) and from the engine, compared token
for token by the exactness tests of every architecture."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams


def hf_greedy(model, prompts: list[list[int]], max_new: int, eos: int | None) -> list[list[int]]:
    """Reference continuations, cut after the first eos (transformers pads after it)."""
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
            eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
        )[:, ids.shape[1]:].tolist()
    result = []
    for row in out:
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        result.append(row)
    return result


def engine_greedy(llm: LLM, prompts, max_new: int, ignore_eos: bool = False) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=ignore_eos)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def departs_only_at_near_ties(want, got, gap: float = 0.25) -> int:
    """Greedy outputs (with logprobs=5) of a reference run and one that rounds elsewhere
    (bf16, another kernel path): wherever `got` first departs from `want`, its pick must
    be among the reference's top five and at most `gap` nats below the reference's
    choice, as a near-tie flipped by rounding is; a defect picks tokens that are no
    near-tie. Returns how many outputs agree whole."""
    whole = 0
    for a, b in zip(want, got):
        i = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is None:
            whole += 1
            continue
        top = dict(a.logprobs[i].top)
        assert b.token_ids[i] in top and top[a.token_ids[i]] - top[b.token_ids[i]] <= gap, \
            (i, a.logprobs[i].top, b.token_ids[i])
    return whole
