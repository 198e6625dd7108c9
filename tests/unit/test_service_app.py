"""The HTTP plumbing without a model: the API-key middleware and its tenants, the body
guards and deadlines on typed routes, and large tokenizer work kept off the event loop."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


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


@pytest.mark.parametrize("raw", ["", "   ", " , ,"])
def test_a_key_variable_holding_no_key_stops_the_server(monkeypatch, raw):
    """Read as "no keys", an empty LLM_API_KEY served every caller unauthenticated."""
    from engine.serving.middleware import APIKeyMiddleware

    monkeypatch.setenv("LLM_API_KEY", raw)
    with pytest.raises(ValueError, match="holds no key"):
        APIKeyMiddleware(lambda scope, receive, send: None)


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


def test_large_tokenizer_work_leaves_the_event_loop_and_is_bounded():
    import asyncio
    import threading

    from engine.client.admission import Offload, QueueFullError

    async def scenario():
        off = Offload(workers=1, max_waiting=2, threshold=10)
        started, release = threading.Event(), threading.Event()

        def slow(x):  # a chat template over a large body, say: held until the test lets it go
            started.set()
            assert release.wait(30)
            return x

        first = asyncio.create_task(off.run(100, slow, "a"))
        second = asyncio.create_task(off.run(100, slow, "b"))
        # The loop still turns while the work holds its thread: it waits for the work to start.
        while not started.is_set():
            await asyncio.sleep(0)
        assert off.waiting == 2 and not first.done()
        with pytest.raises(QueueFullError):
            await off.run(100, slow, "c")  # a third large input past the bound: 429
        assert await off.run(5, str.upper, "small") == "SMALL"  # small inputs stay on the loop, unbounded
        release.set()
        assert await asyncio.gather(first, second) == ["a", "b"]
        assert off.waiting == 0

    asyncio.run(scenario())
