"""`bentoml serve` with config/gemma3-270m.yaml continues a text as the offline API does."""

from __future__ import annotations

import httpx
import pytest
import yaml

from engine import LLM, SamplingParams
from engine.models import packaged
from tests.support.prompts import SENTENCES
from tests.support.server import serving
from tests.support.server import KEY, ROOT

TAG = packaged.GEMMA3_270M_TAG


@pytest.mark.timeout(600)
def test_the_gemma_preset_serves_completions_as_the_offline_api_gives(bento_home, tmp_path):
    preset = yaml.safe_load((ROOT / "config/gemma3-270m.yaml").read_text())
    assert preset["service"]["model_tag"] == TAG and preset["engine"]["model"] is None
    # The preset with a small KV pool and fp32, so that it starts fast and the tokens are the offline API's.
    preset["engine"].update(dtype="float32", kv_cache_memory_bytes=96 << 20, max_model_len=2048)
    text = " ".join(SENTENCES[:3])
    with serving(bento_home, tmp_path, yaml.safe_dump(preset)) as srv:
        headers = {"Authorization": f"Bearer {KEY}"}
        models = httpx.get(f"{srv.url}/v1/models", headers=headers).json()
        body = {"model": "gemma-3-270m", "prompt": text, "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", headers=headers, json=body, timeout=300)
    assert [m["id"] for m in models["data"]][0] == "gemma-3-270m"
    assert r.status_code == 200, r.text
    want = LLM(TAG, dtype="float32", max_model_len=2048).generate(
        text, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want
