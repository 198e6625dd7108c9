"""Beam search through the completions route: `use_beam_search` returns n beams, best first."""

from __future__ import annotations


def test_use_beam_search_returns_n_beams_best_first(client):
    from tests.support.server import CHAT, MODEL

    r = client.completions.create(model=MODEL, prompt="The capital of France is", n=3, max_tokens=8,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 3
    assert r.usage.completion_tokens == 1 + 3 * 7  # every beam's computed positions
    ask = dict(model=MODEL, messages=CHAT, n=2, max_tokens=24,
               extra_body={"use_beam_search": True, "length_penalty": 0.6, "early_stopping": True})
    whole = client.chat.completions.create(**ask)
    # a stream carries each beam whole once the search ends: no beam is known before then
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == [c.message.content for c in whole.choices] and streamed[0] != streamed[1]
    assert "Paris" in streamed[0]
