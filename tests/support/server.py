"""The live server the served tier shares: `bentoml serve` of the embedded model from a
private BentoML home, with an API key and a small KV pool, started once per session
(tests/conftest.py holds the fixtures), and `serving()`, which starts one with any preset."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
KEY = "test-key-123"
MODEL = "SmolLM2-135M-Instruct"
MODEL_TAG = "smollm2-135m-instruct"
HF_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

# The suite's long-lived clients open a connection per request. A kept-alive one, idle for
# the server's keep-alive timeout (5 s), can be closed by the server just as the client
# reuses it: "Server disconnected without sending a response", which the clients (with
# max_retries=0, so that every answer is the server's own) would report as a failure.
NO_KEEPALIVE = httpx.Limits(max_keepalive_connections=0)

# Small pool: 128 blocks of 16 tokens, so leaks show and the server starts fast.
PRESET = """
engine:
  device: cpu
  dtype: float32
  max_num_seqs: 32
  max_num_batched_tokens: 512
  max_model_len: 512
  kv_cache_memory_bytes: 94371840
  pooler: {pooling_type: mean}
  scorer:
    classifier_from_token: ["no", "yes"]
    template: "Query: {query}\\nDocument: {document}\\nDoes the document answer the query? Answer yes or no: "
service:
  served_model_name: SmolLM2-135M-Instruct
  model_tag: smollm2-135m-instruct
  queue: {max_waiting_requests: 56, max_waiting_tokens: 16384}  # the soak's opening burst of 64 passes it
  traffic: {timeout: 300, concurrency: 96}
  cors: {allow_origins: ["https://app.example"]}
"""
ORIGIN = "https://app.example"


def offline_env(home: Path) -> dict[str, str]:
    """A private BentoML home, and any attempt to reach the network fails fast."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    dead = "http://127.0.0.1:9"
    env.update(BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="True", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PIP_NO_INDEX="1", HTTP_PROXY=dead, HTTPS_PROXY=dead,
               ALL_PROXY=dead, NO_PROXY="127.0.0.1,localhost", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.pop("PAGEDSERVE_CONFIG", None)
    env.pop("LLM_API_KEY", None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_llm(path: Path, chat_template: str):
    """An AsyncLLM over a tiny random model (tests/support/tiny_models.py) given this
    chat template, its engine stepped on a thread: for serving a template's formats in-process."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.client.async_llm import AsyncLLM

    (path / "chat_template.jinja").write_text(chat_template)
    cfg = EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_model_len=512,
                              kv_cache_memory_bytes=64 * 8192)
    return AsyncLLM(LLMEngine(cfg))


def literal_regex(text: str) -> str:
    """A regex matching exactly `text`: a grammar that makes a random model write it."""
    special = set("\\.^$|?*+()[]{}/")
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in special else ch for ch in text)


@contextlib.contextmanager
def serving(bento_home: Path, tmp: Path, preset: str = PRESET, api_key: str = KEY):
    """`bentoml serve` with this preset, in its own process group, until the block ends.
    `api_key` is $LLM_API_KEY: one key, or several separated by commas."""
    (tmp / "preset.yaml").write_text(preset)
    # Each server gets a BentoML home of its own that shares the model store: `bentoml serve`
    # empties its home's prometheus_multiproc_dir at start, which blanked the counters of a
    # server already running on that home (the session server's /metrics froze).
    home = tmp / "bentoml_home"
    home.mkdir(exist_ok=True)
    if not (home / "models").exists():
        (home / "models").symlink_to(bento_home / "models", target_is_directory=True)
    port = free_port()
    env = {**offline_env(home), "PAGEDSERVE_CONFIG": str(tmp / "preset.yaml"), "LLM_API_KEY": api_key}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([str(BIN / "bentoml"), "serve", "service:LLMService", "--host", "127.0.0.1",
                             "--port", str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "server did not get ready:\n" + (tmp / "server.log").read_text()[-5000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield SimpleNamespace(url=url, log=tmp / "server.log", proc=proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group, nothing else
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
