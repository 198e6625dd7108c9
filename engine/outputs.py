"""What the engine hands back each step: vLLM-shaped outputs that carry their deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionDelta:
    """What one sequence produced in the step that reported it."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None  # engine.sampler.TokenLogprobs per new token, when asked for
    finish_reason: str | None = None  # set on the one delta that finishes the sequence
    stop_reason: int | str | None = None
    error: str | None = None  # why a sequence ended with "abort" when the engine ended it

    def extend(self, later: CompletionDelta) -> None:
        """Fold a later delta of the same sequence into this one (a reader that fell behind)."""
        self.text += later.text
        self.token_ids += later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs += later.logprobs
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = later.finish_reason, later.stop_reason, later.error


@dataclass
class CompletionOutput:
    """One generated sequence: cumulative state, plus `delta` for what this step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that matched
    logprobs: list[Any] | None = None  # engine.sampler.TokenLogprobs per token
    delta: CompletionDelta | None = None  # None when the sequence did not change this step
    error: str | None = None  # set with finish_reason "abort" when the request's own constraints ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # Sent once, in the first output after the whole prompt is computed: None for the first
    # prompt token, then engine.sampler.TokenLogprobs for each of the others.
    prompt_logprobs: list[Any] | None = None

    @property
    def deltas(self) -> list[CompletionDelta]:
        return [c.delta for c in self.outputs if c.delta is not None]
