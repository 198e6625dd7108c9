"""`quantization: gguf` through the service: the import keeps the GGUF beside the weights."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_the_service_serves_the_imported_gguf_blocks(bento_home, tmp_path):
    """`bentoml serve` with `quantization: gguf` on the model the store holds (the import
    keeps the GGUF beside the weights): /v1/models and /stats say so, and a greedy answer
    is the offline fp32 one."""
    import httpx

    from tests.support.server import serving
    from tests.support.server import KEY, MODEL, PRESET

    preset = PRESET.replace("  dtype: float32\n", "  dtype: float32\n  quantization: gguf\n")
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(bento_home, tmp_path, preset) as srv:
        card = httpx.get(f"{srv.url}/v1/models", headers=headers).json()["data"][0]
        stats = httpx.get(f"{srv.url}/stats", headers=headers).json()
        r = httpx.post(f"{srv.url}/v1/completions", headers=headers, timeout=120,
                       json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16,
                             "temperature": 0})
    assert card["quantization"] == "gguf"
    assert stats["quantization"] == "gguf" and stats["weight_bytes"] < 100e6
    want = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20).generate(["The capital of France is"],
                                               SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0].outputs[0].text
