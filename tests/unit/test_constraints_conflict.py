"""The sampler reports the rows whose constraints left no token, rather than sampling token 0
from a row of -inf."""

from __future__ import annotations


import torch

from engine import SamplingParams
from engine.sampler import Sampler, SamplingRow


def test_the_sampler_reports_rows_with_nothing_left():
    sampler = Sampler([2])
    logits = torch.randn(3, 10)
    rows = [SamplingRow(SamplingParams(temperature=0, allowed_token_ids=[2], min_tokens=1), None, [1], []),
            SamplingRow(SamplingParams(temperature=0), None, [1], []),
            SamplingRow(SamplingParams(temperature=0.7, allowed_token_ids=[2], min_tokens=1, seed=1), None, [1], [])]
    out = sampler(logits, rows)
    assert out.no_token == [0, 2]
    assert out.token_ids[1] == int(logits[1].argmax())
