"""Per-request sampling and stopping parameters: a msgspec struct, so that they cross to
the engine process as a typed message, and checked once by `validate()` where a request
enters the engine's API (LLM.generate, AsyncLLM.generate), never again downstream."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from engine import limits
from engine.errors import ParamError


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the whole output. `spec` is text for every kind: a JSON schema, a
    regex, a JSON list of choices, an EBNF grammar or an xgrammar structural tag (JSON;
    tool calls use it), and empty for json_object (any JSON object)."""

    kind: str
    spec: str = ""


class SamplingParams(msgspec.Struct, kw_only=True, array_like=True):
    """What to generate and when to stop, with OpenAI's meanings.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    Penalties follow the usual conventions: repetition_penalty divides positive and
    multiplies negative logits of every token already seen (prompt and output, as in
    transformers); presence and frequency penalties subtract from logits of tokens
    already generated (as OpenAI documents). logprobs=k returns the sampled token's
    log-probability and the k most likely alternatives at every step, computed from
    the raw model distribution.

    Building one checks nothing: `validate()` does, once, where the request enters the
    engine (LLM.generate and AsyncLLM.generate call it), so the engine process takes the
    decoded message as it is.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None: every token; else only these
    include_stop_str_in_output: bool = False  # keep the matched stop string at the end of the text
    structured: Constraint | None = None  # engine/structured.py
    prompt_logprobs: int | None = None  # logprob and top-k of every prompt token (the first has none)
    bad_words: list[str] = msgspec.field(default_factory=list)  # never generated, whether or not led by a space
    # Beam search over n beams (engine/beam.py), ranked by cum_logprob / length ** length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers

    def validate(self) -> SamplingParams:
        """Normalize (a lone stop string, top_k -1), then check every field's length, type
        and range, raising ParamError naming the first bad one; returns self, so calls
        chain. Lengths come first: a list of a million entries is refused before anything
        walks it."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):  # None, as vLLM's callers pass it
            if getattr(self, name) is None:
                setattr(self, name, [])
        if self.logit_bias is None:
            self.logit_bias = {}
        if self.top_k == -1:
            self.top_k = 0
        for name, most in _BOUNDED:
            _check_count(self, name, most)
        self._check_types()
        _check(self, "n", self.n >= 1, "must be at least 1")
        _check(self, "seed", self.seed is None or -(2**63) <= self.seed < 2**64, "must fit in 64 bits")
        _check(self, "temperature", 0 <= self.temperature <= limits.MAX_TEMPERATURE,
               f"must be in [0, {limits.MAX_TEMPERATURE:g}]")
        _check(self, "top_p", 0 < self.top_p <= 1, "must be in (0, 1]")
        _check(self, "top_k", self.top_k >= 0, "must be -1, 0 (disabled) or positive")
        _check(self, "min_p", 0 <= self.min_p <= 1, "must be in [0, 1]")
        _check(self, "repetition_penalty",
               limits.MIN_REPETITION_PENALTY <= self.repetition_penalty <= limits.MAX_REPETITION_PENALTY,
               f"must be in [{limits.MIN_REPETITION_PENALTY:g}, {limits.MAX_REPETITION_PENALTY:g}]")
        _check(self, "presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]")
        _check(self, "frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]")
        _check(self, "max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1")
        _check(self, "min_tokens", self.min_tokens >= 0, "must be non-negative")
        _check(self, "min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "must not exceed max_tokens")
        _check(self, "logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]")
        _check(self, "prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
               "must be in [0, 20]")
        _check_chars(self, "stop", limits.MAX_STOP_CHARS)
        _check(self, "stop", all(0 < len(s) <= limits.MAX_STOP_LEN for s in self.stop),
               f"must be non-empty strings of at most {limits.MAX_STOP_LEN} characters")
        _check_chars(self, "bad_words", limits.MAX_BAD_WORDS_CHARS)
        _check(self, "bad_words", all(w.strip() for w in self.bad_words), "must be non-blank strings")
        _check(self, "stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be non-negative")
        _check(self, "logit_bias", all(t >= 0 and -100 <= b <= 100 for t, b in self.logit_bias.items()),
               "must map non-negative token ids to biases in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(self, "allowed_token_ids", bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0,
                   "must be a non-empty list of non-negative token ids")
        _check(self, "structured", self.structured is None or self.structured.kind in STRUCTURED_KINDS,
               f"kind must be one of {', '.join(STRUCTURED_KINDS)}")
        self._check_beam()
        return self

    def _check_types(self) -> None:
        """Every field against its annotation, by msgspec (a bool is not an int, a string
        not a number), taking the converted values: an int temperature becomes a float,
        a tuple of stop strings a list."""
        try:
            typed = msgspec.convert(msgspec.structs.astuple(self), type(self))
        except msgspec.ValidationError as exc:
            index = re.search(r"\$\[(\d+)\]", str(exc))
            name = self.__struct_fields__[int(index.group(1))] if index else "params"
            detail = str(exc).split(" - at ")[0]
            raise ParamError(name, f"{name}: {detail}") from None
        for name in self.__struct_fields__:
            setattr(self, name, getattr(typed, name))

    def _check_beam(self) -> None:
        """Beam search ranks the model's raw distribution: what reshapes or constrains it,
        or reports per-token logprobs, is refused rather than silently left out."""
        _check(self, "length_penalty", math.isfinite(self.length_penalty), "must be a finite number")
        _check(self, "early_stopping", isinstance(self.early_stopping, bool) or self.early_stopping == "never",
               'must be true, false or "never"')
        if not self.use_beam_search:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) != _DEFAULTS[name]:
                    raise ParamError(name, f"{name} applies only with use_beam_search")
            return
        _check(self, "temperature", self.temperature == 0,
               "must be 0 (or unset) with use_beam_search: beam search is deterministic")
        for name in BEAM_EXCLUDES:
            if getattr(self, name) != _DEFAULTS[name]:
                shown = "structured_outputs" if name == "structured" else name  # as engine/structured.py names it
                raise ParamError(shown, f"{shown} cannot be combined with use_beam_search")

    def token_ids_used(self) -> dict[str, list[int]]:
        """Every token id a field names, by field: checked against the vocabulary."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias),
                "allowed_token_ids": self.allowed_token_ids or []}

    @property
    def greedy(self) -> bool:
        """temperature 0, or so close to it that dividing by it would overflow (limits.GREEDY_BELOW)."""
        return self.temperature < limits.GREEDY_BELOW


@dataclass
class BeamSearchParams:
    """LLM.beam_search's parameters, shaped like vLLM's: beam_width beams, all returned.
    temperature is there for vLLM callers and must stay 0: the search is deterministic."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        try:
            return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                                  temperature=self.temperature, length_penalty=self.length_penalty,
                                  early_stopping=self.early_stopping, use_beam_search=True).validate()
        except ParamError as exc:
            if exc.param != "n":
                raise
            raise ParamError("beam_width", f"beam_width must be at least 1, got {self.beam_width!r}") from None


