"""Structured outputs: a grammar every generated token must keep satisfiable.

xgrammar (vLLM's default backend) compiles JSON schemas, regexes and EBNF grammars
against the tokenizer once, and a matcher per sequence fills a vocabulary bitmask each
step in about 0.1 ms. The rest of the engine sees only this module: `Grammars.matcher`
when a sequence is created, `apply_masks` in the sampler, `Matcher.accept` when a token
is appended. A matcher's state is the tokens it has accepted, which preemption by
recompute keeps, so a preempted sequence resumes with its matcher as it was.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import torch

from engine.errors import ParamError
from engine.sampling_params import Constraint


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.state = matcher  # the xgrammar.GrammarMatcher

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refused it (it never should)."""
        return bool(self.state.accept_token(token_id))

    @property
    def done(self) -> bool:
        """The grammar has ended (its stop token was accepted)."""
        return bool(self.state.is_terminated())


class Grammars:
    """Compiles constraints for one tokenizer, caching them by their text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher: fills every row's mask in one call
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size

    def _xgr(self) -> Any:
        import xgrammar  # late: requests without constraints never pay for it

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self._stop)
            self._compiler = xgrammar.GrammarCompiler(info)
        return xgrammar

    def compile(self, so: Constraint) -> Any:
        """The compiled grammar; ParamError naming `structured_outputs` when it is invalid."""
        key = (so.kind, so.spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        self._xgr()
        c = self._compiler
        try:
            if so.kind == "json":
                grammar = c.compile_json_schema(so.spec, any_whitespace=False)
            elif so.kind == "json_object":  # OpenAI's JSON mode promises an object, not any JSON value
                grammar = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif so.kind == "regex":
                grammar = c.compile_regex(so.spec)
            elif so.kind == "choice":
                choices = json.loads(so.spec)
                grammar = c.compile_regex("|".join(_regex_literal(s) for s in choices))
            elif so.kind == "structural_tag":
                grammar = c.compile_structural_tag(so.spec)
            else:
                grammar = c.compile_grammar(so.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()) or repr(exc)  # xgrammar's log prefix
            raise ParamError("structured_outputs", f"invalid {so.kind} constraint: {why}") from None
        self._cache[key] = grammar
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, so: Constraint) -> Matcher:
        xgr = self._xgr()
        return Matcher(xgr.GrammarMatcher(self.compile(so)))

    def apply_masks(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher],
                    aheads: list[list[int]] | None = None) -> None:
        """Set to -inf, in place, every token the matchers' grammars forbid next. A row with
        tokens `ahead` (speculative ones, not yet accepted) gets the mask after them: its
        matcher takes them, fills the row, and rolls back. Should the grammar refuse one,
        the row stays unmasked: verification stops at the refused token, before this row."""
        xgr = self._xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        plain = [i for i in range(len(rows)) if not aheads or not aheads[i]]
        if len(plain) == len(rows):
            self._batch.batch_fill_next_token_bitmask([m.state for m in matchers], bitmask)
        else:
            if plain:
                self._batch.batch_fill_next_token_bitmask([matchers[i].state for i in plain], bitmask, plain)
            for i in range(len(rows)):
                if aheads and aheads[i]:
                    state = matchers[i].state
                    taken = 0
                    for tok in aheads[i]:
                        if state.is_terminated() or not state.accept_token(tok):
                            break
                        taken += 1
                    if taken == len(aheads[i]) and not state.is_terminated():
                        state.fill_next_token_bitmask(bitmask, i)
                    if taken:
                        state.rollback(taken)
        if logits.shape[1] > self.vocab_size:  # padded vocab: the padding is never a token
            logits[rows, self.vocab_size:] = -torch.inf
        # Row i of the bitmask belongs to logits row rows[i]: expand it in place, no copy.
        full = bitmask.new_zeros((logits.shape[0], bitmask.shape[1]))
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits[:, : self.vocab_size], full, indices=rows)


def _regex_literal(text: str) -> str:
    special = set(r"\.^$|?*+()[]{}/")
    return "".join("\\" + ch if ch in special else ch for ch in text)
