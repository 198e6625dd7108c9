"""End to end: `bentoml serve` on a free loopback port, driven by the real openai client.

One server for the whole session (tests/support/server.py; model load dominates), started the way `make serve`
starts it: scripts/import_model.py puts the embedded model into a private BentoML
store, then the service loads it from there through bentoml.models.BentoModel. The
server runs with LLM_API_KEY set, as a deployment would; the 401 tests drop the key.
The same store then feeds the offline `bentoml build` test.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess
import sys
import tarfile
import time
from http import HTTPStatus

import httpx
import openai
import pytest

from tests.support.server import BIN, CHAT, HF_ID, KEY, MODEL, MODEL_TAG, ORIGIN, ROOT, offline_env

pytestmark = pytest.mark.timeout(600)


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics as {'name{labels}': value}, labels sorted as prometheus prints them."""
    text = http.get("/metrics").text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def metric(m: dict[str, float], name: str, **labels: str) -> float:
    want = {"model_name": MODEL, **labels}
    total = 0.0
    for key, value in m.items():
        base, _, rest = key.partition("{")
        got = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        if base == name and all(got.get(k) == v for k, v in want.items()):
            total += value
    return total


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/stats").json()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats


# -- the happy paths ---------------------------------------------------------------------
def test_models_health_and_chat(client, http):
    # the model also answers to its Hugging Face id, as clients configured for the Hub name it
    assert [m.id for m in client.models.list().data] == [MODEL, HF_ID]
    assert client.models.retrieve(MODEL).id == MODEL and client.models.retrieve(HF_ID).id == HF_ID
    by_id = client.completions.create(model=HF_ID, prompt="Hello", max_tokens=2)
    assert by_id.model == MODEL and by_id.usage.completion_tokens >= 1
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"].startswith(f"{MODEL_TAG}:") and card["max_model_len"] == 512  # from the model store
    assert http.get("/health").status_code == 200
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    prompt = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    assert resp.usage.prompt_tokens == prompt["count"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_streams_the_same_text_with_usage(client, http):
    kw = dict(model=MODEL, prompt="The three primary colours are", max_tokens=12, temperature=0)
    full = client.completions.create(**kw, logprobs=2)
    choice = full.choices[0]
    assert choice.text and len(choice.logprobs.tokens) == full.usage.completion_tokens
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    ids = http.post("/tokenize", json={"prompt": choice.text, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == choice.text


def test_chat_stream_matches_and_ends_with_done(client, server):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The SDK hides the terminator; check the wire format once, without the usage chunk.
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**kw, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e.removeprefix("data: "))["usage"] is None for e in events[:-1])


def test_n2_seed_reproducibility_and_logprobs(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
              temperature=1.0, n=2, logprobs=True, top_logprobs=2)
    a = client.chat.completions.create(**kw, seed=1234)
    b = client.chat.completions.create(**kw, seed=1234)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for c in a.choices:
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)
    texts = {tuple(c.text for c in client.completions.create(model=MODEL, prompt="Once upon a time", n=2,
                                                                 max_tokens=10, temperature=1.0, seed=s).choices)
             for s in (1, 2, 3)}
    assert len(texts) > 1  # different seeds, different samples


