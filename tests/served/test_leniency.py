"""What clients send that OpenAI's spec allows: explicit nulls, the keys of OpenAI's own
responses echoed back in the history, extras of their own (service.unknown_fields); and
what the service promises back: JSON mode is an object, X-Request-Id, /version.
docs/service.md states the rule these tests hold the server to."""

from __future__ import annotations

import json

import httpx

from tests.support.server import CHAT, MODEL


def test_explicit_nulls_mean_unset(client, http):
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "parallel_tool_calls": None,
             "tool_choice": None, "tools": None, "stop": None, "seed": None, "response_format": None,
             "stream_options": None, "max_completion_tokens": None, "user": None}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    r = http.post("/v1/chat/completions", json={**body, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == http.post(
        "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "echo": None,
                                           "suffix": None, "best_of": None, "logit_bias": None})
    assert r.status_code == 200, r.text


def test_history_echoed_from_openai_responses_is_accepted_and_type_checked(client, http):
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    echoed = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: None ...
    echoed.update(annotations=[], id="msg-1", reasoning_content="thinking")
    history = CHAT + [echoed, {"role": "user", "content": "And Italy?"}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 8})
    assert r.status_code == 200, r.text
    echoed["refusal"] = 5
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": history, "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].refusal"


def test_an_unknown_field_is_dropped_named_in_a_header_and_logged(http, server):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                "frobnicate": 1, "stream_options": {"x": 1}})
    assert r.status_code == 200, r.text
    assert sorted(r.headers["X-Ignored-Fields"].split(", ")) == ["frobnicate", "stream_options.x"]
    assert "ignored unknown fields frobnicate, stream_options.x" in server.log.read_text()


def test_json_mode_answers_a_json_object(client):
    r = client.chat.completions.create(model=MODEL, response_format={"type": "json_object"}, max_tokens=120,
                                       temperature=0, messages=[{"role": "user",
                                                                 "content": "Describe a cat as a JSON object."}])
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still an object's opening
        assert choice.message.content.lstrip().startswith("{")


def test_request_ids_version_and_the_swagger_document(http, server):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                  headers={"X-Request-Id": "trace-me-42"})
    assert r.headers["X-Request-Id"] == "trace-me-42"
    made = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert len(made.headers["X-Request-Id"]) == 32
    for odd in ("x" * 500, "tab\there", "caf\u00e9"):  # too long, unprintable, not ASCII: replaced
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                      headers={"X-Request-Id": odd.encode("latin-1")})
        assert r.status_code == 200 and len(r.headers["X-Request-Id"]) == 32
    assert http.post("/v1/completions", json={}).headers["X-Request-Id"]  # errors carry it too
    assert httpx.get(f"{server.url}/v1/models").headers["X-Request-Id"]  # a 401 as well
    from engine import __version__

    assert http.get("/version").json() == {"version": __version__}
    docs = http.get("/docs.json").json()  # what the Swagger page at / shows: BentoML's routes and ours
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/generate",
            "/chat"} <= set(docs["paths"])
    assert "ResponsesRequest" in docs["components"]["schemas"]
