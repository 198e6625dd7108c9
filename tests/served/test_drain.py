"""Graceful drain: SIGTERM to `bentoml serve` (as Kubernetes sends it, to the main process
only) while 16 streams run. The streams finish whole, new requests meanwhile get 503 with
OpenAI's error object, readiness turns false, and the server exits 0.

It drains the session's own server, after every other test has used it (conftest.py runs
this file last): a server that has served the whole suite must still stop cleanly, and no
second server is started for it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support.server import KEY, MODEL

pytestmark = pytest.mark.timeout(600)
STREAMS, TOKENS = 16, 96


def test_sigterm_lets_running_streams_finish_refuses_new_ones_and_exits_zero(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    first = threading.Semaphore(0)
    results: list = [None] * STREAMS

    def stream(i: int) -> None:
        try:
            chunks = client.completions.create(
                model=MODEL, prompt=f"Story number {i}:", max_tokens=TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            seen, finish, usage = False, None, None
            for ch in chunks:
                if not seen:
                    seen = True
                    first.release()
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                usage = ch.usage or usage
            results[i] = (finish, usage.completion_tokens if usage else None)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc
            first.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):
        assert first.acquire(timeout=180)
    os.kill(server.proc.pid, signal.SIGTERM)

    headers = {"Authorization": f"Bearer {KEY}"}
    refused, deadline = None, time.monotonic() + 15
    while refused is None and time.monotonic() < deadline:
        r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        if r.status_code == 503:
            refused = r
        time.sleep(0.2)
    assert refused is not None, "no request was refused while draining"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code != 200
    alive_while_draining = any(t.is_alive() for t in threads)

    for t in threads:
        t.join(240)
    assert results == [("length", TOKENS)] * STREAMS, results
    assert alive_while_draining  # the refusals came while streams were still running
    assert server.proc.wait(120) == 0, server.log.read_text()[-3000:]
