"""What clients send that OpenAI's spec allows: explicit nulls, the keys of OpenAI's own
responses echoed back in the history, extras of their own (service.unknown_fields); and
what the service promises back: JSON mode is an object, X-Request-Id, /version.
docs/service.md states the rule these tests hold the server to."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.served import CHAT, MODEL

SAY = [{"role": "user", "content": "Say hello."}]


@pytest.mark.unit
def test_unknown_fields_are_a_400_or_dropped_and_named():
    from engine.serving.parsing import parse
    from engine.serving.errors import APIError
    from engine.serving.openai.protocol import ChatCompletionRequest, CompletionRequest

    body = json.dumps({"prompt": "hi", "frobnicate": 1, "stream_options": {"include_usage": True, "x": 2}}).encode()
    with pytest.raises(APIError) as err:
        parse(body, CompletionRequest, "reject")
    assert err.value.status == 400 and err.value.detail.param in ("frobnicate", "stream_options.x")
    req, ignored = parse(body, CompletionRequest, "warn")
    assert sorted(ignored) == ["frobnicate", "stream_options.x"] and req.stream_options.include_usage
    # inside a union member (content parts) too, and a wrong type is still a 400 under warn
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]}
    req, ignored = parse(json.dumps(chat).encode(), ChatCompletionRequest, "warn")
    assert ignored == ["messages[0].content[0].cache_control"] and req.messages[0].text() == "hi"
    with pytest.raises(APIError) as err:
        parse(json.dumps({"prompt": "hi", "n": "2", "extra": 1}).encode(), CompletionRequest, "warn")
    assert err.value.detail.param == "n"


@pytest.mark.served
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


@pytest.mark.served
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


@pytest.mark.served
def test_an_unknown_field_is_dropped_named_in_a_header_and_logged(http, server):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                "frobnicate": 1, "stream_options": {"x": 1}})
    assert r.status_code == 200, r.text
    assert sorted(r.headers["X-Ignored-Fields"].split(", ")) == ["frobnicate", "stream_options.x"]
    assert "ignored unknown fields frobnicate, stream_options.x" in server.log.read_text()


@pytest.mark.served
def test_json_mode_answers_a_json_object(client):
    r = client.chat.completions.create(model=MODEL, response_format={"type": "json_object"}, max_tokens=120,
                                       temperature=0, messages=[{"role": "user",
                                                                 "content": "Describe a cat as a JSON object."}])
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still an object's opening
        assert choice.message.content.lstrip().startswith("{")


@pytest.mark.served
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


@pytest.mark.engine
def test_chat_template_kwargs_reach_the_template(default_model_dir):
    from transformers import AutoTokenizer

    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    off = tok.decode(apply_chat_template(tok, SAY, template_kwargs={"enable_thinking": False}))
    assert off.endswith("/no_think") and not tok.decode(apply_chat_template(tok, SAY)).endswith("/no_think")


@pytest.mark.engine
@pytest.mark.parametrize("kwargs", [{"padding": "max_length", "max_length": 200_000_000}, {"padding": "bogus"},
                                    {"truncation": True}, {"return_tensors": "pt"}, {"tools": []}])
def test_chat_template_kwargs_never_reach_the_tokenizer(default_model_dir, kwargs):
    """Only template variables pass: apply_chat_template's own arguments (a 2e8-token
    padding, a bad padding value that was a 500) are refused naming the field, at once."""
    from transformers import AutoTokenizer

    from engine.errors import ParamError
    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    with pytest.raises(ParamError, match="template variables only") as err:
        apply_chat_template(tok, SAY, template_kwargs=kwargs)
    assert err.value.param == "chat_template_kwargs"


@pytest.mark.engine
def test_a_template_that_raises_is_the_requests_error(default_model_dir):
    from transformers import AutoTokenizer

    from engine.errors import ParamError
    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = "{% if strict %}{{ raise_exception('strict mode refuses this') }}{% endif %}x"
    with pytest.raises(ParamError, match="strict mode refuses") as err:
        apply_chat_template(tok, SAY, template_kwargs={"strict": True})
    assert err.value.param == "chat_template_kwargs"


@pytest.mark.unit
def test_ignored_field_names_are_escaped_cut_and_counted():
    """The names are the client's text: a CR/LF forged log lines and broke the header, a
    non-Latin-1 one made the header a 500 after the whole generation."""
    from engine.serving.parsing import MAX_SHOWN_FIELD, shown_fields

    shown = shown_fields(["a\r\nX-Evil: 1", "caf\u00e9\u4e2d", "k" * 10_000] + [f"f{i}" for i in range(40)])
    shown.encode("latin-1")  # a valid header value
    assert "\r" not in shown and "\n" not in shown and shown.isprintable()
    assert "k" * (MAX_SHOWN_FIELD + 1) not in shown and shown.endswith("(and 27 more)")