# Fields whose non-default values beam search cannot honour.
BEAM_EXCLUDES = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                 "min_tokens", "stop", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids",
                 "structured", "bad_words")
_DEFAULTS = msgspec.structs.asdict(SamplingParams())


def _check(params: SamplingParams, name: str, ok: bool, why: str) -> None:
    if not ok:
        raise ParamError(name, f"{name} {why}, got {_shown(getattr(params, name))}")


def _shown(value: Any) -> str:
    """A value for an error message, cut short: the value may be a list of a million items."""
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + f"... ({len(value) if hasattr(value, '__len__') else '?'} items)"


def _check_count(params: SamplingParams, name: str, most: int) -> None:
    """At most `most` entries, checked before anything walks them (a value that is no
    list is left to the type check)."""
    value = getattr(params, name)
    n = len(value) if isinstance(value, (list, tuple, dict)) else 0
    if n > most:
        raise ParamError(name, f"{name} has {n} entries; at most {most} are accepted")


def _check_chars(params: SamplingParams, name: str, most_chars: int) -> None:
    """A list of strings holding at most `most_chars` characters in all."""
    chars = sum(map(len, getattr(params, name)))
    if chars > most_chars:
        raise ParamError(name, f"{name} holds {chars} characters in all; at most {most_chars} are accepted")


# Lists and maps with a bound on their entries (engine/limits.py).
_BOUNDED = (("stop", limits.MAX_STOP), ("bad_words", limits.MAX_BAD_WORDS),
            ("stop_token_ids", limits.MAX_STOP_TOKEN_IDS), ("logit_bias", limits.MAX_LOGIT_BIAS),
            ("allowed_token_ids", limits.MAX_ALLOWED_TOKEN_IDS))
