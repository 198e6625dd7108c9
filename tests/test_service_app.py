"""The HTTP app in-process: what /health and the routes say about a dead engine, and the key check.

The end-to-end tests (test_service.py) run a real server with a healthy engine and a
key set; these cover the two states that server cannot show honestly: an engine loop
that has died, and a deployment without LLM_API_KEY.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.served
def test_health_and_routes_report_a_dead_engine(tiny_model_factory):
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("dead-tiny")), device="cpu", dtype="float32",
                              max_model_len=64, kv_cache_memory_bytes=16 * 8192)
    llm = AsyncLLM(LLMEngine(cfg))
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving)) as tc:
        assert tc.get("/health").status_code == 200

        def broken_step():
            raise RuntimeError("device lost")

        llm.engine.step = broken_step
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert tc.get("/health").status_code == 503
        assert tc.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


@pytest.mark.served
def test_a_stream_that_fails_after_its_headers_ends_with_an_error_event_then_done(tiny_model_factory):
    """The engine process is killed mid-stream: the client gets OpenAI's error object as an
    event and then `data: [DONE]`, as vLLM sends, so SDKs close the stream cleanly."""
    import json
    import os
    import signal

    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("dead-tiny")), device="cpu", dtype="float32",
                              max_model_len=512, kv_cache_memory_bytes=64 * 8192)
    llm = AsyncLLM.start(cfg)
    serving = OpenAIServing(llm, "tiny")
    with TestClient(create_app(lambda: serving)) as tc:
        body = {"prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with tc.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    os.kill(llm._core.pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        assert tc.get("/health").status_code == 503
    llm.shutdown()


@pytest.mark.unit
def test_api_key_middleware_is_open_without_a_key(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from engine.serving.middleware import APIKeyMiddleware

    inner = Starlette(routes=[Route("/v1/models", lambda r: PlainTextResponse("ok"), methods=["GET", "OPTIONS"]),
                              Route("/health", lambda r: PlainTextResponse("ok")),
                              Route("/stats", lambda r: PlainTextResponse("ok")),
                              Route("/metrics", lambda r: PlainTextResponse("ok"))])
    monkeypatch.delenv("LLM_API_KEY", raising=False)
    assert TestClient(APIKeyMiddleware(inner)).get("/v1/models").status_code == 200
    monkeypatch.setenv("LLM_API_KEY", "k")
    locked = TestClient(APIKeyMiddleware(inner))
    assert locked.get("/v1/models").status_code == 401
    assert locked.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert locked.get("/health").status_code == 200
    # several keys (rotation) and the ops routes behind the key on request
    monkeypatch.setenv("LLM_API_KEY", "old-key, new-key")
    rotated = TestClient(APIKeyMiddleware(inner, protect_ops=True))
    for key in ("old-key", "new-key"):
        assert rotated.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert rotated.get("/v1/models", headers={"Authorization": "Bearer old-key, new-key"}).status_code == 401
    assert rotated.get("/stats").status_code == 401 and rotated.get("/metrics").status_code == 401
    assert locked.get("/stats").status_code != 401  # open unless the preset protects it


@pytest.mark.unit
@pytest.mark.parametrize("raw", ["", "   ", " , ,"])
def test_a_key_variable_holding_no_key_stops_the_server(monkeypatch, raw):
    """Read as "no keys", an empty LLM_API_KEY served every caller unauthenticated."""
    from engine.serving.middleware import APIKeyMiddleware

    monkeypatch.setenv("LLM_API_KEY", raw)
    with pytest.raises(ValueError, match="holds no key"):
        APIKeyMiddleware(lambda scope, receive, send: None)


@pytest.mark.unit
def test_each_key_is_a_tenant_with_its_own_in_flight_quota(monkeypatch):
    """The route runs with the caller's tenant set (a hash, never the key), and a key past
    max_in_flight_per_key gets 429 while another key's requests go on."""
    import asyncio
    import threading

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from engine.serving.middleware import APIKeyMiddleware
    from engine.serving.tenancy import TENANT

    release, entered = threading.Event(), threading.Event()

    async def slow(request):
        entered.set()
        await asyncio.to_thread(release.wait, 10)
        return PlainTextResponse(TENANT.get() or "")

    async def who(request):
        return PlainTextResponse(TENANT.get() or "")

    inner = Starlette(routes=[Route("/v1/slow", slow), Route("/v1/who", who)])
    monkeypatch.setenv("LLM_API_KEY", "key-a,key-b")
    tc = TestClient(APIKeyMiddleware(inner, max_in_flight_per_key=1))
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("key-a", "key-b"))
    tenant_a, tenant_b = tc.get("/v1/who", headers=a).text, tc.get("/v1/who", headers=b).text
    assert tenant_a and tenant_b and tenant_a != tenant_b and "key" not in tenant_a
    held = threading.Thread(target=lambda: tc.get("/v1/slow", headers=a))
    held.start()
    try:
        assert entered.wait(10)
        busy = tc.get("/v1/who", headers=a)
        assert busy.status_code == 429 and busy.json()["error"]["code"] == "key_concurrency"
        assert tc.get("/v1/who", headers=b).status_code == 200  # another key is not held up
    finally:
        release.set()
        held.join(10)
    assert tc.get("/v1/who", headers=a).status_code == 200  # its place came back


