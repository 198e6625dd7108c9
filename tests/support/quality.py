"""What the quantized paths are held to beyond their kernels' bounds: a model's perplexity
on a fixed text, with every GEMM row through the int8-activation kernel where asked."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from kernels import quant

TEXT = (Path(__file__).resolve().parents[1] / "data" / "perplexity.txt").read_text()


def perplexity(llm: LLM, tokens: int = 500) -> float:
    """Of the first `tokens` tokens of tests/data/perplexity.txt, through prompt_logprobs."""
    ids = llm.tokenizer.encode(TEXT)[:tokens]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [lp.logprob for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


def force_int8_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every int8-activation GEMM through the few-rows kernel that rounds x, prefill rows
    included (a decode step is one row, so this is what decoding computes, on every row)."""
    qlinear = quant.qlinear
    monkeypatch.setattr(quant, "qlinear", lambda x, w, s, q, k, kernel="auto", a8=False:
                        qlinear(x, w, s, q, k, "few" if a8 and quant.few_rows_available(q, k) else kernel, a8))
