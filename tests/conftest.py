"""Shared fixtures: the embedded model, the transformers oracle, and tiny random models."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.served import BIN, KEY, PRESET, ROOT, free_port, offline_env

SENTENCES = [
    "The old lighthouse keeper climbed the stairs every evening to light the lamp.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "In 1969, astronauts walked on the Moon for the first time.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The recipe calls for two cups of flour, one egg, and a pinch of salt.",
    "Quantum computers use qubits, which can exist in superpositions of states.",
    "She opened the letter slowly, afraid of what it might say.",
    "The stock market fell sharply after the central bank raised interest rates.",
    "Mount Everest is the highest mountain above sea level, at 8,849 metres.",
    "To install the package, run pip install followed by its name.",
    "The committee will meet on Tuesday to discuss the new budget proposal.",
    "Dolphins are highly intelligent marine mammals known for their playful behaviour.",
    "Once upon a time, in a kingdom far away, there lived a curious young princess.",
    "The French Revolution began in 1789 and transformed European politics.",
    "Water boils at 100 degrees Celsius at sea level.",
    "Please summarize the following article in three sentences.",
    "The train to Berlin departs from platform nine at half past seven.",
    "Machine learning models learn patterns from large amounts of data.",
    "He played the violin every morning before breakfast.",
    "The Amazon rainforest produces a significant share of the world's oxygen.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "Jupiter is the largest planet in our solar system.",
    "The museum's new exhibit features paintings from the Renaissance.",
    "Regular exercise improves both physical and mental health.",
    "Translate the following sentence into Spanish: the cat is on the table.",
    "The bridge was closed for repairs after the storm damaged its supports.",
    "Shakespeare wrote Hamlet around the year 1600.",
    "A balanced diet includes fruits, vegetables, proteins and whole grains.",
    "The detective examined the footprints near the window.",
    "Electric cars are becoming more popular as battery prices fall.",
    "What are the main differences between TCP and UDP?",
    "The orchestra tuned their instruments before the concert began.",
]


TIERS = ("unit", "engine", "served", "gpu")


def pytest_collection_modifyitems(config, items) -> None:
    """Every test is in exactly one tier, so `pytest -m unit` (no model is built), `-m
    engine` (builds engines in this process or its children), `-m served` (a live server
    or the ASGI app) and `-m gpu` (a CUDA device; skipped without one, scripts/gpu_check.sh
    runs it) together run the whole suite."""
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid} must be marked with exactly one of {TIERS}, has {sorted(tiers)}")
    # tests/test_drain.py stops the session's server (SIGTERM, then checks it drained): last.
    items.sort(key=lambda item: item.nodeid.startswith("tests/test_drain.py"))


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """count varied prompts of exactly `length` tokens, built from rotating sentences."""
    prompts = []
    for i in range(count):
        ids: list[int] = []
        j = 0
        while len(ids) < length:
            ids += tokenizer.encode(SENTENCES[(i + j) % len(SENTENCES)] + " ", add_special_tokens=False)
            j += 1
        prompts.append(ids[:length])
    return prompts


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded GGUF, dequantized once into an HF directory (shared by engine and oracle)."""
    from engine.models import loader

    return loader.resolve(None).path


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def build_tiny_model(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama in HF format, made offline from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = tokenizer_dir / name
        if src.is_file():
            shutil.copy(src, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, default_model_dir):
    made: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        if name not in made:
            made[name] = build_tiny_model(tmp_path_factory.mktemp(name), default_model_dir, **overrides)
        return made[name]

    return make


CPUS = os.sched_getaffinity(0)


@pytest.fixture(autouse=True, scope="session")
def _small_default_kv_pool():
    """An engine a test builds in this process without kv_cache_memory_bytes gets 512 MiB
    of KV rather than the CPU default of 2 GiB: zeroing 2 GiB took 0.6 s of each of the
    suite's ~100 engine builds, and no test here needs more (a leak shows sooner in a
    smaller pool). Engines in child processes keep the real default."""
    import engine.config

    saved = engine.config.CPU_KV_DEFAULT_BYTES
    engine.config.CPU_KV_DEFAULT_BYTES = 512 << 20
    yield
    engine.config.CPU_KV_DEFAULT_BYTES = saved


@pytest.fixture(autouse=True)
def _unpin_main_thread():
    """An offline LLM pins the thread that steps it (here pytest's) to one core, and every
    process started from that thread afterwards (a `bentoml serve`, a README script)
    would inherit that one core: each test starts from the CPU set the session had."""
    yield
    os.sched_setaffinity(0, CPUS)


# -- the live server (tests/served.py) -------------------------------------------------------
@pytest.fixture(scope="session")
def bento_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("bentoml_home")
    out = subprocess.run([sys.executable, "scripts/import_model.py", "--if-missing"], cwd=ROOT,
                         env=offline_env(home), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return home


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


@pytest.fixture(scope="session")
def server(bento_home, tmp_path_factory):
    with serving(bento_home, tmp_path_factory.mktemp("serve")) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    import openai  # here, not at the top: the gpu tier runs where the serving clients are not installed

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=180)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=180) as c:
        yield c
