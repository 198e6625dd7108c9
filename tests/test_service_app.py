"""service.py in-process: what /health and the routes say about a dead engine, and the key check.

The end-to-end tests (test_service.py) run a real server with a healthy engine and a
key set; these cover the two states that server cannot show honestly: an engine loop
that has died, and a deployment without LLM_API_KEY.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.timeout(300)


def test_health_and_routes_report_a_dead_engine(tiny_model_factory, tmp_path, monkeypatch):
    from starlette.testclient import TestClient

    monkeypatch.setenv("BENTOML_HOME", str(tmp_path))  # importing service looks in the model store

    import service
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("dead-tiny")), device="cpu", dtype="float32",
                              max_model_len=64, kv_cache_memory_bytes=16 * 8192)
    llm = AsyncLLM(LLMEngine(cfg))
    monkeypatch.setattr(service.openai_app.state, "service",
                        SimpleNamespace(llm=llm, serving=OpenAIServing(llm, "tiny")), raising=False)
    with TestClient(service.openai_app) as tc:
        assert tc.get("/health").status_code == 200

        def broken_step():
            raise RuntimeError("device lost")

        llm.engine.step = broken_step
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert tc.get("/health").status_code == 503
        assert tc.post("/v1/completions", json={"prompt": "hi"}).status_code == 503


def test_api_key_middleware_is_open_without_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv("BENTOML_HOME", str(tmp_path))
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    import service

    inner = Starlette(routes=[Route("/v1/models", lambda r: PlainTextResponse("ok")),
                              Route("/health", lambda r: PlainTextResponse("ok"))])
    monkeypatch.delenv("LLM_API_KEY", raising=False)
    assert TestClient(service.APIKeyMiddleware(inner)).get("/v1/models").status_code == 200
    monkeypatch.setenv("LLM_API_KEY", "k")
    locked = TestClient(service.APIKeyMiddleware(inner))
    assert locked.get("/v1/models").status_code == 401
    assert locked.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
    assert locked.get("/health").status_code == 200