@pytest.mark.unit
def test_a_non_ascii_key_matches_as_the_utf8_bytes_a_client_sends(monkeypatch):
    from starlette.testclient import TestClient

    from engine.serving.app import create_app
    from engine.serving.middleware import APIKeyMiddleware

    monkeypatch.setenv("LLM_API_KEY", "clé-секрет")
    tc = TestClient(APIKeyMiddleware(create_app(lambda: None)))
    right = "Bearer clé-секрет".encode()
    assert tc.get("/v1/models", headers={"Authorization": right}).status_code == 503  # past the key: no engine
    assert tc.get("/v1/models", headers={"Authorization": "Bearer clé-секрет".encode("latin-1", "replace")}
                  ).status_code == 401
    assert tc.get("/v1/models", headers={"Authorization": b"Bearer cl\xe9"}).status_code == 401
    # a preflight is never refused by the key check; without CORS configured the app says 405
    r = tc.options("/v1/chat/completions", headers={"Origin": "https://app.example",
                                                    "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert tc.post("/tokenize", json={"prompt": "hi"}).status_code == 401


@pytest.mark.served
def test_unset_sampling_fields_take_the_models_generation_config(tiny_model_factory):
    """As vLLM's `--generation-config auto`: temperature, top_p, top_k, min_p and
    repetition_penalty come from generation_config.json when the request leaves them out,
    served and offline alike, so the same request gives the same output in both."""
    import json

    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing
    from engine.serving.openai.protocol import CompletionRequest

    path = tiny_model_factory("gencfg-tiny")
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "do_sample": False}))
    cfg = EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_model_len=128,
                              kv_cache_memory_bytes=64 * 8192)
    llm = AsyncLLM.start(cfg)  # the defaults cross from the engine process
    serving = OpenAIServing(llm, "tiny")
    assert llm.info.sampling_defaults == {"temperature": 0.0, "top_k": 5}
    unset = serving.sampling_params(CompletionRequest(prompt="hi"), 8, None, {})
    assert unset.temperature == 0.0 and unset.top_k == 5
    explicit = serving.sampling_params(CompletionRequest(prompt="hi", temperature=0.7, top_k=0), 8, None, {})
    assert explicit.temperature == 0.7 and explicit.top_k == 0
    with TestClient(create_app(lambda: serving)) as tc:
        body = {"prompt": "hello there", "max_tokens": 12, "ignore_eos": True}
        texts = {tc.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(3)}
        assert len(texts) == 1  # greedy from the model's config, with no seed in sight
    llm.shutdown()
    # The same request offline gets the same defaults, so the same text.
    from engine import LLM

    offline = LLM(str(path), dtype="float32", max_model_len=128, kv_cache_memory_bytes=64 * 8192)
    defaults = offline.get_default_sampling_params(max_tokens=12, ignore_eos=True)
    assert defaults.temperature == 0.0 and defaults.top_k == 5
    assert offline.generate("hello there", defaults, use_tqdm=False)[0].outputs[0].text == texts.pop()
    assert offline.get_default_sampling_params(temperature=0.7).temperature == 0.7


