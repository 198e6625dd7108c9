"""Streaming text must equal the one-shot decode and never show a stop string."""

from __future__ import annotations

import random
from typing import Any

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import Detokenizer
from engine.models import default_model_path
from engine.sampling_params import SamplingParams


TEXTS = [
    "Héllo wörld, naïve café — “quotes” and Ελληνικά, кириллица.",
    "emoji 👋🏽 family 👨‍👩‍👧 flags 🇯🇵 and 🤖🚀!",
    "中文字符和日本語のテキスト、한국어도 있어요。",
    "def f(x):\n    return x ** 2  # ∑ squares ≤ ∞\n",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    p = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)


@pytest.fixture(scope="module")
def partial_ids(tok: Any) -> list[int]:
    """Tokens holding part of a multi-byte character: they decode to U+FFFD alone."""
    return [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]


def stream(
    tok: Any,
    ids: list[int],
    params: SamplingParams | None = None,
    prompt: list[int] | None = None,
    chunks: list[int] | None = None,
) -> tuple[list[str], Detokenizer]:
    """Feed ids (one at a time, or in the given chunk sizes); deltas plus the flush last."""
    d = Detokenizer(tok, prompt or [], params or SamplingParams())
    deltas, i = [], 0
    for k in chunks or [1] * len(ids):
        deltas.append(d.update(ids[i : i + k]))
        i += k
    deltas.append(d.update(ids[i:]))
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_text_streams_exactly(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    deltas, d = stream(tok, ids)
    assert "".join(deltas) == d.text == text == tok.decode(ids)
    # Half a character is never emitted, even where tokens split one.
    assert not any("\ufffd" in delta for delta in deltas)


def test_texts_do_split_characters_across_tokens(tok: Any) -> None:
    # Guards the test above: it would prove nothing if no character were split.
    split = [i for t in TEXTS[1:3] for i in tok.encode(t) if "\ufffd" in tok.decode([i])]
    assert len(split) > 5


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_flush_to_full_decode(tok: Any, partial_ids: list[int], skip: bool) -> None:
    # Mostly partial-character tokens: invalid UTF-8 and characters spanning many
    # tokens, fed in random chunk sizes after random (possibly broken) prompts.
    rng = random.Random(1234)
    specials = tok.all_special_ids
    for _ in range(300):
        ids = [pick(rng, partial_ids, specials, len(tok)) for _ in range(rng.randrange(40))]
        prompt = [pick(rng, partial_ids, specials, len(tok)) for _ in range(rng.randrange(8))]
        chunks = [rng.randrange(1, 4) for _ in range(len(ids) // 2)]
        deltas, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip), prompt, chunks)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), (ids, prompt)


def pick(rng: random.Random, partial: list[int], specials: list[int], vocab: int) -> int:
    """A random token, mostly one holding part of a character."""
    roll = rng.random()
    if roll < 0.6:
        return rng.choice(partial)
    return rng.randrange(vocab) if roll < 0.9 else rng.choice(specials)


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=0, max_size=40))
def test_any_text_round_trips(tok: Any, text: str) -> None:
    ids = tok.encode(text)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)


