"""Shared fixtures (the embedded model, the transformers oracle, tiny random models, the
session's live server) and each test's tier, which is its folder. Helpers the tiers share
are in tests/support."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.server import KEY, NO_KEEPALIVE, ROOT, offline_env, serving
from tests.support.tiny_models import build_tiny_model


TIERS = ("unit", "engine", "served", "gpu")
TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items) -> None:
    """A test's tier is its folder: tests/unit (no model is built), tests/engine (builds
    engines in this process or its children), tests/served (a live server or the ASGI app)
    and tests/gpu (a CUDA device; skipped without one, scripts/gpu_check.sh runs it). Each
    is marked with its tier, so `pytest -m unit` and `pytest tests/unit` are the same run,
    and the four together are the whole suite."""
    for item in items:
        folder = Path(item.path).resolve().relative_to(TESTS).parts[0]
        if folder not in TIERS:
            raise pytest.UsageError(f"{item.nodeid} is outside the tier folders {TIERS}")
        item.add_marker(getattr(pytest.mark, folder))
    # tests/served/test_drain.py stops the session's server (SIGTERM, then checks it drained): last.
    items.sort(key=lambda item: Path(item.path).name == "test_drain.py")


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


# -- the live server (tests/support/server.py) -------------------------------------------------------
@pytest.fixture(scope="session")
def bento_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("bentoml_home")
    out = subprocess.run([sys.executable, "scripts/import_model.py", "--if-missing"], cwd=ROOT,
                         env=offline_env(home), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return home


@pytest.fixture(scope="session")
def server(bento_home, tmp_path_factory):
    with serving(bento_home, tmp_path_factory.mktemp("serve")) as srv:
        yield srv


@pytest.fixture(scope="session")
def client(server):
    import openai  # here, not at the top: the gpu tier runs where the serving clients are not installed

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=180,
                         http_client=httpx.Client(timeout=180, limits=NO_KEEPALIVE))


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=180,
                      limits=NO_KEEPALIVE) as c:
        yield c
