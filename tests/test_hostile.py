"""Hostile request bodies against the OpenAI app in-process (a tiny random model on a
thread core): every one gets a normal answer or a 4xx with OpenAI's error object, never
a 5xx, and the engine is left with every KV block free."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(900)

ROUTES = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]
VALID = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.serving.async_llm import AsyncLLM
    from engine.serving.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("hostile-tiny")), device="cpu", dtype="float32",
                              max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=64 * 8192)
    llm = AsyncLLM(LLMEngine(cfg))
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving, max_body_bytes=MAX_BODY), raise_server_exceptions=False) as tc:
        yield tc, llm
    llm.shutdown()


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
    (b'"just a string"', None),
    (b"", None),
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


def test_a_body_past_the_limit_is_a_413(app):
    tc, _ = app
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    r = tc.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    chunked = tc.post("/v1/completions", content=iter([big[:1000], big[1000:]]))  # no Content-Length
    assert chunked.status_code == 413
    assert tc.post("/v1/completions", json=VALID["/v1/completions"]).status_code == 200


# -- generated bodies ---------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)
FIELDS = ["model", "prompt", "messages", "max_tokens", "n", "temperature", "top_p", "stop", "seed", "stream",
          "logprobs", "top_logprobs", "logit_bias", "response_format", "tools", "tool_choice", "tokens", "echo",
          "stream_options", "structured_outputs", "bad_words", "prompt_logprobs", "min_tokens", "top_k"]


def _dump(body) -> bytes:
    # allow_nan writes NaN/Infinity as Python does; surrogatepass keeps lone surrogates as bytes
    return json.dumps(body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), field=st.sampled_from(FIELDS), value=values,
       whole=st.booleans(), ascii_escapes=st.booleans())
def test_generated_bodies_never_get_a_5xx(app, route, field, value, whole, ascii_escapes):
    tc, _ = app
    body = value if whole else {**VALID[route], field: value}
    raw = json.dumps(body, allow_nan=True).encode() if ascii_escapes else _dump(body)
    check(tc.post(route, content=raw, headers={"Content-Type": "application/json"}))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=200))
def test_random_bytes_never_get_a_5xx(app, route, raw):
    tc, _ = app
    check(tc.post(route, content=raw, headers={"Content-Type": "application/json"}))


def test_the_engine_is_left_clean(app):
    tc, llm = app
    assert tc.post("/v1/chat/completions", json=VALID["/v1/chat/completions"]).status_code == 200
    stats = tc.get("/stats").json()
    assert stats["blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_a_full_queue_is_a_429_with_retry_after(app):
    from engine.serving.admission import Admission, QueueLimits

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


def test_each_request_is_one_span_that_joins_the_callers_trace(app):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tc, _ = app
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


def test_a_request_past_its_deadline_is_aborted_with_a_clear_error(app):
    import time

    tc, llm = app
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
