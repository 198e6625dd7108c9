"""A request's token bans and biases, in the form a step applies them.

Built once when the request is admitted (engine/intake.py) and shared by its n sequences.
The sampler used to rebuild tensors from the request's lists on every step and walk every
bad word: a request with 1,000 bad words or a vocabulary's worth of allowed_token_ids
cost every step milliseconds of the core's single thread, for every request sharing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class BadWords:
    """vLLM's bad_words as token ids: a one-token word is always banned; a longer one bans
    its last token whenever the output so far ends with the rest of it (its head)."""

    always: torch.Tensor  # long: the one-token words
    by_head: dict[tuple[int, ...], list[int]]  # head -> the last tokens it bans
    head_lengths: tuple[int, ...]  # the distinct head lengths, so a step looks each up once

    @classmethod
    def of(cls, words: list[list[int]], device: torch.device | None = None) -> BadWords | None:
        if not words:
            return None
        by_head: dict[tuple[int, ...], list[int]] = {}
        always: list[int] = []
        for ids in words:
            *head, last = ids
            if head:
                by_head.setdefault(tuple(head), []).append(last)
            else:
                always.append(last)
        return cls(torch.tensor(always, dtype=torch.long, device=device), by_head,
                   tuple(sorted({len(h) for h in by_head})))

    def banned_after(self, output: list[int]) -> list[int]:
        """The last tokens of the longer words whose head ends `output`."""
        banned: list[int] = []
        for n in self.head_lengths:
            if n > len(output):
                break
            banned += self.by_head.get(tuple(output[-n:]), ())
        return banned


@dataclass(frozen=True)
class TokenRules:
    """What a request's lists say about tokens, looked up in O(1) or applied as one tensor op."""

    stop_token_ids: frozenset[int] = frozenset()
    allowed: torch.Tensor | None = None  # long: allowed_token_ids, deduplicated
    bias_ids: torch.Tensor | None = None  # long: logit_bias's keys...
    bias_values: torch.Tensor | None = None  # ...and its values, float32
    bad_words: BadWords | None = None

    @classmethod
    def of(cls, params: SamplingParams, bad_words: list[list[int]] | None = None,
           device: torch.device | None = None) -> TokenRules:
        allowed = bias_ids = bias_values = None
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(sorted(set(params.allowed_token_ids)), dtype=torch.long, device=device)
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        return cls(frozenset(params.stop_token_ids), allowed, bias_ids, bias_values,
                   BadWords.of(bad_words or [], device))

    @property
    def bans(self) -> bool:
        """Whether these rules can leave a row with no token at all."""
        return self.allowed is not None or self.bad_words is not None
