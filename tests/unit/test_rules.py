"""The per-request structures the core builds once at admission (engine/rules.py and the
detokenizer's stop prefixes) against the per-step scans they replace, on random inputs:
the same bans, the same held-back text."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import _partial_stop, stop_prefixes
from engine.rules import BadWords


def banned_by_scan(words: list[list[int]], output: list[int]) -> set[int]:
    """What the sampler did before: every word, every step."""
    return {ids[-1] for ids in words if len(ids) == 1 or output[-(len(ids) - 1):] == ids[:-1]}


def partial_by_scan(text: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


@pytest.mark.parametrize("seed", range(20))
def test_bad_words_ban_what_the_scan_banned(seed):
    rng = random.Random(seed)
    words = [[rng.randrange(6) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 30))]
    table = BadWords.of(words)
    for _ in range(50):
        output = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        got = set(table.always.tolist()) | set(table.banned_after(output))
        assert got == banned_by_scan(words, output), (words, output)


@pytest.mark.parametrize("seed", range(20))
def test_stop_prefixes_hold_back_what_the_scan_held_back(seed):
    rng = random.Random(seed)
    letters = "ab\u00e9\u4e2d"
    stops = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 12))]
    prefixes = stop_prefixes(tuple(stops))
    for _ in range(100):
        text = "".join(rng.choice(letters) for _ in range(rng.randint(0, 10)))
        assert _partial_stop(text, prefixes) == partial_by_scan(text, stops), (stops, text)
