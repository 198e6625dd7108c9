"""Hostile request bodies against the OpenAI app in-process, with the engine core on a
thread and in its own process (as the service runs it): every one gets a normal answer or
a 4xx with OpenAI's error object, never a 5xx, and the engine is left with every KV block
free and no request in flight."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(900)

ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/responses"]
VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
}
MAX_BODY = 64 << 10


@pytest.fixture(scope="module", params=["thread", "process"])
def app(request, tiny_model_factory):
    from starlette.testclient import TestClient

    from engine.client.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving import tracing
    from engine.serving.app import create_app
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("hostile-tiny")), device="cpu", dtype="float32",
                              max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=64 * 8192)
    # traced as service.py builds it, so hostile bodies go through the span code too
    if request.param == "thread":
        llm = AsyncLLM(LLMEngine(cfg), tracer=tracing)
    else:
        llm = AsyncLLM.start(cfg, tracer=tracing)
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving, max_body_bytes=MAX_BODY), raise_server_exceptions=False) as tc:
        yield tc, llm
    llm.shutdown()


def settled(llm, timeout: float = 10.0) -> bool:
    """No request in flight, once the aborts that cleanups sent have landed."""
    import time

    deadline = time.monotonic() + timeout
    while llm.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    return llm.num_in_flight == 0


def check(response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


# -- the cases the issue names -----------------------------------------------------------------
DEEP = "[" * 5000 + "]" * 5000
CASES = [
    (b'{"prompt": ' + DEEP.encode() + b"}", None),
    (b'{"prompt": "hi", "metadata": ' + b'{"a": ' * 200 + b"1" + b"}" * 200 + b"}", None),
    (b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    (b'{"prompt": "caf\\udce9"}', "prompt"),
    (b'{"prompt": "\xff\xfe not utf-8"}', None),
    (b'{"prompt": "hi", "temperature": NaN}', None),
    (b'{"prompt": "hi", "temperature": Infinity}', None),
    (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
    (b'{"prompt": "hi", "seed": 123456789012345678901234567890}', "seed"),
    (b'{"prompt": "hi", "top_k": 99999999999999999999}', "top_k"),
    (b'{"prompt": "hi", "max_tokens": 9223372036854775807}', "max_tokens"),
    (b'{"prompt": [1, 2, 99999999999]}', "prompt"),
    (b'{"prompt": {"nested": ["wrong", {"type": true}]}}', "prompt"),
    (b'{"prompt": "hi", "logit_bias": {"18446744073709551616": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"49152": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"' + b"9" * 5000 + b'": 1}}', "logit_bias"),
    (b'{"prompt": "hi", "allowed_token_ids": [9223372036854775807]}', "allowed_token_ids"),
    (b'{"prompt": "hi", "stop_token_ids": [49152]}', "stop_token_ids"),
    (b'{"prompt": "hi", "guided_json": "' + b"[" * 20000 + b"]" * 20000 + b'"}', "guided_json"),
    (b'{"prompt": "hi", "structured_outputs": {"json": "' + b'{\\"a\\":' * 70 + b"1" + b"}" * 70 + b'"}}',
     "structured_outputs"),
    (b'"just a string"', None),
    (b"", None),
    # the bounds on each list the core walks (engine/limits.py), and values past float32
    (json.dumps({"prompt": "hi", "stop": ["x"] * 257}).encode(), "stop"),
    (json.dumps({"prompt": "hi", "stop": ["y" * 513]}).encode(), "stop"),
    (json.dumps({"prompt": "hi", "bad_words": [f"w{i}" for i in range(1025)]}).encode(), "bad_words"),
    (json.dumps({"prompt": "hi", "stop_token_ids": list(range(1025))}).encode(), "stop_token_ids"),
    (json.dumps({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}).encode(), "logit_bias"),
    (b'{"prompt": "hi", "repetition_penalty": 1e-300}', "repetition_penalty"),
    (b'{"prompt": "hi", "temperature": 1e300}', "temperature"),
    (json.dumps({"prompt": ["hi"] * 257}).encode(), "prompt"),
    (json.dumps({"prompt": ["hi"] * 64, "n": 8}).encode(), "n"),
]


@pytest.mark.parametrize(("body", "param"), CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("route", ["/v1/completions", "/tokenize"])
def test_named_hostile_bodies_are_400s(app, route, body, param):
    tc, _ = app
    r = tc.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    check(r)
    if param is not None:
        assert r.json()["error"]["param"] == param


DEEP_ARGS = "[" * 20000 + "]" * 20000


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_deep_tool_arguments_in_the_history_are_400s(app, route):
    tc, llm = app
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARGS}}
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]}
    if route != "/tokenize":
        body["max_tokens"] = 2
    r = tc.post(route, json=body)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    assert settled(llm)


RESPONSES_CASES = [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input[0].arguments"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": []}, "input"),
]


@pytest.mark.parametrize(("body", "param"), RESPONSES_CASES, ids=[p for _, p in RESPONSES_CASES])
def test_responses_bodies_it_cannot_serve_are_400s_naming_the_field(app, body, param):
    tc, llm = app
    r = tc.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text[:300]
    check(r)
    assert r.json()["error"]["param"] == param
    missing = tc.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"
    assert settled(llm)


def test_a_body_past_the_limit_is_a_413(app):
    tc, _ = app
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    r = tc.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = tc.post("/v1/completions", content=iter([big[:1000], big[1000:]]))  # no Content-Length
    assert chunked.status_code == 413
    assert tc.post("/v1/completions", json=VALID["/v1/completions"]).status_code == 200


# -- generated bodies ---------------------------------------------------------------------------
def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


big_ints = st.integers(min_value=2**63 - 3, max_value=2**63 + 3) | st.integers(min_value=2**64 - 3,
                                                                               max_value=2**64 + 3)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70) | big_ints
           | st.integers(min_value=10**30, max_value=10**300)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=200)
           | st.builds(_deep, st.integers(min_value=60, max_value=20000))  # JSON text nested past any bound
           | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3))
keys = st.text(max_size=10) | st.text(min_size=100, max_size=2000) | st.integers(min_value=0).map(str)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(keys, inner, max_size=4), max_leaves=20)
FIELDS = ["input", "instructions", "text", "max_output_tokens", "previous_response_id", "reasoning", "include",
          "model", "prompt", "messages", "max_tokens", "n", "temperature", "top_p", "stop", "seed", "stream",
          "logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice", "tokens", "echo",
          "stream_options", "structured_outputs", "bad_words", "prompt_logprobs", "min_tokens", "top_k",
          "allowed_token_ids", "stop_token_ids", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]


def _json_string_fields(route: str, text: str) -> list[dict]:
    """Bodies that carry `text` in every field whose value is itself JSON (or a grammar):
    tool-call arguments in the history, schemas sent as text, tool parameter schemas."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": text}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": text}]
    base = VALID[route]
    bodies = [{**base, "messages": history}] if route in ("/v1/chat/completions", "/tokenize") else []
    if route in ("/v1/chat/completions", "/v1/completions"):
        bodies += [{**base, "guided_json": text}, {**base, "structured_outputs": {"json": text}},
                   {**base, "guided_regex": text}, {**base, "guided_grammar": text}]
    if route == "/v1/responses":
        items = [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                     "arguments": text},
                 {"type": "function_call_output", "call_id": "c1", "output": text}]
        bodies += [{**base, "input": items}, {**base, "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "description": text}}}}]
    if route == "/v1/chat/completions":
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "x": {"type": "string", "description": text}}}}}
        bodies += [{**base, "tools": [tool], "tool_choice": "required"},
                   {**base, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                       "type": "object", "description": text}}}}]
    return bodies


