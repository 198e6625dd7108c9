"""The HTTP app in-process: what /health and the routes say about a dead engine, errors
after a stream's headers, the model's generation defaults, and internal errors.

The end-to-end tests (tests/served/test_service.py) run a real server with a healthy
engine and a key set; these cover the states that server cannot show honestly."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


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
