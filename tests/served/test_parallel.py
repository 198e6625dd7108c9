"""`bentoml serve` with the tensor-parallel preset (config/cpu-tp2.yaml): it answers as one
process does, and when a worker process is killed mid-run every running request fails
with an engine error within 30 seconds and /health turns 503, instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from engine import LLM, SamplingParams
from tests.support.server import serving
from tests.support.server import KEY, MODEL, ROOT

pytestmark = pytest.mark.timeout(600)
STREAMS = 8
PROMPT = "The three primary colours are"


def parallel_workers(root_pid: int) -> list[psutil.Process]:
    """Worker ranks: multiprocessing children of the engine process, itself such a child."""
    found = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()) and "spawn_main" in " ".join(p.parent().cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def test_tp2_preset_serves_and_a_killed_worker_fails_requests_fast(bento_home, tmp_path):
    want = LLM(None, dtype="float32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                                               use_tqdm=False)[0].outputs[0].text
    preset = (ROOT / "config/cpu-tp2.yaml").read_text().replace("dtype: auto", "dtype: float32")
    with serving(bento_home, tmp_path, preset) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        workers = parallel_workers(srv.proc.pid)
        assert len(workers) == 1, [w.cmdline() for w in workers]

        started = threading.Semaphore(0)
        results: list = [None] * STREAMS

        def stream(i: int) -> None:
            try:
                chunks = client.completions.create(model=MODEL, prompt=f"Story {i}:", max_tokens=2000,
                                                   temperature=0, stream=True, extra_body={"ignore_eos": True})
                for n, _ in enumerate(chunks):
                    if n == 0:
                        started.release()
                results[i] = "finished"
            except Exception as exc:  # noqa: BLE001 - what the client sees is the point
                results[i] = (time.monotonic(), exc)
                started.release()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in range(STREAMS):
            assert started.acquire(timeout=120)
        killed = time.monotonic()
        os.kill(workers[0].pid, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a stream hung after its worker died"
        for r in results:
            assert isinstance(r, tuple), r
            at, exc = r
            assert at - killed < 30
            assert isinstance(exc, openai.APIError)
            assert "engine" in str(exc).lower()

        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{srv.url}/health", headers=headers, timeout=10).status_code == 503
        r = httpx.post(f"{srv.url}/v1/completions", headers=headers, timeout=30,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error"
