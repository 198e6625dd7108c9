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