class CountingTokenizer:
    """Records the longest id list ever decoded."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.longest = tok, 0

    def decode(self, ids: list[int], **kw: Any) -> str:
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, **kw)


def test_decode_window_stays_small(tok: Any, partial_ids: list[int]) -> None:
    counting = CountingTokenizer(tok)
    ids = tok.encode(" ".join(TEXTS) * 20)
    deltas, _ = stream(counting, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 1000 and counting.longest <= 12
    # A long run that never completes a character must not grow the window either.
    counting.longest = 0
    junk = [i for i in partial_ids if tok.decode([i]) == "\ufffd"][:1] * 500
    deltas, _ = stream(counting, junk)
    assert "".join(deltas) == tok.decode(junk)
    assert counting.longest <= 24


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Any, skip: bool) -> None:
    ids = tok.encode("Hi") + [tok.convert_tokens_to_ids("<|im_end|>")] + tok.encode(" there")
    deltas, d = stream(tok, ids, SamplingParams(skip_special_tokens=skip))
    assert d.text == ("Hi there" if skip else "Hi<|im_end|> there")


def test_prompt_context_does_not_change_output(tok: Any) -> None:
    prompt = tok.encode("Say hi in Japanese: ")
    ids = tok.encode("こんにちは 👋")
    deltas, _ = stream(tok, ids, prompt=prompt)
    assert "".join(deltas) == "こんにちは 👋"
    # A prompt cut mid-character must not swallow the output's first bytes.
    cut = [i for i in tok.encode("世") if "\ufffd" in tok.decode([i])][:1]
    deltas, _ = stream(tok, tok.encode(" ok"), prompt=prompt + cut)
    assert "".join(deltas) == " ok"


def stop_stream(tok: Any, text: str, stop: list[str]) -> tuple[list[str], Detokenizer]:
    return stream(tok, tok.encode(text), SamplingParams(stop=stop))


def test_stop_string_single_token(tok: Any) -> None:
    deltas, d = stop_stream(tok, "Hello world. Goodbye", [" world"])
    assert "".join(deltas) == d.text == "Hello"
    assert d.stopped and d.stop_reason == " world"


def test_stop_string_spanning_tokens(tok: Any) -> None:
    text = "The answer is forty-two, obviously."
    stop = "ty-tw"
    assert len(tok.encode(stop)) > 1
    deltas, d = stop_stream(tok, text, [stop])
    assert "".join(deltas) == d.text == "The answer is for"
    assert d.stop_reason == stop


def test_include_stop_str_in_output_keeps_the_match(tok: Any) -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string, spanning tokens too."""
    text = "The answer is forty-two, obviously."
    deltas, d = stream(tok, tok.encode(text), SamplingParams(stop=["ty-tw"], include_stop_str_in_output=True))
    assert "".join(deltas) == d.text == "The answer is forty-tw"
    assert d.stop_reason == "ty-tw"


def test_stop_string_at_the_very_start(tok: Any) -> None:
    deltas, d = stop_stream(tok, "STOP and more text", ["STOP"])
    assert "".join(deltas) == d.text == ""
    assert d.stopped


def test_earliest_stop_string_wins(tok: Any) -> None:
    deltas, d = stop_stream(tok, "alpha beta gamma delta", ["delta", "gamma", "beta gamma"])
    assert d.text == "alpha " and d.stop_reason == "beta gamma"
    # Within one update too: all three arrive in the same chunk.
    d = Detokenizer(tok, [], SamplingParams(stop=["delta", "beta"]))
    assert d.update(tok.encode("alpha beta gamma delta")) == "alpha "
    assert d.stop_reason == "beta"


def test_nothing_after_stop(tok: Any) -> None:
    d = Detokenizer(tok, [], SamplingParams(stop=["."]))
    d.update(tok.encode("One. Two"))
    assert d.update(tok.encode(" three")) == "" and d.flush() == "" and d.text == "One"


def test_stop_string_never_partially_emitted(tok: Any) -> None:
    stop = "END OF STORY"
    text = "Once upon a time, END OF STOR and then END OF STORY; trailing"
    deltas, d = stop_stream(tok, text, [stop])
    assert d.text == "Once upon a time, END OF STOR and then "
    emitted = ""
    for delta in deltas:
        emitted += delta
        # Whatever was visible mid-stream is a prefix of the final text.
        assert d.text.startswith(emitted)


def test_hold_back_and_flush(tok: Any) -> None:
    d = Detokenizer(tok, [], SamplingParams(stop=["world peace"]))
    shown = d.update(tok.encode("Hello wor"))
    # "wor" could begin "world peace"; only the rest may be shown.
    assert shown == "Hello " and d.text == "Hello "
    shown += d.update(tok.encode("ld"))
    assert shown == "Hello "
    shown += d.update(tok.encode(" hunger"))
    assert shown == "Hello world hunger"
    shown += d.update(tok.encode(" world"))
    assert shown == "Hello world hunger "
    # Finished for another reason (length, eos): the held text is released.
    assert d.flush() == "world" and d.text == "Hello world hunger world" and not d.stopped


def test_no_hold_back_without_stop_strings(tok: Any) -> None:
    d = Detokenizer(tok, [], SamplingParams())
    assert d.update(tok.encode("Hello wor")) == "Hello wor"
