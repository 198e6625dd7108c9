"""A user request inside the engine: its n sequences, what they produced since the last
output, and how that output is assembled (deltas only, never the text so far)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch

from engine.beam import BeamSearch
from engine.detokenizer import Detokenizer
from engine.messages import CompletionDelta, RequestDelta, RequestMetrics, TokenLogprobs
from engine.pooling import PoolingParams
from engine.sampler import token_logprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(eq=False)
class Request:
    """A user request: n sequences that share a prompt, forked once the prompt is computed."""

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[Detokenizer]
    arrival_time: float
    pending_forks: int = 0
    metrics: RequestMetrics = field(init=False)
    # What each sequence produced since this request's last output, by sequence index.
    deltas: dict[int, CompletionDelta] = field(default_factory=dict)
    # Per prompt token, when asked for: None for the first (nothing predicts it), then TokenLogprobs.
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    beam: BeamSearch | None = None  # beam search's state; then `seqs` are the live beams
    pooling: PoolingParams | None = None  # set for an embedding request (engine/pooling.py)
    pooled: list[float] | None = None  # its embedding or scores, once pooled

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(s.finished for s in self.seqs)

    def delta(self, seq: Sequence) -> CompletionDelta:
        if seq.index not in self.deltas:
            lps = [] if seq.params.logprobs is not None else None
            self.deltas[seq.index] = CompletionDelta(seq.index, "", [], lps)
        return self.deltas[seq.index]

    def fork(self, parent: Sequence, make: Callable[[int], Sequence]) -> list[Sequence]:
        """Once the shared prompt is computed, the other n-1 sequences, each where the
        parent is (the caller shares the parent's blocks with them)."""
        if self.pending_forks == 0 or parent.num_output_tokens > 0:
            return []
        children = []
        for i in range(1, self.pending_forks + 1):
            child = make(i)
            child.num_computed_tokens = parent.num_computed_tokens
            child.priority = parent.priority
            child.num_cached_tokens = parent.num_cached_tokens
            self.seqs.append(child)
            self.detoks.append(Detokenizer(self.detoks[0].tokenizer, parent.prompt_token_ids, self.params))
            children.append(child)
        self.pending_forks = 0
        return children

    def score_prompt(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """Extend the prompt logprobs by one chunk: `rows` are the logits at positions
        first.. first+len(rows)-1, each predicting the token after it. A sequence that
        recomputes its prompt (after preemption, or a fork) adds nothing already recorded."""
        count = rows.shape[0]
        skip = max(0, len(self.prompt_logprobs) - 1 - first)
        if skip < count:
            targets = seq.token_ids[first + 1 + skip:first + 1 + count]
            k = self.params.prompt_logprobs or 0
            self.prompt_logprobs.extend(token_logprobs(rows[skip:], targets, [k] * len(targets)))

    def take_output(self) -> RequestDelta:
        """What changed since the last output. Costs the size of the news, not of the answer."""
        finished = self.finished
        if finished:
            self.metrics.finished_time = time.monotonic()
        first = self.seqs[0]
        if self.beam is not None:  # one output, at the end: every beam, best first
            num_output = self.beam.num_rows
            reasons = [d.finish_reason or "abort" for d in self.deltas.values()]
        else:
            num_output = sum(s.num_output_tokens for s in self.seqs)
            reasons = [s.finish_reason or "abort" for s in self.seqs]
        prompt_lps = None
        if (self.prompt_logprobs and not self.prompt_logprobs_sent
                and len(self.prompt_logprobs) == first.num_prompt_tokens):
            prompt_lps, self.prompt_logprobs_sent = self.prompt_logprobs, True
        out = RequestDelta(
            self.request_id, first.num_prompt_tokens, list(self.deltas.values()), finished, num_output,
            first.num_cached_tokens, msgspec.structs.replace(self.metrics), prompt_lps,
            reasons if finished else None, self.pooled)
        self.deltas = {}
        return out
