"""Incremental detokenization of one sequence, with stop strings.

Decoding tokens one at a time would split characters whose bytes span several
byte-level tokens, and re-decoding the whole output every step is quadratic.
So, like vLLM and tokenizers' DecodeStream, we decode a short window of recent
tokens: `prefix` marks where the window starts (a few tokens of context, since
some decoders render a token differently at the very start), `read` marks where
the text already emitted ends, and the text past `read` is emitted only once it
no longer ends in U+FFFD, i.e. once its last character is complete.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from engine.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"
CONTEXT = 5  # prompt tokens decoded ahead of the output, as in vLLM
MAX_HELD = 8  # a character spans at most 4 bytes, so 4 byte-carrying tokens, plus slack


class Detokenizer:
    """Incremental detokenization of one sequence plus stop-string handling."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stops = list(params.stop)
        self._prefixes = stop_prefixes(tuple(self.stops))
        self.include_stop = params.include_stop_str_in_output
        self.text = ""  # emitted so far
        self.stop_reason: str | None = None
        self._held = ""  # decoded, but may be the start of a stop string
        # The prompt's last tokens give the decoder context, unless they end
        # mid-character: then the output's first bytes would join the prompt's.
        tail = list(prompt_token_ids[-CONTEXT:])
        self._ids = tail if not self._decode_ids(tail).endswith(REPLACEMENT) else []
        self._prefix = 0
        self._read = len(self._ids)

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def update(self, new_token_ids: list[int]) -> str:
        """Feed newly generated tokens; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        self._ids.extend(new_token_ids)
        return self._emit(self._advance(final=False), final=False)

    def flush(self) -> str:
        """Emit everything held back, at the end of a sequence not stopped by a stop string."""
        if self.stopped:
            return ""
        return self._emit(self._advance(final=True), final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])

    def _decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _advance(self, final: bool) -> str:
        """New complete text past `read`, moving the window along."""
        n = len(self._ids)
        if n == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if final or not text.endswith(REPLACEMENT):
            return self._commit(n, prefix_text, text)
        if n - self._read <= MAX_HELD:
            return ""
        # So many tokens without a complete character means invalid bytes, not a
        # character in progress: commit up to the latest token boundary where
        # splitting the decode changes nothing, keeping the cost per token bounded.
        for k in range(n - 1, self._read, -1):
            head = self._decode(self._prefix, k)
            rest = self._decode(k)
            if rest and head + rest == text:
                return self._commit(k, prefix_text, head)
        return ""

    def _commit(self, end: int, prefix_text: str, text: str) -> str:
        self._prefix, self._read = self._read, end
        return text[len(prefix_text) :]

    def _emit(self, delta: str, final: bool) -> str:
        """Apply stop strings to newly decoded text; hold back a possible stop start."""
        if not self.stops:
            self.text += delta
            return delta
        buf = self._held + delta
        # Earlier text never holds a stop string's start (it would have been held).
        hits = [(buf.find(s), i) for i, s in enumerate(self.stops) if s in buf]
        if hits:
            at, i = min(hits)
            self.stop_reason = self.stops[i]
            end = at + len(self.stops[i]) if self.include_stop else at
            out, self._held = buf[:end], ""
        else:
            keep = 0 if final else _partial_stop(buf, self._prefixes)
            out, self._held = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self.text += out
        return out


@dataclasses.dataclass(frozen=True)
class StopPrefixes:
    """The stop strings' proper prefixes by (length, hash), built once per request (its n
    sequences share it): a scan per token cost each stop string's length in `endswith`
    calls, ~275 ms a token for 100,000 stop strings. Hashes keep it to a few MB at the
    bounds engine/limits.py sets, where the prefixes themselves would take their squares."""

    stops: tuple[str, ...]
    longest: int
    hashes: frozenset[tuple[int, int]]


@functools.lru_cache(maxsize=64)
def stop_prefixes(stops: tuple[str, ...]) -> StopPrefixes:
    hashes = frozenset((n, hash(s[:n])) for s in stops for n in range(1, len(s)))
    return StopPrefixes(stops, max((len(s) - 1 for s in stops), default=0), hashes)


def _partial_stop(text: str, prefixes: StopPrefixes) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop."""
    for n in range(min(prefixes.longest, len(text)), 0, -1):
        tail = text[-n:]
        if (n, hash(tail)) in prefixes.hashes and any(s.startswith(tail) and len(s) > n for s in prefixes.stops):
            return n
    return 0
