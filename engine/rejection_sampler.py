"""Verification of speculative tokens (Leviathan et al., 2023), as vLLM's rejection sampler.

A sequence that proposed k tokens gets k + 1 rows of target logits, each processed as an
ordinary step would be (penalties, bias, bad words, grammar, temperature, top-k/top-p,
min-p). Draft token j is then accepted with probability min(1, p_j(d) / q_j(d)); the
first rejection is replaced by a draw from the normalised max(p_j - q_j, 0), and when all
k are accepted the last row adds one more token of the target's own.

A proposal made deterministically (n-gram, suffix, a greedy draft) has q_j = 1 at its
token. Then the test and the draw take one uniform: the target's own token at row j is
drawn by inverse CDF as in an unspeculated step, and the draft is accepted exactly when
it equals that token. That accepts with probability p_j(d), and a rejection's token
follows p_j without d, which is the rule above for q = 1. It also means a seeded request
draws the same numbers, one per emitted token, and so gives the same text, whether it
speculates or not and whatever shares its batch. Greedy rows are this case with argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.cdf import inverse_cdf
from engine.messages import TokenLogprobs


@dataclass
class Draft:
    """One sequence's proposal: its rows are len(tokens) + 1 consecutive logits rows."""

    tokens: list[int]
    # [len(tokens), vocab]: the distributions the tokens were drawn from; None when the
    # proposer chose them deterministically (q = 1 at the token).
    probs: torch.Tensor | None = None


@dataclass
class Verdict:
    """What one sequence emits this step: its accepted draft tokens, then one of the target's."""

    token_ids: list[int]
    num_accepted: int = 0
    # The row after token_ids had nothing left to sample (its constraints exclude every token).
    no_token: bool = False
    # The row after token_ids held a NaN or +inf (sampler.not_finite): no token can be trusted.
    not_finite: bool = False
    logprobs: list[TokenLogprobs] | None = None


class Draws:
    """The uniforms each row needs, from each seeded request's own generator.

    A deterministic proposal takes one uniform per row and gives back those of the rows it
    did not use, so its generator advances by one per emitted token, as without
    speculation. A sampled draft takes two per row (the test and the replacement draw).
    """

    def __init__(self, shared: torch.Generator, rows: list[Any], drafts: list[Draft]) -> None:
        n = len(rows)
        self.u = torch.zeros(n, dtype=torch.float64)
        self.w = torch.zeros(n, dtype=torch.float64)
        self._rewind: list[tuple[int, torch.Generator, torch.Tensor]] = []  # (draft index, generator, state)
        shared_rows: list[int] = []
        first = 0
        for i, d in enumerate(drafts):
            size = len(d.tokens) + 1
            row = rows[first]
            if not row.params.greedy:
                span = range(first, first + size)
                two = d.probs is not None
                if row.generator is None:
                    shared_rows += span
                else:
                    if not two and d.tokens:
                        self._rewind.append((i, row.generator, row.generator.get_state()))
                    vals = torch.rand(size * (2 if two else 1), generator=row.generator, dtype=torch.float64)
                    self.u[first:first + size] = vals[:size]
                    if two:
                        self.w[first:first + size] = vals[size:]
            first += size
        if shared_rows:
            idx = torch.tensor(shared_rows)
            vals = torch.rand(2 * len(shared_rows), generator=shared, dtype=torch.float64)
            self.u[idx], self.w[idx] = vals[: len(shared_rows)], vals[len(shared_rows):]

    def settle(self, verdicts: list[Verdict]) -> None:
        """Give back the uniforms of rows a deterministic proposal did not use."""
        for i, gen, state in self._rewind:
            gen.set_state(state)
            used = len(verdicts[i].token_ids)
            if used:
                torch.rand(used, generator=gen, dtype=torch.float64)


def rejection_sample(target: torch.Tensor, probs: torch.Tensor | None, drafts: list[Draft], rows: list[Any],
                     draws: Draws, dead: set[int], broken: set[int]) -> list[Verdict]:
    """`target`: per row, the target's own token (argmax, or drawn with draws.u); `probs`:
    per row, the distribution non-greedy rows sample from; `dead`: rows with no token left;
    `broken`: rows that are not a distribution."""
    # p(d) and q(d) of every sampled draft's tokens, read in one gather each
    checks: list[tuple[int, int, int]] = []  # (row, draft index, position)
    first = 0
    for i, d in enumerate(drafts):
        if d.probs is not None and d.tokens and not rows[first].params.greedy:
            checks += [(first + j, i, j) for j in range(len(d.tokens))]
        first += len(d.tokens) + 1
    accept: dict[int, bool] = {}
    if checks:
        assert probs is not None
        r_idx = torch.tensor([r for r, _, _ in checks])
        toks = torch.tensor([drafts[i].tokens[j] for _, i, j in checks])
        p = probs[r_idx, toks].double()
        q = torch.stack([drafts[i].probs[j, drafts[i].tokens[j]] for _, i, j in checks]).double()  # type: ignore[index]
        ok = (draws.u[r_idx] * q < p).tolist()
        accept = {r: bool(a) for (r, _, _), a in zip(checks, ok)}

    t = target.tolist()
    verdicts: list[Verdict] = []
    residual: list[tuple[int, int, int]] = []  # (verdict index, row, position) drawn from max(p - q, 0)
    first = 0
    for i, d in enumerate(drafts):
        v = Verdict([])
        k = len(d.tokens)
        for j in range(k + 1):
            r = first + j
            if r in dead:
                v.no_token = True
                break
            if r in broken:
                v.not_finite = True
                break
            if j == k:
                v.token_ids.append(t[r])
                break
            tok = d.tokens[j]
            if (accept[r] if r in accept else t[r] == tok):
                v.token_ids.append(tok)
                v.num_accepted += 1
                continue
            if r in accept:
                residual.append((i, r, j))
                v.token_ids.append(-1)  # filled below
            else:
                v.token_ids.append(t[r])
            break
        verdicts.append(v)
        first += k + 1

    if residual:
        assert probs is not None
        r_idx = torch.tensor([r for _, r, _ in residual])
        p = probs[r_idx]
        q = torch.stack([drafts[i].probs[j] for i, _, j in residual]).to(p)  # type: ignore[index]
        rest = (p - q).clamp_min_(0.0)
        empty = rest.sum(dim=-1, keepdim=True) <= 0  # p == q: a rejection cannot happen, but rounding
        rest = torch.where(empty, p, rest)
        drawn = inverse_cdf(rest, draws.w[r_idx].to(p.device)).tolist()
        for (i, _, _), tok in zip(residual, drawn):
            verdicts[i].token_ids[-1] = tok
    return verdicts
