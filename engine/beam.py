"""Beam search inside the engine: a request's beams are sequences that fork from their
parents through the KV cache's copy-on-write, and a dropped beam frees only its own blocks.

The search follows transformers' `generate(num_beams=W)`, the oracle it is tested
against: each step takes the top K = max(2, 1 + #end tokens)·W candidates over beams ×
vocabulary by cumulative logprob; an ending candidate among the first W becomes a
finished hypothesis scored cum_logprob / generated_len ** length_penalty, and the best
W that do not end become the next beams. `early_stopping` True stops once W hypotheses
are finished; False and "never" stop when no running beam could still beat the worst
of them (at the current length, or, for "never" with a positive penalty, at max_tokens).

This module holds the search state and the choice of candidates; the engine applies
the choice to sequences and blocks (engine/engine.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.detokenizer import Detokenizer
from engine.messages import CompletionDelta
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def penalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, as transformers ranks hypotheses. A finite
    but extreme penalty makes the power overflow (an OverflowError, which had killed the
    engine loop) or underflow to zero: there the quotient is taken at its limit, -0.0 or
    -inf, so the search ranks what float arithmetic can and goes on."""
    try:
        denom = float(length) ** length_penalty
    except OverflowError:
        return -0.0 if cum_logprob <= 0 else 0.0
    if denom == 0.0:
        return -math.inf if cum_logprob < 0 else (math.inf if cum_logprob > 0 else 0.0)
    return cum_logprob / denom


@dataclass
class Hypothesis:
    """A finished beam: its output tokens (the ending token included), as ranked."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (an end token) or "length" (max_tokens)
    stop_reason: int | None = None  # the stop token, when one of stop_token_ids ended it


@dataclass
class Candidate:
    """A continuation chosen to run on: `parent`'s tokens, then `token`."""

    parent: Sequence
    token: int
    cum_logprob: float


@dataclass
class BeamSearch:
    width: int
    max_tokens: int
    length_penalty: float
    early_stopping: bool | str
    eos_ids: frozenset[int]  # empty under ignore_eos
    stop_ids: frozenset[int]
    cum: dict[int, float] = field(default_factory=dict)  # seq_id -> cumulative logprob of its output
    # seq_id -> (the sequence's length when its row was computed, its logits row): a beam's
    # row waits here until every live beam has one (after a preemption they arrive apart).
    rows: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True
    done: bool = False
    num_rows: int = 0  # beam positions whose next-token distribution was computed: the usage

    @property
    def end_ids(self) -> frozenset[int]:
        return self.eos_ids | self.stop_ids

    def offer(self, seq: Sequence, row: torch.Tensor) -> None:
        self.rows[seq.seq_id] = (seq.num_tokens, row.detach().clone())

    def ready(self, live: list[Sequence]) -> bool:
        return bool(live) and all(self.rows.get(s.seq_id, (-1,))[0] == s.num_tokens for s in live)

    def step(self, live: list[Sequence]) -> list[Candidate]:
        """Advance every beam by one token: the next beams, best first (none once done)."""
        logits = torch.stack([self.rows.pop(s.seq_id)[1] for s in live]).float()
        scores = torch.log_softmax(logits, dim=-1)
        scores += torch.tensor([self.cum.get(s.seq_id, 0.0) for s in live])[:, None]
        vocab = scores.shape[1]
        keep = min(max(2, 1 + len(self.end_ids)) * self.width, scores.numel())
        top, idx = torch.topk(scores.view(-1), keep)
        self.num_rows += len(live)
        length = live[0].num_output_tokens + 1  # beams advance together: all have the same length
        last = length >= self.max_tokens
        full = self.early_stopping is True and len(self.finished) >= self.width
        running: list[Candidate] = []
        ended: list[Hypothesis] = []
        for rank, (cum, flat) in enumerate(zip(top.tolist(), idx.tolist())):
            parent, token = live[flat // vocab], flat % vocab
            if token in self.end_ids or last:
                # only the best W candidates may end the search's hypotheses; the rest are spares
                if rank < self.width and self.improvable and not full:
                    reason = "stop" if token in self.end_ids else "length"
                    stop = token if token in self.stop_ids and token not in self.eos_ids else None
                    ended.append(Hypothesis(parent.output_token_ids + [token], cum,
                                            penalized(cum, length, self.length_penalty), reason, stop))
            elif len(running) < self.width:
                running.append(Candidate(parent, token, cum))
        if ended:
            self.finished = sorted(self.finished + ended, key=lambda h: -h.score)[:self.width]
        self._check_improvable(running, length)
        self.done = last or not running or not self.improvable or (
            self.early_stopping is True and len(self.finished) >= self.width)
        return [] if self.done else running

    def _check_improvable(self, running: list[Candidate], length: int) -> None:
        """Whether the best running beam could still beat the worst of W finished ones."""
        if len(self.finished) < self.width or not running:
            return
        best = self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
        self.improvable = penalized(running[0].cum_logprob, best, self.length_penalty) > self.finished[-1].score

    def outputs(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> list[CompletionDelta]:
        """The finished beams, best first, each whole: its text leaves out the end token."""
        out = []
        for i, h in enumerate(self.finished):
            detok = Detokenizer(tokenizer, prompt_token_ids, params)
            shown = h.token_ids[:-1] if h.finish_reason == "stop" else h.token_ids
            text = detok.update(shown) + detok.flush()
            out.append(CompletionDelta(i, text, list(h.token_ids), None, h.finish_reason, h.stop_reason,
                                       cumulative_logprob=h.cum_logprob))
        return out
