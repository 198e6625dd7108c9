"""A user request inside the engine: its n sequences and what they produced since the last output."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.detokenizer import Detokenizer
from engine.outputs import CompletionDelta, RequestMetrics
from engine.sampler import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(eq=False)
class Request:
    """A user request: n sequences that share a prompt, forked once the prompt is computed."""

    request_id: str
    prompt: str | None
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
