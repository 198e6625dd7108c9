"""Prompt logprobs and bad_words through the API: echo with logprobs scores the prompt, then
the output."""

from __future__ import annotations

import openai
import pytest


pytestmark = pytest.mark.timeout(600)


# -- through the server (tests/support/server.py) ----------------------------------------------------
def test_echo_with_logprobs_scores_the_prompt_then_the_output(client):
    from tests.support.server import MODEL

    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(**kw, echo=True).choices[0]
    n_prompt = len(echoed.logprobs.tokens) - len(plain.logprobs.tokens)
    assert echoed.text == kw["prompt"] + plain.text and n_prompt > 0
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    assert all(isinstance(v, float) for v in echoed.logprobs.token_logprobs[1:])
    assert "".join(echoed.logprobs.tokens[:n_prompt]) == kw["prompt"]
    assert echoed.logprobs.token_logprobs[n_prompt:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert echoed.logprobs.text_offset[n_prompt] == len(kw["prompt"])
    streamed = list(client.completions.create(**kw, echo=True, stream=True))
    tokens = [t for ch in streamed for t in ch.choices[0].logprobs.tokens]
    assert tokens == echoed.logprobs.tokens and "".join(ch.choices[0].text for ch in streamed) == echoed.text


def test_prompt_logprobs_and_bad_words_through_the_api(client, http):
    from tests.support.server import CHAT, MODEL

    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 1})
    ids = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()["tokens"]
    plps = r.model_extra["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    assert all(str(t) in entry and 1 <= len(entry) <= 2 for t, entry in zip(ids[1:], plps[1:]))
    assert all(e["rank"] >= 1 and e["logprob"] <= 0 for entry in plps[1:] for e in entry.values())
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body={"prompt_logprobs": 1})
    assert exc.value.body["param"] == "prompt_logprobs"
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert "Paris" in client.chat.completions.create(**kw).choices[0].message.content
    banned = client.chat.completions.create(**kw, extra_body={"bad_words": ["Paris"]}).choices[0].message.content
    assert "Paris" not in banned
