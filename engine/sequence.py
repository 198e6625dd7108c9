"""One sequence being generated: a user request with n samples owns n of them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.rules import TokenRules
from engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """`token_ids` is everything known (prompt, then outputs); `num_computed_tokens` is
    how much of it already sits in the KV cache. Each step the scheduler closes the gap
    between the two: there is no separate prefill phase.
    """

    seq_id: int  # unique within the engine; block tables are keyed by it
    request_id: str  # the user request this sequence belongs to
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, or what max_model_len leaves after the prompt
    generator: torch.Generator | None = None
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None
    error: str | None = None  # why the engine ended it ("abort"): no token was left to sample
    logprobs: list = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    matcher: Any = None  # engine.structured.Matcher when the output is constrained
    rules: TokenRules = field(default_factory=TokenRules)  # the request's bans and biases (engine/rules.py)
    priority: int = 0  # with scheduling_policy "priority": lower runs first
    # Beam search: the request's live beams (this one among them), one list they all share, so
    # that the scheduler runs and preempts them together. None for every other request.
    group: list[Sequence] | None = None
    # In a pipeline's batch whose logits have not come back: not scheduled or preempted again
    # until they do (its next token is unknown and its KV is being written).
    in_flight: bool = False
    # Speculative decoding: the tokens proposed for this step, which follow token_ids but are
    # not part of it until verified; the draft model's distributions they were drawn from
    # (None when proposed deterministically); how many positions hold the draft model's KV.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    num_draft_computed: int = 0
    # An embedding request's pooling ("last" or "mean", engine/pooling.py): it samples
    # nothing and ends once its prompt is computed; a mean's running sum over the prompt.
    pool: str | None = None
    pool_sum: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
