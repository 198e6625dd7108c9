"""Turns one step's logits into next tokens, batched over the rows that sample.

Processing follows vLLM: min_tokens masking, penalties, temperature, top-k, top-p,
min-p, then an exponential race. The race (argmax of probs / Exp(1) noise) lets
every seeded request draw its noise from its own generator, so what a seeded
request generates does not depend on whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.messages import TokenLogprobs
from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own, persisting across steps
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    matcher: Any = None  # engine.structured.Matcher: the grammar's mask applies
    bad_words: list[list[int]] | None = None  # the request's bad_words as token ids (engine/intake.py)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
    # Rows whose constraints left every token at -inf: their token_ids entry is meaningless
    # (argmax of all -inf is token 0), and the engine must end them instead of appending it.
    no_token: list[int] = field(default_factory=list)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator, so the same seed gives the same draws on any device."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


class Sampler:
    def __init__(self, eos_token_ids: list[int], seed: int = 0, grammars: Any = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.grammars = grammars  # engine.structured.Grammars
        # Shared by the unseeded rows; they make no reproducibility promise.
        self.generator = make_generator(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab], got {list(logits.shape)}")
        x = logits.to(torch.float32, copy=True)
        self._mask_min_tokens(x, rows)
        apply_penalties(x, rows)
        apply_bias(x, rows)
        apply_bad_words(x, rows)
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            self.grammars.apply_masks(x, constrained, [rows[i].matcher for i in constrained])

        tokens = torch.empty(len(rows), dtype=torch.long, device=x.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            # top-k/top-p/min-p all keep the most likely token, so argmax is exact.
            idx = torch.tensor(greedy, device=x.device)
            tokens[idx] = x[idx].argmax(dim=-1)
        if rand:
            idx = torch.tensor(rand, device=x.device)
            picked = [rows[i] for i in rand]
            tokens[idx] = self._sample(x[idx], picked)

        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, compute_logprobs(logits, rows, token_ids), self._no_token(x, rows))

    def _no_token(self, x: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """The rows where nothing is left to sample. Only constraints that ban tokens
        outright can get there, so only their rows are looked at."""
        maybe = [i for i, r in enumerate(rows)
                 if r.matcher is not None or r.params.allowed_token_ids is not None or r.bad_words
                 or len(r.output_token_ids) < r.params.min_tokens]
        if not maybe:
            return []
        dead = torch.isneginf(x[torch.tensor(maybe, device=x.device)]).all(dim=-1).tolist()
        return [i for i, d in zip(maybe, dead) if d]

    def _mask_min_tokens(self, x: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Ban eos and stop tokens until a row has generated min_tokens."""
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, r in enumerate(rows):
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = self.eos_token_ids + r.params.stop_token_ids
                row_idx += [i] * len(banned)
                tok_idx += banned
        if row_idx:
            dev = x.device
            x[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = -torch.inf

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row from logits x (rows all non-greedy)."""
        dev = x.device
        temps = torch.tensor([r.params.temperature for r in rows], device=dev)
        x = x / temps[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1 for r in rows):
            top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
            top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
            x = apply_top_k_top_p(x, top_k, top_p)
        if any(r.params.min_p > 0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
            x = apply_min_p(x, min_p)
        probs = torch.softmax(x, dim=-1)
        return (probs / self._noise(rows, x.shape[1]).to(dev)).argmax(dim=-1)

    def _noise(self, rows: list[SamplingRow], vocab: int) -> torch.Tensor:
        """Exp(1) noise: seeded rows from their own generator, the rest in one draw."""
        q = torch.empty(len(rows), vocab)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        if shared:
            q[shared] = torch.empty(len(shared), vocab).exponential_(generator=self.generator)
        # An exact 0 would turn a zero probability into nan; the clamp moves no winner.
        return q.clamp_min_(torch.finfo(torch.float32).tiny)


def apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output, as transformers) then frequency/presence
    (output only, as OpenAI) penalties, in place. Costs nothing when no row uses them."""
    idx = [
        i
        for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1
        or r.params.frequency_penalty != 0
        or r.params.presence_penalty != 0
    ]
    if not idx:
        return
    dev, vocab = x.device, x.shape[1]
    picked = [rows[i] for i in idx]
    rep = torch.tensor([r.params.repetition_penalty for r in picked], device=dev)[:, None]
    freq = torch.tensor([r.params.frequency_penalty for r in picked], device=dev)[:, None]
    pres = torch.tensor([r.params.presence_penalty for r in picked], device=dev)[:, None]
    out_counts = _token_counts([r.output_token_ids for r in picked], vocab, dev)
    seen = _token_counts([r.prompt_token_ids for r in picked], vocab, dev) > 0
    seen |= out_counts > 0

    rows_idx = torch.tensor(idx, device=dev)
    v = x[rows_idx]
    v = torch.where(seen & (rep != 1), torch.where(v > 0, v / rep, v * rep), v)
    v = v - freq * out_counts - pres * (out_counts > 0).float()
    x[rows_idx] = v


def apply_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """OpenAI's logit_bias and vLLM's allowed_token_ids, in place, on the rows that ask."""
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, device=x.device)
            allowed = x[i, keep]
            x[i] = -torch.inf
            x[i, keep] = allowed
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=x.device)
            x[i, ids] += torch.tensor(list(p.logit_bias.values()), device=x.device)


