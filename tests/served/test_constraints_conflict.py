"""Constraints that leave no token to sample, served: a 400 naming the field where the
parameters show it, an error event and [DONE] where only decoding does, and nothing left
in flight or holding KV blocks afterwards."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("conflict-tiny")), device="cpu", dtype="float32",
                              max_model_len=64, kv_cache_memory_bytes=8 << 20)
    llm = AsyncLLM(LLMEngine(cfg))
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving)) as tc:
        yield tc, llm
    llm.shutdown()


def test_served_conflicts_are_400s_or_an_error_event(app):
    tc, llm = app
    tok = llm.tokenizer
    no = tok.encode("no", add_special_tokens=False)
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0, "allowed_token_ids": no, "guided_choice": ["yes"]}
    r = tc.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "no_token_allowed" and "allowed_token_ids" in err["message"]
    r = tc.post("/v1/completions", json={**body, "stream": True})
    events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "no_token_allowed"
    r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "allowed_token_ids": no,
                                         "bad_words": ["no"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    assert llm.num_in_flight == 0
    assert tc.get("/stats").json()["blocks_used"] == 0
