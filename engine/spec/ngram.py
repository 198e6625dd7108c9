"""Prompt lookup: the request's latest tokens, found earlier in its own prompt or output,
propose what followed them there. Free to compute and strong whenever the output quotes
its input (rewrites, extraction, code edits)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.sequence import Sequence


def lookup(tokens: np.ndarray, low: int, high: int, k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest suffix of `tokens`
    of low..high tokens; [] when none occurs."""
    n_tokens = tokens.shape[0]
    for n in range(min(high, n_tokens - 1), low - 1, -1):
        # windows that end before the last token: the suffix itself is not a match
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high

    def propose(self, seqs: list[Sequence], allow: list[int], copies: list[tuple[int, int]]) -> None:
        for seq, k in zip(seqs, allow):
            seq.spec_token_ids = lookup(np.asarray(seq.token_ids, dtype=np.int64), self.low, self.high, k)

    def finish(self, seq: Sequence) -> None:
        pass