def apply_bad_words(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's bad_words, in place: a one-token word is always banned; a longer one loses
    its last token whenever the output so far ends with the rest of it."""
    for i, r in enumerate(rows):
        for ids in r.bad_words or ():
            *head, last = ids
            if not head or r.output_token_ids[-len(head):] == head:
                x[i, last] = -torch.inf


def _token_counts(seqs: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float counts of each token id in each sequence."""
    width = max((len(s) for s in seqs), default=0)
    # Padding points at an extra column that is cut off afterwards.
    ids = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    counts = torch.zeros(len(seqs), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab].to(dev)


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens (0 = all), then the smallest most-likely set
    whose probability reaches top_p. One stable sort serves both; ties keep the
    lower id, so top_k=1 picks exactly what argmax picks."""
    vocab = x.shape[1]
    vals, order = x.sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(vocab, device=x.device)
    k = torch.where(top_k > 0, top_k, vocab)
    drop = pos[None, :] >= k[:, None]
    probs = torch.softmax(vals.masked_fill(drop, -torch.inf), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    # top_p == 1 must drop nothing, even where rounding pushes the cumsum past 1.
    drop |= (before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop = drop.scatter(1, order, drop)
    return x.masked_fill(drop, -torch.inf)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token."""
    probs = torch.softmax(x, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return x.masked_fill(probs < floor, -torch.inf)


def compute_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
) -> list[TokenLogprobs | None]:
    """Sampled-token logprob, rank and top-k from the raw model distribution."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if idx:
        picked = logits[torch.tensor(idx, device=logits.device)] if len(idx) < len(rows) else logits
        lps = token_logprobs(picked, [token_ids[i] for i in idx], [rows[i].params.logprobs or 0 for i in idx])
        for i, lp in zip(idx, lps):
            out[i] = lp
    return out


def token_logprobs(logits: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Row i: the logprob and rank of token_ids[i] and the ks[i] most likely tokens."""
    dev = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, device=dev)[:, None]
    chosen_lp = lp.gather(1, chosen)
    ranks = ((lp > chosen_lp).sum(dim=-1) + 1).tolist()
    k = max(ks, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1)
    top_lp, top_ids, chosen_lp = top_lp.tolist(), top_ids.tolist(), chosen_lp[:, 0].tolist()
    return [TokenLogprobs(token_ids[j], chosen_lp[j], ranks[j], list(zip(top_ids[j][:n], top_lp[j][:n])))
            for j, n in enumerate(ks)]
