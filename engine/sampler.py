"""Turns one step's logits into next tokens, batched over the rows that sample.

Processing follows vLLM: min_tokens masking, penalties, temperature, top-k, top-p,
min-p, then one draw per row through the inverse CDF. Every seeded request draws
from its own generator, so what a seeded request generates does not depend on
whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.cdf import inverse_cdf
from engine.messages import TokenLogprobs
from engine.rejection_sampler import Draft, Draws, Verdict, rejection_sample
from engine.rules import TokenRules
from engine.sampling_params import SamplingParams
from kernels import cpu as cpu_kernels


@dataclass
class SamplingRow:
    """One sequence that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None  # the request's own, persisting across steps
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated before this step
    matcher: Any = None  # engine.structured.Matcher: the grammar's mask applies
    rules: TokenRules | None = None  # the request's bans and biases, built at admission (engine/rules.py)
    # Speculative tokens this row comes after: they end output_token_ids, but the matcher has
    # not accepted them (it is advanced over them for this row's mask, then rolled back).
    ahead: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rules is None:  # a row made outside the engine (tests, benchmarks): no bad words
            self.rules = TokenRules.of(self.params)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None
    # Rows whose constraints left every token at -inf: their token_ids entry is meaningless
    # (argmax of all -inf is token 0), and the engine must end them instead of appending it.
    no_token: list[int] = field(default_factory=list)
    not_finite: list[int] = field(default_factory=list)  # rows of NaN or +inf: token_ids entry meaningless


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
        """One token per row."""
        verdicts = self.verify(logits, rows, [Draft([])] * len(rows))
        return SamplerOutput([v.token_ids[0] if v.token_ids else 0 for v in verdicts],
                             [v.logprobs[0] if v.logprobs else None for v in verdicts],
                             [i for i, v in enumerate(verdicts) if v.no_token],
                             [i for i, v in enumerate(verdicts) if v.not_finite])

    def verify(self, logits: torch.Tensor, rows: list[SamplingRow], drafts: list[Draft]) -> list[Verdict]:
        """Each draft owns len(tokens) + 1 consecutive rows: row j is the target's distribution
        after the draft's first j tokens. Every row goes through the same processing as an
        unspeculated step, so what is accepted is what the target would have produced
        (engine/rejection_sampler.py); a draft without tokens is a plain sampling step."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or sum(len(d.tokens) + 1 for d in drafts) != len(rows):
            raise ValueError(f"logits must be [{len(rows)}, vocab] for the drafts' rows, got {list(logits.shape)}")
        x = self.process(logits, rows)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        draws = Draws(self.generator, rows, drafts)
        probs = None  # by row; only sampled drafts read it past the target's own draw
        picked = None  # the rand rows' distributions
        if not rand:
            # top-k/top-p/min-p all keep the most likely token, so argmax is exact for greedy rows.
            target = argmax(x)
        elif len(rand) == len(rows):
            probs = picked = filtered_probs(x, [r.params for r in rows])
            target = inverse_cdf(probs, draws.u.to(x.device))
        else:
            target = argmax(x)
            idx = torch.tensor(rand, device=x.device)
            picked = filtered_probs(x[idx], [rows[i].params for i in rand])
            target[idx] = inverse_cdf(picked, draws.u[idx].to(x.device))
            if any(d.probs is not None for d in drafts):
                probs = torch.zeros_like(x)
                probs[idx] = picked
        verdicts = rejection_sample(target, probs, drafts, rows, draws, set(self._no_token(x, rows)),
                                    not_finite(x, target, rand, picked))
        draws.settle(verdicts)
        add_logprobs(logits, rows, drafts, verdicts)
        return verdicts

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The logits in float32 with every per-request rule applied: min_tokens, penalties,
        logit_bias and allowed_token_ids, bad words, the grammar's mask. A copy where a
        row has a rule; else the logits themselves, as nothing after writes to them (the
        copy was 12.6 MB a step at 64 rows of SmolLM2's vocabulary)."""
        if not any(has_rule(r) for r in rows):
            return logits.float()
        x = logits.to(torch.float32, copy=True)
        self._mask_min_tokens(x, rows)
        apply_penalties(x, rows)
        apply_bias(x, rows)
        apply_bad_words(x, rows)
        constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            self.grammars.apply_masks(x, constrained, [rows[i].matcher for i in constrained],
                                      [rows[i].ahead for i in constrained])
        return x

    def _no_token(self, x: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """The rows where nothing is left to sample. Only constraints that ban tokens
        outright can get there, so only their rows are looked at."""
        maybe = [i for i, r in enumerate(rows)
                 if r.matcher is not None or r.rules.bans
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
                banned = self.eos_token_ids + list(r.rules.stop_token_ids)
                row_idx += [i] * len(banned)
                tok_idx += banned
        if row_idx:
            dev = x.device
            x[torch.tensor(row_idx, device=dev), torch.tensor(tok_idx, device=dev)] = -torch.inf


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token: the native kernel on CPU fp32 logits (the same indices
    as torch's; greedy sampling of 64 x 49,152 took 0.3 ms with it against 3.7 ms before,
    `scripts/bench_sampler.py`, with the copy `process` no longer makes), torch's elsewhere."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and cpu_kernels.available():
        return cpu_kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def not_finite(x: torch.Tensor, target: torch.Tensor, rand: list[int], picked: torch.Tensor | None) -> set[int]:
    """The rows whose scores are not a distribution (a NaN or +inf: an overflow in the model,
    or settings extreme enough to overflow fp32). Their token is meaningless, and may even
    lie past the vocabulary, so the engine ends them instead. Read at the chosen token
    only: a NaN anywhere in a row wins the argmax (NaN counts as largest), and a NaN or
    +inf anywhere turns the whole softmax into NaNs."""
    t = target.to(x.device)
    seen = x.gather(1, t[:, None])[:, 0]
    bad = torch.isnan(seen) | torch.isposinf(seen)
    if rand:
        assert picked is not None
        idx = torch.tensor(rand, device=x.device)
        bad[idx] = torch.isnan(picked.gather(1, t[idx][:, None])[:, 0])
    if not bool(bad.any()):
        return set()
    return set(torch.nonzero(bad).flatten().tolist())


def has_rule(r: SamplingRow) -> bool:
    """Whether Sampler.process changes this row's logits."""
    p = r.params
    return (len(r.output_token_ids) < p.min_tokens or p.repetition_penalty != 1 or p.frequency_penalty != 0
            or p.presence_penalty != 0 or r.rules.bias_ids is not None or r.rules.bans or r.matcher is not None)


def filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax of x after each row's temperature, top-k/top-p and min-p (rows all non-greedy)."""
    dev = x.device
    temps = torch.tensor([p.temperature for p in params], device=dev)
    x = x / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        x = top_k_top_p(x, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        x = apply_min_p(x, min_p)
    return torch.softmax(x, dim=-1)


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
        rules = r.rules
        if rules.allowed is not None:
            keep = rules.allowed.to(x.device)
            allowed = x[i, keep]
            x[i] = -torch.inf
            x[i, keep] = allowed
        if rules.bias_ids is not None:
            x[i, rules.bias_ids.to(x.device)] += rules.bias_values.to(x.device)


def apply_bad_words(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """vLLM's bad_words, in place: a one-token word is always banned; a longer one loses
    its last token whenever the output so far ends with the rest of it (engine/rules.py)."""
    for i, r in enumerate(rows):
        words = r.rules.bad_words
        if words is None:
            continue
        if len(words.always):
            x[i, words.always.to(x.device)] = -torch.inf
        more = words.banned_after(r.output_token_ids)
        if more:
            x[i, torch.tensor(more, device=x.device)] = -torch.inf


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


def top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens (0 = all), then the smallest most-likely set whose
    probability, renormalised over those, reaches top_p; ties keep the lower id, so
    top_k=1 picks exactly what argmax picks.

    The same sets as sorting the whole vocabulary (tests/unit/test_sampler.py keeps that
    reference), without the sort, which cost 130 ms at 64 rows: top_p is decided on each
    row's most likely 64 tokens, and only rows whose set is not closed there look at 16
    times more, up to the whole vocabulary.
    """
    rows, vocab = x.shape
    k = torch.where(top_k > 0, top_k, vocab).clamp_max(vocab)
    kept = k.clone()  # how many of each row's most likely tokens stay
    last = torch.full((rows,), -torch.inf, device=x.device)  # the smallest logit kept
    only_k = torch.nonzero((top_p >= 1) & (k < vocab)).flatten()
    if len(only_k):
        vals = x[only_k].topk(int(k[only_k].max()), dim=-1).values
        last[only_k] = vals.gather(1, (k[only_k] - 1)[:, None])[:, 0]
    todo = torch.nonzero(top_p < 1).flatten()
    width = 64
    while len(todo):
        rk = k[todo]
        w = min(vocab, max(width, int(rk[rk < vocab].max()) if bool((rk < vocab).any()) else 0))
        vals = x[todo].topk(w, dim=-1).values  # descending
        in_k = torch.arange(w, device=x.device)[None, :] < rk[:, None]
        # normalised over the row's top-k set: the candidates when they cover it, else all
        norm = torch.where(rk <= w, torch.logsumexp(vals.masked_fill(~in_k, -torch.inf), dim=-1),
                           torch.logsumexp(x[todo], dim=-1))
        probs = torch.exp(vals - norm[:, None]).masked_fill_(~in_k, 0.0)
        cum = probs.cumsum(dim=-1)
        p = top_p[todo][:, None]
        n = ((cum - probs < p) & in_k).sum(dim=-1).clamp_min_(1)
        # a row with nothing left to sample (every logit -inf) has no set to close: leave it
        closed = (rk <= w) | (cum[:, -1] >= p[:, 0]) | torch.isneginf(norm)
        kept[todo[closed]] = n[closed]
        last[todo[closed]] = vals[closed].gather(1, (n[closed] - 1)[:, None])[:, 0]
        todo = todo[~closed]
        width *= 16
    return keep_most_likely(x, kept, last)


def keep_most_likely(x: torch.Tensor, kept: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Row i keeps its kept[i] largest logits, whose smallest is last[i]; among logits equal
    to last[i], the lower ids."""
    vocab = x.shape[1]
    cut = kept < vocab
    if not bool(cut.any()):
        return x
    last = torch.where(cut, last, -torch.inf)[:, None]
    keep = x >= last
    crowded = torch.nonzero(cut & (keep.sum(dim=-1) > kept)).flatten()  # more equal to last than fit
    if len(crowded):
        xs, lo = x[crowded], last[crowded]
        ties = xs == lo
        room = kept[crowded] - (xs > lo).sum(dim=-1)
        keep[crowded] = (xs > lo) | (ties & (ties.cumsum(dim=-1) <= room[:, None]))
    return x.masked_fill(~keep, -torch.inf)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token, compared as
    logits (p_i < min_p * p_max exactly when x_i < x_max + log min_p): no softmax needed."""
    floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return x.masked_fill(x < floor, -torch.inf)


def add_logprobs(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[Draft], verdicts: list[Verdict]
                 ) -> None:
    """Each emitted token's logprob, rank and top-k from the raw model distribution of its row."""
    picked: list[int] = []
    tokens: list[int] = []
    first = 0
    for d, v in zip(drafts, verdicts):
        if rows[first].params.logprobs is not None:
            picked += range(first, first + len(v.token_ids))
            tokens += v.token_ids
            v.logprobs = []
        first += len(d.tokens) + 1
    if not picked:
        return
    chosen = logits[torch.tensor(picked, device=logits.device)] if len(picked) < len(rows) else logits
    lps = iter(token_logprobs(chosen, tokens, [rows[i].params.logprobs or 0 for i in picked]))
    for v in verdicts:
        if v.logprobs is not None:
            v.logprobs.extend(next(lps) for _ in v.token_ids)


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