def _dump(body) -> bytes:
    # allow_nan writes NaN/Infinity as Python does; surrogatepass keeps lone surrogates as bytes
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), field=st.sampled_from(FIELDS), value=values,
       whole=st.booleans(), ascii_escapes=st.booleans())
def test_generated_bodies_never_get_a_5xx(app, route, field, value, whole, ascii_escapes):
    tc, llm = app
    body = value if whole else {**VALID[route], field: value}
    raw = json.dumps(body, allow_nan=True).encode() if ascii_escapes else _dump(body)
    check(tc.post(route, content=raw, headers={"Content-Type": "application/json"}))
    assert settled(llm)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES[:3] + ROUTES[4:]), text=st.one_of(
    st.builds(_deep, st.integers(min_value=1, max_value=20000)),
    st.builds(lambda d: '{"a":' * d + "1" + "}" * d, st.integers(min_value=1, max_value=5000)),
    st.text(max_size=300), st.sampled_from(['{"name": "f"}', "[1e999]", '{"x": NaN}', '"\\ud800"', "{" * 3])))
def test_json_text_inside_fields_never_gets_a_5xx(app, route, text):
    tc, llm = app
    for body in _json_string_fields(route, text):
        check(tc.post(route, content=_dump(body), headers={"Content-Type": "application/json"}))
    assert settled(llm)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_random_bytes_never_get_a_5xx(app, route, raw):
    tc, _ = app
    check(tc.post(route, content=raw, headers={"Content-Type": "application/json"}))


