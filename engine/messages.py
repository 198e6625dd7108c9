"""The contract between the engine core and its clients: every type that crosses.

Clients (the offline LLM, AsyncLLM's thread and process drivers) send Commands; the core
answers with Events. In one process these objects are handed over as they are; between
processes engine/client/wire.py encodes exactly these types and nothing else.

    client -> core   AddRequest | AbortRequest | GetStats | Stop
    core -> client   Ready(ModelInfo) once, then Added | StepOutput | StatsReply, and at
                     the end Stopped | Died

A StepOutput carries, per request that changed, only what the step added (new token
ids, new text, new logprobs, finish), plus the step's StepStats: its size never grows
with the length of an answer. Whoever wants cumulative state folds the deltas at its
own edge (engine/outputs.py for the offline API, AsyncLLM for a stream).
"""

from __future__ import annotations

import msgspec

from engine.errors import ParamError
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats, StepStats


class TokenLogprobs(msgspec.Struct, array_like=True):
    """A sampled (or prompt) token's logprob, its rank, and the k most likely alternatives."""

    token_id: int
    logprob: float
    rank: int  # of the token in the raw distribution, 1 = most likely
    top: list[tuple[int, float]]  # the k most likely (token_id, logprob), best first


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one sequence produced since the request's last output."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None  # per new token, when asked for
    finish_reason: str | None = None  # "stop", "length" or "abort", on the delta that ends it
    stop_reason: int | str | None = None  # the stop string or stop token that matched
    error: str | None = None  # why the engine ended it with "abort": nothing was left to sample
    cumulative_logprob: float | None = None  # a beam's, sent with its whole output (engine/beam.py)

    def extend(self, later: CompletionDelta) -> None:
        """Fold a later delta of the same sequence into this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs += later.logprobs
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason, self.error = later.finish_reason, later.stop_reason, later.error
        if later.cumulative_logprob is not None:
            self.cumulative_logprob = later.cumulative_logprob


class RequestMetrics(msgspec.Struct, array_like=True):
    """Engine-side timings (time.monotonic() of the core's process)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's news from one step. `num_output_tokens` is the running total over its
    sequences, so usage and traces read it instead of counting deltas again;
    `finish_reasons` (by sequence index) comes with the output that finishes it."""

    request_id: str
    num_prompt_tokens: int
    deltas: list[CompletionDelta]
    finished: bool
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, when the whole prompt is scored
    finish_reasons: list[str] | None = None
    pooled: list[float] | None = None  # a pooling request's embedding or scores, with its finished output


class ErrorInfo(msgspec.Struct, array_like=True):
    """A request's failure as it crosses: bad input keeps the field it names."""

    message: str
    param: str | None = None
    bad_input: bool = True

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        """A ValueError (ParamError among them) is the request's fault; anything else the engine's."""
        param = exc.param if isinstance(exc, ParamError) else None
        return cls(str(exc) or type(exc).__name__, param, isinstance(exc, ValueError))

    def exception(self) -> Exception:
        return ParamError(self.param, self.message) if self.bad_input else RuntimeError(self.message)


class ModelInfo(msgspec.Struct, array_like=True):
    """What a client needs to know once, when the core has started."""

    model_name: str
    hf_id: str | None
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[str, int | float]  # generation_config.json, for fields a request leaves unset
    stats: EngineStats  # the pool before the first step
    embedding_size: int | None = None  # the pooled vector's length; None: the engine serves no embeddings
    scores: bool = False  # whether it serves relevance scores (engine/scoring.py)
    score_template: str | None = None  # how query and document join; None: the tokenizer's pair encoding


# -- commands: client -> core ----------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """A request the client has validated: the core checks only what it alone knows
    (token ids against the vocabulary, lengths against max_model_len, grammars)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    pooling: PoolingParams | None = None  # an embedding request: pool the prompt, sample nothing


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class GetStats(msgspec.Struct, tag="get_stats", array_like=True):
    pass


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


Command = AddRequest | AbortRequest | GetStats | Stop


# -- events: core -> client ------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True):
    info: ModelInfo


class Added(msgspec.Struct, tag="added", array_like=True):
    """The core took the request (error None) or refused it."""

    request_id: str
    error: ErrorInfo | None = None


class StepOutput(msgspec.Struct, tag="step", array_like=True):
    """Every request that changed in one step (or one abort), and what the step did."""

    outputs: list[RequestDelta]
    stats: StepStats


class StatsReply(msgspec.Struct, tag="stats", array_like=True):
    stats: EngineStats


class Stopped(msgspec.Struct, tag="stopped", array_like=True):
    pass


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The core's loop is turning: sent when nothing else has been for a second, so that a
    client can tell a core stuck inside one step (/livez) from one with nothing to say."""


class Died(msgspec.Struct, tag="died", array_like=True):
    """The core's loop (or its start-up) failed; the message is for the server's log."""

    message: str


Event = Ready | Added | StepOutput | StatsReply | Stopped | Heartbeat | Died

__all__ = ["TokenLogprobs", "CompletionDelta", "RequestMetrics", "RequestDelta", "ErrorInfo", "ModelInfo",
           "AddRequest", "AbortRequest", "GetStats", "Stop", "Command", "Ready", "Added", "StepOutput",
           "StatsReply", "Stopped", "Heartbeat", "Died", "Event"]