@pytest.mark.unit
def test_typed_routes_get_the_body_guards_and_the_deadline():
    """TypedRouteGuard in front of a stand-in for BentoML's typed route: bad bodies get the
    OpenAI routes' 4xx, a deadline before the answer starts is a 408, one mid-stream ends
    the stream there, and either cancels the route (which aborts its engine request)."""
    import asyncio
    import json

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from engine.serving.middleware import TypedRouteGuard

    cancelled = []

    async def generate(request: Request):
        body = await request.json()

        async def chunks():
            try:
                for i in range(body.get("n", 3)):
                    await asyncio.sleep(body.get("delay", 0))
                    yield f"t{i} "
            except asyncio.CancelledError:
                cancelled.append(body)
                raise

        if body.get("slow_start"):
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                cancelled.append(body)
                raise
        return StreamingResponse(chunks(), media_type="text/plain")

    inner = Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                              Route("/other", lambda r: JSONResponse({"ok": True}), methods=["POST"])])
    tc = TestClient(TypedRouteGuard(inner, max_body_bytes=4096, request_timeout=30))
    assert tc.post("/generate", json={"prompt": "hi"}).text == "t0 t1 t2 "
    for raw, param in ((b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", "prompt"),
                       (b'{"prompt": "hi", "temperature": NaN}', None),
                       (b'{"prompt": "\\ud800"}', "prompt"), (b'{"seed": 99999999999999999999}', "seed"),
                       (b"[1, 2]", None), (b"not json", None)):
        r = tc.post("/generate", content=raw)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}, raw
        got = r.json()["error"]["param"]
        assert got == param if param is None else got.startswith(param), (raw, r.text)
    r = tc.post("/generate", content=json.dumps({"prompt": "x" * 5000}))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert tc.post("/other", content=b"[" * 100).json() == {"ok": True}  # other routes are not its business
    r = tc.post("/generate", json={"slow_start": True}, headers={"X-Request-Timeout": "0.2"})
    assert r.status_code == 408 and r.json()["error"]["code"] == "deadline_exceeded"
    r = tc.post("/generate", json={"n": 50, "delay": 0.05}, headers={"X-Request-Timeout": "0.5"})
    assert r.status_code == 200 and 2 <= len(r.text.split()) < 50
    assert tc.post("/generate", json={}, headers={"X-Request-Timeout": "soon"}).status_code == 400
    assert [b.get("slow_start", False) for b in cancelled] == [True, False]


@pytest.mark.unit
def test_large_tokenizer_work_leaves_the_event_loop_and_is_bounded():
    import asyncio
    import time

    from engine.client.admission import Offload, QueueFullError

    async def scenario():
        off = Offload(workers=1, max_waiting=2, threshold=10)
        loop = asyncio.get_running_loop()

        def slow(x):
            time.sleep(0.3)  # a chat template over a large body, say
            return x

        first = asyncio.create_task(off.run(100, slow, "a"))
        second = asyncio.create_task(off.run(100, slow, "b"))
        await asyncio.sleep(0.02)
        t0 = loop.time()
        await asyncio.sleep(0.01)  # the loop still turns while both wait on the thread
        assert loop.time() - t0 < 0.1
        with pytest.raises(QueueFullError):
            await off.run(100, slow, "c")  # a third large input past the bound: 429
        assert await off.run(5, str.upper, "small") == "SMALL"  # small inputs stay on the loop, unbounded
        assert await asyncio.gather(first, second) == ["a", "b"]
        assert off.waiting == 0

    asyncio.run(scenario())


@pytest.mark.served
def test_internal_errors_reach_the_client_as_an_id_and_the_log_as_details(tiny_model_factory, caplog):
    from starlette.testclient import TestClient

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("dead-tiny")), device="cpu", dtype="float32",
                              max_model_len=64, kv_cache_memory_bytes=16 * 8192)
    llm = AsyncLLM(LLMEngine(cfg))
    serving = OpenAIServing(llm, "tiny")

    def broken(*args, **kwargs):
        raise KeyError("secret internal state at 0xdeadbeef")

    with TestClient(create_app(lambda: serving), raise_server_exceptions=False) as tc:
        serving.detokenize = broken
        with caplog.at_level("ERROR"):
            r = tc.post("/detokenize", json={"tokens": [1]})
        err = r.json()["error"]
        assert r.status_code == 500 and err["type"] == "server_error"
        assert "0xdeadbeef" not in err["message"] and "KeyError" not in err["message"]
        ref = err["message"].split("request ")[1].split(";")[0]
        assert any(ref in rec.getMessage() and "0xdeadbeef" in (rec.exc_text or "") for rec in caplog.records)

        def dead_step():
            raise RuntimeError("CUDA error: an illegal memory access at 0xdeadbeef")

        llm.engine.step = dead_step
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and "0xdeadbeef" not in r.text and "RuntimeError" not in r.text
    llm.shutdown()


@pytest.mark.engine
def test_resolving_a_config_builds_nothing(tiny_model_factory, monkeypatch):
    """The attention backend is chosen once, when the config resolves, and built where the
    engine builds its model (AttentionBackend.load), never while resolving a config."""
    from torch.utils import cpp_extension

    from engine.config import EngineConfig, Placement
    from engine.models import loader
    from kernels import cpu

    def no_build(*args, **kwargs):
        raise AssertionError("a build while resolving the config")

    monkeypatch.setattr(cpu, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_build)
    hf_config = loader.load_config(loader.resolve(str(tiny_model_factory("dead-tiny"))))
    placement = Placement.resolve(EngineConfig.create(device="cpu", attention_backend="auto"), hf_config)
    assert placement.attention_backend.name == "native" and cpu._state == {}
    monkeypatch.undo()
    assert placement.attention_backend.load().name in ("native", "torch")
