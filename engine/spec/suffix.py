"""Suffix decoding (Oliaro et al., 2024): counts of which token followed each recent context,
over the request's own tokens and the outputs of recent requests. Agents, code edits and
templated answers repeat whole passages across requests, which prompt lookup cannot see.

The index maps every context of 1..depth tokens to the counts of the tokens that followed
it: a suffix tree's frequency counts, kept as a dict. A proposal extends the request's
tokens by the most frequent follower of its longest indexed context, while the product of
those frequencies stays above min_prob. The shared part holds the last max_requests
outputs and forgets the oldest, so it stays bounded.
"""

from __future__ import annotations

from collections import deque

from engine.sequence import Sequence


class SuffixIndex:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.next: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: list[int], start: int = 1, sign: int = 1) -> None:
        """Count tokens[i] after each context ending at i, for i from start (sign -1 forgets)."""
        table = self.next
        for i in range(max(start, 1), len(tokens)):
            tok = tokens[i]
            for n in range(1, min(self.depth, i) + 1):
                key = tuple(tokens[i - n:i])
                counts = table.get(key)
                if counts is None:
                    counts = table[key] = {}
                c = counts.get(tok, 0) + sign
                if c > 0:
                    counts[tok] = c
                else:
                    counts.pop(tok, None)
                    if not counts:
                        del table[key]

    def __len__(self) -> int:
        return len(self.next)


class SuffixProposer:
    def __init__(self, depth: int, max_requests: int, min_prob: float) -> None:
        self.depth, self.min_prob = depth, min_prob
        self.shared = SuffixIndex(depth)
        self.recent: deque[list[int]] = deque()
        self.max_requests = max_requests
        self.own: dict[int, tuple[SuffixIndex, int]] = {}  # seq_id -> (its index, tokens indexed)

    def propose(self, seqs: list[Sequence], allow: list[int], copies: list[tuple[int, int]]) -> None:
        for seq, k in zip(seqs, allow):
            seq.spec_token_ids = self._propose(seq, k)

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        own, done = self.own.get(seq.seq_id) or (SuffixIndex(self.depth), 0)
        own.add(seq.token_ids, done)
        self.own[seq.seq_id] = (own, seq.num_tokens)
        ctx = seq.token_ids[-self.depth:]
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            counts = None
            for n in range(min(self.depth, len(ctx)), 0, -1):
                key = tuple(ctx[-n:])
                mine, theirs = own.next.get(key), self.shared.next.get(key)
                if mine or theirs:
                    counts = dict(theirs or {})
                    for tok, c in (mine or {}).items():
                        counts[tok] = counts.get(tok, 0) + c
                    break
            if not counts:
                break
            tok, c = max(counts.items(), key=lambda kv: kv[1])
            prob *= c / sum(counts.values())
            if prob < self.min_prob:
                break
            out.append(tok)
            ctx = ctx[1:] + [tok] if len(ctx) >= self.depth else ctx + [tok]
        return out

    def finish(self, seq: Sequence) -> None:
        """A finished sequence's output joins the shared index; the oldest may leave it."""
        self.own.pop(seq.seq_id, None)
        if self.max_requests == 0 or not seq.num_output_tokens:
            return
        output = seq.output_token_ids
        self.shared.add(output)
        self.recent.append(output)
        while len(self.recent) > self.max_requests:
            self.shared.add(self.recent.popleft(), sign=-1)
