"""Structured outputs: a grammar every generated token must keep satisfiable.

xgrammar (vLLM's default backend) compiles JSON schemas, regexes and EBNF grammars
against the tokenizer once, and a matcher per sequence fills a vocabulary bitmask each
step in about 0.1 ms. The rest of the engine sees only this module: `Grammars.matcher`
when a sequence is created, `apply_masks` in the sampler, `Matcher.accept` when a token
is appended. A matcher's state is the tokens it has accepted, which preemption by
recompute keeps, so a preempted sequence resumes with its matcher as it was.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from engine import limits
from engine.errors import ParamError
from engine.sampling_params import Constraint

Key = tuple[str, str]  # (kind, spec)


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
    """Compiles constraints for one tokenizer, caching them by their text.

    Compiling runs on a thread of its own (xgrammar releases the GIL), never on the core's:
    a schema of a few thousand optional properties takes xgrammar tens of seconds, during
    which every other request's steps would wait. `submit` starts one; `result` takes it,
    or fails it once `timeout_s` has passed since it was submitted. A compile cannot be
    interrupted, so one past its deadline runs on to its end on that thread; its constraint
    is remembered and refused at once if it comes again. One that never started by then
    (the thread was busy with another) is given up and not remembered.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256,
                 timeout_s: float = 10.0) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._stop = list(stop_token_ids)
        self._compiler: Any = None
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher: fills every row's mask in one call
        self._cache: OrderedDict[Key, Any] = OrderedDict()
        self._cache_size = cache_size
        self._running: dict[Key, Future] = {}  # submitted and not yet taken into the cache
        self._too_slow: OrderedDict[Key, None] = OrderedDict()
        # One daemon thread, not a ThreadPoolExecutor: the interpreter joins an executor's
        # threads at exit, so a compile past its deadline held the engine process's exit.
        self._todo: queue.SimpleQueue[tuple[Future, Any, Constraint]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def _xgr(self) -> Any:
        import xgrammar  # late: requests without constraints never pay for it

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self._stop)
            self._compiler = xgrammar.GrammarCompiler(info)
        return xgrammar

    def submit(self, so: Constraint) -> Future | None:
        """Start compiling `so` unless it is cached (None then); ParamError naming
        `structured_outputs` at once for one too large or known to be too slow."""
        key = (so.kind, so.spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return None
        if len(so.spec) > limits.MAX_GRAMMAR_CHARS:
            raise ParamError("structured_outputs", f"the {so.kind} constraint has {len(so.spec)} characters; at "
                             f"most {limits.MAX_GRAMMAR_CHARS} are accepted")
        if key in self._too_slow:
            raise self._slow_error(so)
        if key not in self._running:
            self._sweep()
            self._xgr()
            if self._worker is None:
                self._worker = threading.Thread(target=_compile_loop, args=(self._todo,), name="grammar-compile",
                                                daemon=True)
                self._worker.start()
            future: Future = Future()
            self._todo.put((future, self._compiler, so))
            self._running[key] = future
        return self._running[key]

    def result(self, so: Constraint, future: Future, deadline: float, wait: bool = False) -> Any | None:
        """The compiled grammar once `future` is done (None while it runs and the deadline is
        ahead; with `wait`, blocks up to the deadline). ParamError when it failed or is late."""
        key = (so.kind, so.spec)
        if key in self._cache:
            return self._cache[key]
        if not future.done():
            left = deadline - time.monotonic()
            if wait and left > 0:
                concurrent.futures.wait([future], timeout=left)
            if not future.done():
                if time.monotonic() < deadline:
                    return None
                if future.cancel():  # never started: other constraints held the compiler
                    self._running.pop(key, None)
                    raise self._busy_error(so)
                self._too_slow[key] = None
                if len(self._too_slow) > self._cache_size:
                    self._too_slow.popitem(last=False)
                raise self._slow_error(so)
        self._running.pop(key, None)
        if future.cancelled():  # another request's wait for the same constraint gave it up
            raise self._busy_error(so)
        grammar = future.result()  # ParamError for an invalid constraint
        self._cache[key] = grammar
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return grammar

    def _sweep(self) -> None:
        """Take finished compiles nobody waits for any more (their requests were aborted)
        into the cache, so that `_running` holds only what is still compiling."""
        for key, future in list(self._running.items()):
            if future.done():
                del self._running[key]
                if not future.cancelled() and future.exception() is None:
                    self._cache[key] = future.result()
                    if len(self._cache) > self._cache_size:
                        self._cache.popitem(last=False)

    def compile(self, so: Constraint) -> Any:
        """The compiled grammar, waiting for it up to the timeout; ParamError naming
        `structured_outputs` when it is invalid, too large or too slow."""
        future = self.submit(so)
        if future is None:
            return self._cache[(so.kind, so.spec)]
        return self.result(so, future, time.monotonic() + self.timeout_s, wait=True)

    def _busy_error(self, so: Constraint) -> ParamError:
        return ParamError("structured_outputs", f"the {so.kind} constraint waited {self.timeout_s:g} s for the "
                          "grammar compiler, busy with others; retry")

    def _slow_error(self, so: Constraint) -> ParamError:
        return ParamError("structured_outputs", f"the {so.kind} constraint did not compile within "
                          f"{self.timeout_s:g} s; simplify it (fewer optional properties or alternatives)")

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


def _yield_cpu() -> None:
    """The compile thread runs at the lowest priority: a compile that outlives its deadline
    runs on, and on a machine whose cores the engine's threads already fill it should take
    only what they leave, not slow every step down (Linux gives each thread its own nice)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at normal priority
        pass


def _compile_loop(todo: queue.SimpleQueue) -> None:
    _yield_cpu()
    while True:
        future, compiler, so = todo.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(_compile(compiler, so))
        except BaseException as exc:  # noqa: BLE001 - the request's error, raised where it waits
            future.set_exception(exc)


def _compile(c: Any, so: Constraint) -> Any:
    """On the compile thread: xgrammar's compiled grammar, or ParamError naming the field."""
    try:
        if so.kind == "json":
            return c.compile_json_schema(so.spec, any_whitespace=False)
        if so.kind == "json_object":  # OpenAI's JSON mode promises an object, not any JSON value
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if so.kind == "regex":
            return c.compile_regex(so.spec)
        if so.kind == "choice":
            return c.compile_regex("|".join(_regex_literal(s) for s in json.loads(so.spec)))
        if so.kind == "structural_tag":
            return c.compile_structural_tag(so.spec)
        return c.compile_grammar(so.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()) or repr(exc)  # xgrammar's log prefix
        raise ParamError("structured_outputs", f"invalid {so.kind} constraint: {why}") from None


def _regex_literal(text: str) -> str:
    special = set(r"\.^$|?*+()[]{}/")
    return "".join("\\" + ch if ch in special else ch for ch in text)