def test_stop_string_cuts_the_text(client):
    kw = dict(model=MODEL, prompt="Count: one, two, three, four, five,", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[4:7]
    assert stop.strip(), full
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_typed_bentoml_client(server, client):
    import bentoml

    prompt = "The capital of Italy is"
    ref = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    with bentoml.SyncHTTPClient(server.url, token=KEY, timeout=120) as typed:
        assert "".join(typed.generate(prompt=prompt, max_tokens=8)) == ref
        assert "Paris" in "".join(typed.chat(messages=CHAT, max_tokens=16))
        with pytest.raises(bentoml.exceptions.BentoMLException) as err:
            list(typed.generate(prompt=prompt, max_tokens=10_000))
        assert err.value.error_code == HTTPStatus.BAD_REQUEST and "max_tokens" in str(err.value)


# -- bad input -----------------------------------------------------------------------------
LONG = "word " * 600  # > max_model_len (512) tokens
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BAD = [
    ("chat", {"model": MODEL, "messages": CHAT, "max_tokens": "lots"}, "max_tokens"),
    # types are strict, as OpenAI documents: no quiet coercion of strings or floats
    ("chat", {"model": MODEL, "messages": CHAT, "max_tokens": "12"}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "hi", "n": 2.0}, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "stream": "true"}, "stream"),
    # fields we know and cannot honour (unknown ones: tests/served/test_leniency.py)
    ("chat", {"model": MODEL, "messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"model": MODEL, "messages": CHAT, "web_search_options": {}}, "web_search_options"),
    ("chat", {"model": MODEL, "messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("chat", {"model": MODEL, "messages": CHAT, "logit_bias": {"49152": 5}}, "logit_bias"),  # past the vocab
    ("chat", {"model": MODEL, "messages": CHAT, "logit_bias": {"10": 101}}, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"ten": 1}}, "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("chat", {"model": MODEL, "messages": "hello"}, "messages"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"model": MODEL, "prompt": 42}, "prompt"),
    ("chat", b'{"model": "SmolLM2-135M-Instruct", "messages": [', None),
    ("chat", {"model": MODEL, "messages": CHAT, "temperature": -0.5}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("chat", {"model": MODEL, "messages": CHAT, "top_p": 0}, "top_p"),
    ("completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("chat", {"model": MODEL, "messages": CHAT, "n": 0}, "n"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("chat", {"model": MODEL, "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": LONG}, "prompt"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("completions", {"model": MODEL, "prompt": LONG, "stream": True}, "prompt"),
    ("chat", {"model": MODEL, "messages": []}, "messages"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    # tools: a choice naming a function that is not offered, a call whose arguments are not JSON
    ("chat", {"model": MODEL, "messages": CHAT, "tools": [TOOL], "tool_choice": {
        "type": "function", "function": {"name": "launch_rocket"}}}, "tool_choice"),
    ("chat", {"model": MODEL, "messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    ("chat", {"model": MODEL, "messages": CHAT + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{city"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("chat", {"model": MODEL, "messages": CHAT + [{"role": "tool", "content": "12:00"}]}, "messages[1].tool_call_id"),
    ("chat", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}],
        "tool_choice": "required"}, "tools"),
    # beam search with what it cannot honour, and its fields without it
    ("chat", {"model": MODEL, "messages": CHAT, "n": 2, "use_beam_search": True, "temperature": 0.8}, "temperature"),
    ("chat", {"model": MODEL, "messages": CHAT, "use_beam_search": True, "logprobs": True}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "hi", "use_beam_search": True, "logprobs": 1}, "logprobs"),
    ("chat", {"model": MODEL, "messages": CHAT, "use_beam_search": True,
              "response_format": {"type": "json_object"}}, "response_format"),
    ("completions", {"model": MODEL, "prompt": "hi", "length_penalty": 0.5}, "length_penalty"),
]


@pytest.mark.parametrize(("route", "body", "param"), BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_bad_input_is_a_400_with_openai_error(http, route, body, param):
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_an_unknown_model_is_a_404_model_not_found(client, http):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


def test_advisory_fields_are_accepted(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, user="u-1",
                                       metadata={"team": "a"}, store=False)
    assert r.usage.completion_tokens >= 1


def test_logit_bias_and_allowed_token_ids_steer_every_token(client, http):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logit_bias={"1000": 100}, logprobs=1, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [http.post("/detokenize", json={"tokens": [1000]}).json()["prompt"]] * 6
    allowed = [1000, 2000, 3000]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1,
                                  logprobs=1, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    words = {http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in allowed}
    assert set(r.choices[0].logprobs.tokens) <= words and len(r.choices[0].logprobs.tokens) == 8


def test_usage_reports_cached_prompt_tokens_and_streams_continuously(client):
    long_prompt = "The history of the printing press begins in the fifteenth century. " * 8
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one whole block
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True,
                                                            "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted and all(b >= a for a, b in zip(counted, counted[1:])) and counted[-1] == 4


def test_bad_input_leaves_no_trace(client, http):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert exc.value.body["param"] == "temperature"
    stats = wait_idle(http)
    assert stats["blocks_free"] == stats["blocks_total"]
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3).usage.completion_tokens >= 1


def test_api_key_is_required_on_v1(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(f"{server.url}/generate", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_tokenizer_routes_need_the_key_too(server):
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        keyed = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200


def test_the_typed_routes_are_guarded_like_the_openai_ones(http):
    for path in ("/generate", "/chat"):
        for raw in (b'{"prompt": "hi", "max_tokens": NaN}', b'{"prompt": "\\udc00"}',
                    b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}"):
            r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (path, r.text)
    r = http.post("/generate", json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 400},
                  headers={"X-Request-Timeout": "0.5"})
    assert r.status_code in (200, 408) and len(r.text) < 400, r.text  # cut at the deadline, not 400 tokens


def test_a_browser_preflight_passes_and_the_request_it_announces_needs_the_key(server):
    """A real preflight, as a browser on an allowed origin sends it, against the real app."""
    asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=asks)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    denied = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    ok = httpx.post(f"{server.url}/v1/chat/completions", json=body,
                    headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}, timeout=120)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={**asks, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


# -- concurrency, disconnects and metrics -------------------------------------------------------
def test_sixteen_streams_one_disconnects(client, http):
    before = metrics(http)
    prompts = ["The sun is", "My favourite food is", "In the year 2000,"]
    kw = dict(model=MODEL, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    ref = {p: client.completions.create(prompt=p, **kw).choices[0].text for p in prompts}

    def stream(i: int) -> tuple[str, str, str | None, int]:
        p = prompts[i % 3]
        chunks = client.completions.create(prompt=p, stream=True, stream_options={"include_usage": True}, **kw)
        text, reason, usage = "", None, -1
        for c in chunks:
            if c.choices:
                text += c.choices[0].text
                reason = c.choices[0].finish_reason or reason
            if c.usage:
                usage = c.usage.completion_tokens
        return p, text, reason, usage

    def quitter() -> int:
        chunks = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        seen = 0
        for _ in chunks:
            seen += 1
            if seen == 3:
                break
        chunks.close()  # hang up mid-stream
        return seen

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        gone = pool.submit(quitter)
        results = list(pool.map(stream, range(15)))
    assert gone.result() == 3
    for p, text, reason, usage in results:
        assert (text, reason, usage) == (ref[p], "length", 10)
    # The quitter asked for 400 tokens; if it were still running it would hold blocks for a long while.
    stats = wait_idle(http)
    assert stats["num_running"] == 0 and stats["blocks_free"] == stats["blocks_total"]
    after = metrics(http)
    assert metric(after, "vllm:request_success_total", finished_reason="abort") == \
        metric(before, "vllm:request_success_total", finished_reason="abort") + 1
    assert metric(after, "vllm:kv_cache_blocks_free") == metric(after, "vllm:kv_cache_blocks_total") == 128
    assert metric(after, "vllm:num_requests_running") == 0


def test_metrics_counters_move(client, http):
    before = metrics(http)
    for _ in range(2):  # the second sends a prompt the first left in the prefix cache
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
        wait_idle(http)
    after = metrics(http)
    for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert metric(after, name) > metric(before, name), name
    generated = "vllm:generation_tokens_total"
    assert metric(after, generated) - metric(before, generated) == 12
    hits = "vllm:prefix_cache_hits_total"
    assert metric(after, hits) - metric(before, hits) >= 16  # at least the prompt's first full block
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total"):
        assert any(k.startswith(name + "{") for k in after), name

    def mean(name: str) -> float:  # what vLLM's dashboard plots: rate(x_sum) / rate(x_count)
        grew = metric(after, name + "_count") - metric(before, name + "_count")
        return (metric(after, name + "_sum") - metric(before, name + "_sum")) / grew

    assert mean("vllm:request_generation_tokens") == 6
    prompt = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert mean("vllm:request_prompt_tokens") == prompt
    assert mean("vllm:iteration_tokens_total") >= 1
    for name in ("vllm:time_per_output_token_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert mean(name) > 0, name
    [info] = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert 'block_size="16"' in info and 'num_gpu_blocks="128"' in info and after[info] == 1
    assert any(k.startswith("bentoml_service_request_total{") for k in after)  # BentoML's own metrics too


# -- packaging -----------------------------------------------------------------------------------
def test_import_model_stores_an_hf_directory_once(bento_home, tiny_model_factory):
    src = tiny_model_factory("import-tiny")
    cmd = [sys.executable, "scripts/import_model.py", str(src), "--name", "tiny-import", "--served-name", "Tiny"]
    env = offline_env(bento_home)
    first = subprocess.run([*cmd, "--if-missing"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run([*cmd, "--if-missing"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to do" in again.stdout
    versions = list((bento_home / "models" / "tiny-import").glob("*/model.yaml"))
    assert len(versions) == 1
    stored = versions[0].parent
    assert (stored / "model.safetensors").stat().st_size == (src / "model.safetensors").stat().st_size
    assert (stored / "config.json").is_file() and (stored / "tokenizer.json").is_file()
    assert "served_model_name: Tiny" in versions[0].read_text()


def test_bento_build_is_offline_and_holds_model_kernels_and_config(bento_home, tmp_path):
    env = offline_env(bento_home)
    out = subprocess.run([str(BIN / "bentoml"), "build", ".", "--output", "tag"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    tag = re.search(r"__tag__:(\S+)", out.stdout).group(1)
    archive = tmp_path / "pagedserve.tar"  # plain tar: xz-compressing the weights takes minutes
    out = subprocess.run([str(BIN / "bentoml"), "export", tag, str(archive)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    with tarfile.open(archive) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        reqs = tar.extractfile("./env/python/requirements.txt").read().decode()
        bento_yaml = tar.extractfile("./bento.yaml").read().decode()
        sizes = {m.name.removeprefix("./"): m.size for m in tar.getmembers()}
    weights = [n for n in names if n.startswith(f"models/{MODEL_TAG}/") and n.endswith("model.safetensors")]
    assert weights and any(n.endswith("tokenizer.json") for n in names)
    # The embedded GGUF travels as itself; beside it only what stays dense (norms), not an
    # fp32 copy of its GEMM weights four times its size.
    [gguf] = [n for n in names if n.startswith(f"models/{MODEL_TAG}/") and n.endswith(".gguf")]
    assert sizes[weights[0]] < sizes[gguf] / 20
    for path in ("src/service.py", "src/engine/client/async_llm.py", "src/engine/serving/app.py", "src/engine/engine.py", "src/kernels/__init__.py",
                 "src/kernels/triton_attention.py", "src/kernels/csrc/paged_attention.cpp", "src/config/default.yaml", "src/config/gpu.yaml",
                 "env/docker/Dockerfile"):
        assert path in names, path
    assert not any(n.startswith(("src/tests/", "src/.venv/")) for n in names)
    assert "torch==2.13.0" in reqs.splitlines()
    assert f"tag: {MODEL_TAG}:" in bento_yaml
