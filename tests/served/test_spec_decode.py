"""`speculative_config` in a preset under `bentoml serve` (config/cpu-ngram.yaml's)."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from engine import LLM, SamplingParams
from tests.support.server import serving
from tests.support.server import KEY, MODEL, PRESET, ROOT

pytestmark = pytest.mark.timeout(600)

PROMPT = ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, oranges, figs, dates. "
          "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, oranges, figs, dates. "
          "Copy this list exactly:")


def test_the_ngram_preset_streams_several_tokens_per_event(bento_home, tmp_path):
    """A streamed answer that quotes its prompt comes in events of several tokens where drafts
    were accepted, with the text speculation-off greedy gives; /stats and /metrics show it."""
    # the test server's preset (a small pool, so it starts fast) with cpu-ngram.yaml's speculation
    spec = yaml.safe_load((ROOT / "config/cpu-ngram.yaml").read_text())["engine"]["speculative_config"]
    assert spec["method"] == "ngram"
    preset = PRESET.replace("  dtype: float32\n", f"  dtype: float32\n  speculative_config: {json.dumps(spec)}\n")
    headers = {"Authorization": f"Bearer {KEY}"}
    with serving(bento_home, tmp_path, preset) as srv:
        sizes, text = [], ""
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True, "logprobs": 0}
        with httpx.stream("POST", f"{srv.url}/v1/completions", headers=headers, json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    if choice["logprobs"]:
                        sizes.append(len(choice["logprobs"]["tokens"]))
        stats = httpx.get(f"{srv.url}/stats", headers=headers).json()
        metrics = httpx.get(f"{srv.url}/metrics", headers=headers).text
    # after the server: an engine stepped here pins this thread, and the server would inherit its one core
    want = LLM(None, dtype="float32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=40),
                                               use_tqdm=False)[0].outputs[0].text
    assert text == want
    assert sum(sizes) == 40 and max(sizes) > 1 and len(sizes) < 40
    assert stats["spec_method"] == "ngram" and stats["spec_num_accepted_tokens"] > 0
    accepted = [line for line in metrics.splitlines()
                if line.startswith("vllm:spec_decode_num_accepted_tokens_total{")]
    assert accepted and float(accepted[0].split()[-1]) == stats["spec_num_accepted_tokens"]
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in metrics
