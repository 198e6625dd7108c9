"""A live `bentoml serve` with two API keys: each key a tenant that cannot see the other's
stored responses or prefix-cache hits; a bystander that still gets its answer while
hostile requests of every kind are in flight; and /livez turning false while the engine
core is stopped dead (SIGSTOP), true again once it resumes."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import MODEL

pytestmark = pytest.mark.timeout(900)

ALICE, BOB = "alice-key-1", "bob-key-2"
PRESET = """
engine:
  device: cpu
  dtype: float32
  max_num_seqs: 16
  max_num_batched_tokens: 512
  max_model_len: 512
  kv_cache_memory_bytes: 94371840
  grammar_compile_timeout_s: 5
service:
  served_model_name: SmolLM2-135M-Instruct
  model_tag: smollm2-135m-instruct
  core_stall_timeout_s: 3
  responses_store: {max_responses_per_key: 3}
"""
# About 200 tokens: twelve whole blocks of 16 to hit in the prefix cache.
SYSTEM = " ".join(f"Rule {i}: answer politely and cite the handbook section {i}." for i in range(20))


@pytest.fixture(scope="module")
def srv(bento_home, tmp_path_factory):
    from tests.support.server import serving

    with serving(bento_home, tmp_path_factory.mktemp("tenants"), PRESET, f"{ALICE},{BOB}") as s:
        yield s


def client(srv, key: str) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_a_tenant_cannot_read_continue_delete_or_evict_anothers_responses(srv):
    with client(srv, ALICE) as alice, client(srv, BOB) as bob:
        made = alice.post("/v1/responses", json={"model": MODEL, "input": "Say hi.", "max_output_tokens": 4})
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        assert alice.get(f"/v1/responses/{rid}").status_code == 200
        assert bob.get(f"/v1/responses/{rid}").status_code == 404
        follow = bob.post("/v1/responses", json={"model": MODEL, "input": "And?", "max_output_tokens": 2,
                                                 "previous_response_id": rid})
        assert follow.status_code == 404 and follow.json()["error"]["param"] == "previous_response_id"
        assert bob.delete(f"/v1/responses/{rid}").status_code == 404
        for _ in range(5):  # past bob's share of 3: bob's own oldest go, never alice's
            assert bob.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 1}
                            ).status_code == 200
        assert alice.get(f"/v1/responses/{rid}").status_code == 200
        cont = alice.post("/v1/responses", json={"model": MODEL, "input": "And?", "max_output_tokens": 2,
                                                 "previous_response_id": rid})
        assert cont.status_code == 200, cont.text
        assert alice.delete(f"/v1/responses/{rid}").status_code == 200


def cached(c: httpx.Client, salt: str | None = None) -> int:
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
            "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_sees_no_prefix_cache_hits_from_anothers_prompts(srv):
    with client(srv, ALICE) as alice, client(srv, BOB) as bob:
        cached(alice)
        assert cached(alice) >= 160  # the same tenant hits its own blocks
        assert cached(bob) == 0  # the other key, the same prompt: no hit to confirm it by
        assert cached(bob) >= 160
        assert cached(alice, salt="mine") == 0  # a client's own salt splits its cache further


def hostile_requests() -> list[tuple[str, dict | bytes]]:
    """One of each kind the defects issue names; each is refused or served, none may hold
    the bystander up."""
    slow_schema = json.dumps({"type": "object",
                              "properties": {f"p{i}": {"type": "string"} for i in range(1200)}})
    long_key = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1,
                           "metadata": {"k" * 200_000: [0] * 300_000}}).encode()
    return [
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                             "structured_outputs": {"json": slow_schema}}),
        ("/v1/completions", {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 32, "ignore_eos": True,
                             "stop": [f"never-{i:03d}" + "q" * 40 for i in range(256)],
                             "bad_words": [f"zq{i}x" for i in range(1024)],
                             "stop_token_ids": list(range(40000, 41024))}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 1e-45, "max_tokens": 8}),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi"] * 4096, "max_tokens": 1}),
        ("/v1/completions", long_key),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                  "chat_template_kwargs": {"padding": "max_length", "max_length": 200_000_000}}),
        ("/tokenize", {"model": MODEL, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": json.dumps({"x": "y" * 2_000_000})}}]}]}),
        ("/detokenize", {"model": MODEL, "tokens": [42] * 500_000}),
    ]


def test_a_bystander_is_answered_while_hostile_requests_are_in_flight(srv):
    with client(srv, ALICE) as alice, client(srv, BOB) as bob:
        def send(route: str, body: dict | bytes) -> int:
            if isinstance(body, bytes):
                return bob.post(route, content=body, headers={"Content-Type": "application/json"}).status_code
            return bob.post(route, json=body).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            hostile = [pool.submit(send, route, body) for route, body in hostile_requests()]
            time.sleep(0.5)  # every one of them arrived and is being parsed, compiled or run
            start = time.monotonic()
            r = alice.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 8, "messages": [
                {"role": "user", "content": "What is the capital of France?"}]})
            waited = time.monotonic() - start
            statuses = [f.result() for f in hostile]
    assert r.status_code == 200, r.text
    assert waited < 10, waited  # a stall shows as minutes; a shared CPU as a few seconds
    assert all(s < 500 for s in statuses), statuses
    assert statuses[2] == 200  # the vanishing temperature is greedy, not a dead engine
    with client(srv, ALICE) as alice:
        assert alice.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
                          ).status_code == 200


def engine_pid(server_pid: int) -> int:
    """The engine core: the process under the server that multiprocessing spawned."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, found = [server_pid], []
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            todo.append(child)
            try:
                if b"spawn_main" in (Path("/proc") / str(child) / "cmdline").read_bytes():
                    found.append(child)
            except OSError:
                pass
    assert len(found) == 1, found
    return found[0]


def test_livez_turns_false_while_the_core_is_stalled(srv):
    pid = engine_pid(srv.proc.pid)
    assert httpx.get(f"{srv.url}/livez", timeout=5).status_code == 200
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while httpx.get(f"{srv.url}/livez", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "/livez stayed 200 with the core stopped"
            time.sleep(0.5)
        assert httpx.get(f"{srv.url}/health", timeout=5).json()["status"] == "engine stalled"
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while httpx.get(f"{srv.url}/livez", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "/livez did not recover once the core resumed"
        time.sleep(0.5)
