"""The offline API's results: cumulative, vLLM-shaped outputs, folded from the engine's
per-step deltas at the LLM's edge (engine/messages.py has what the core emits)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import RequestDelta, RequestMetrics, TokenLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that matched
    logprobs: list[TokenLogprobs] | None = None  # per token, when asked for
    error: str | None = None  # set with finish_reason "abort" when the request's own constraints ended it
    cumulative_logprob: float | None = None  # beam search: the sum of the output tokens' logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # None for the first prompt token (nothing predicts it), then TokenLogprobs for each other.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    pooled: list[float] | None = None  # a pooling request's embedding or scores (LLM.embed, LLM.score)


@dataclass
class EmbeddingOutput:
    """One input's embedding (LLM.embed): the pooled, optionally normalized vector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ScoreOutput:
    """One (query, document) pair's relevance (LLM.score): the head's sigmoid for one
    label, its softmax over several (`scores`); `score` is the first."""

    request_id: str
    prompt_token_ids: list[int]
    scores: list[float]

    @property
    def score(self) -> float:
        return self.scores[0]


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM's: `tokens` are the prompt's then the beam's."""

    tokens: list[int]
    text: str  # the beam's output, without its end token
    cum_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first

    @classmethod
    def of(cls, out: RequestOutput) -> BeamSearchOutput:
        prompt = out.prompt_token_ids
        return cls([BeamSearchSequence(prompt + c.token_ids, c.text, c.cumulative_logprob or 0.0, c.finish_reason,
                                       c.stop_reason, len(prompt)) for c in out.outputs])


class Folder:
    """One request's deltas folded into a RequestOutput. Text is joined once, when the
    request finishes, so folding costs the size of each delta, not of the text so far."""

    def __init__(self, request_id: str, prompt: str | None = None, prompt_token_ids: list[int] | None = None
                 ) -> None:
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids or []), [], False)
        self._parts: dict[int, list[str]] = {}

    def add(self, delta: RequestDelta) -> RequestOutput:
        out = self.output
        for d in delta.deltas:
            if d.index not in self._parts:
                self._parts[d.index] = []
                out.outputs.append(CompletionOutput(d.index, "", [], logprobs=None if d.logprobs is None else []))
                out.outputs.sort(key=lambda c: c.index)
            comp = next(c for c in out.outputs if c.index == d.index)
            self._parts[d.index].append(d.text)
            comp.token_ids += d.token_ids
            if d.logprobs is not None and comp.logprobs is not None:
                comp.logprobs += d.logprobs
            if d.finish_reason is not None:
                comp.finish_reason, comp.stop_reason, comp.error = d.finish_reason, d.stop_reason, d.error
            if d.cumulative_logprob is not None:
                comp.cumulative_logprob = d.cumulative_logprob
        out.finished, out.num_cached_tokens, out.metrics = delta.finished, delta.num_cached_tokens, delta.metrics
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if delta.pooled is not None:
            out.pooled = delta.pooled
        if delta.finished:
            for comp in out.outputs:
                comp.text = "".join(self._parts[comp.index])
        return out


class Collector:
    """Folds a stream of steps' outputs into one RequestOutput per request."""

    def __init__(self) -> None:
        self.folders: dict[str, Folder] = {}

    def expect(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.folders[request_id] = Folder(request_id, prompt, prompt_token_ids)

    def add(self, delta: RequestDelta) -> RequestOutput:
        """The request's output so far (texts complete once it has finished)."""
        if delta.request_id not in self.folders:
            self.folders[delta.request_id] = Folder(delta.request_id)
        return self.folders[delta.request_id].add(delta)