def test_the_engine_is_left_clean(app):
    """Its own mix of bad bodies, refused requests, cut streams and good requests, then
    nothing may be left: no block used, nothing running or waiting, no stream open."""
    import time

    tc, llm = app
    for body, _ in CASES:
        tc.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    for body in _json_string_fields("/v1/chat/completions", _deep(3000)):
        tc.post("/v1/chat/completions", json=body)
    tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2000})  # longer than max_model_len
    with tc.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 40, "ignore_eos": True,
                                                    "stream": True}) as r:
        next(r.iter_lines())  # hang up after the first event
    assert tc.post("/v1/chat/completions", json=VALID["/v1/chat/completions"]).status_code == 200
    deadline = time.monotonic() + 10
    while tc.get("/stats").json()["blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = tc.get("/stats").json()
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert settled(llm)


def test_a_full_queue_is_a_429_with_retry_after(app):
    from engine.client.admission import Admission, QueueLimits

    tc, llm = app
    saved = llm.admission
    llm.admission = Admission(QueueLimits(max_waiting_requests=1))
    llm.admission.requests = 1  # one request already waiting for its first token
    try:
        for stream in (False, True):
            r = tc.post("/v1/completions", json={**VALID["/v1/completions"], "stream": stream})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "rate_limit_error"
        llm.admission.requests = 0
        assert tc.post("/v1/completions", json=VALID["/v1/completions"]).status_code == 200
    finally:
        llm.admission = saved


@pytest.fixture(scope="module")
def thread_app(tiny_model_factory):
    """The engine on a thread, so a test can slow its steps down."""
    from starlette.testclient import TestClient

    from engine.client.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving import tracing
    from engine.serving.app import create_app
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("hostile-tiny")), device="cpu", dtype="float32",
                              max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=64 * 8192)
    llm = AsyncLLM(LLMEngine(cfg), tracer=tracing)  # as service.py builds it
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving, max_body_bytes=MAX_BODY)) as tc:
        yield tc, llm
    llm.shutdown()


def test_each_request_is_one_span_that_joins_the_callers_trace(thread_app):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tc, _ = thread_app
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the process's first and only provider
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = tc.post("/v1/chat/completions", json={**VALID["/v1/chat/completions"], "max_tokens": 4, "temperature": 0},
                headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert r.status_code == 200
    r2 = tc.post("/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 2, "stream": True})
    assert r2.status_code == 200 and r2.text.endswith("data: [DONE]\n\n")
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == ["chat tiny", "text_completion tiny", "text_completion tiny"]
    chat = next(s for s in spans if s.name == "chat tiny")
    assert format(chat.context.trace_id, "032x") == trace_id and format(chat.parent.span_id, "016x") == parent
    a = chat.attributes
    usage = r.json()["usage"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert list(a["gen_ai.response.finish_reasons"]) == [r.json()["choices"][0]["finish_reason"]]
    for key in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "e2e"):
        assert a[f"gen_ai.latency.{key}"] >= 0
    others = [s for s in spans if s is not chat]
    assert all(s.parent is None and s.context.trace_id != chat.context.trace_id for s in others)


def test_bentomls_http_tracing_skips_only_the_routes_that_generate(thread_app):
    """BentoML wraps the app in OpenTelemetry's ASGI middleware, which records a span per
    ASGI message, so one per streamed token; service.py hands it tracing.GENERATION_ROUTES
    to skip, as the engine's own span stands for those requests. Other routes keep theirs."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util.http import ExcludeList
    from starlette.testclient import TestClient

    from engine.serving.tracing import GENERATION_ROUTES

    tc, _ = thread_app
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # the middleware's own, as BentoML passes it its own
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    client = TestClient(OpenTelemetryMiddleware(tc.app, excluded_urls=ExcludeList([GENERATION_ROUTES]),
                                                tracer_provider=provider))
    r = client.post("/v1/completions", json={"prompt": "one", "max_tokens": 4, "stream": True})
    assert r.status_code == 200 and r.text.count("data: ") >= 5 and r.text.endswith("data: [DONE]\n\n")
    r = client.post("/v1/chat/completions", json={**VALID["/v1/chat/completions"], "max_tokens": 2})
    assert r.status_code == 200
    assert exporter.get_finished_spans() == ()
    assert client.get("/v1/models").status_code == 200
    assert client.get("/v1/responses/resp_unknown").status_code == 404
    names = {s.name for s in exporter.get_finished_spans()}
    assert {"GET /v1/models", "GET /v1/models http send", "GET /v1/responses/resp_unknown"} <= names


def test_a_request_past_its_deadline_is_aborted_with_a_clear_error(thread_app):
    import time

    tc, llm = thread_app
    step = llm.engine.step

    def slow_step():
        time.sleep(0.02)  # ~50 tokens then take about a second
        return step()

    llm.engine.step = slow_step
    body = {"prompt": "hi", "max_tokens": 50, "ignore_eos": True}
    try:
        r = tc.post("/v1/completions", json=body, headers={"X-Request-Timeout": "0.3"})
        assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        r = tc.post("/v1/completions", json={**body, "stream": True}, headers={"X-Request-Timeout": "0.3"})
        events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
        assert 1 <= len(events) - 2 < 50  # some tokens came, then the deadline
        bad = tc.post("/v1/completions", json=body, headers={"X-Request-Timeout": "soon"})
        assert bad.status_code == 400
        assert tc.post("/v1/completions", json={**body, "max_tokens": 2},
                       headers={"X-Request-Timeout": "30"}).status_code == 200
    finally:
        llm.engine.step = step
    deadline = time.monotonic() + 10
    while tc.get("/stats").json()["blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tc.get("/stats").json()["blocks_used"] == 0
