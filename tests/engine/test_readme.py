"""The README's Python snippets as a new user runs them: each saved to its own file and
run with `python file.py`, with no `if __name__ == "__main__":` guard, as vLLM's offline
examples have none. The engine's child processes (parallel workers, the engine process
of AsyncLLM.start) must not run the user's script again, and a CPU run prints nothing
of Triton or its bindings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.support.server import ROOT

pytestmark = pytest.mark.timeout(600)

SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)

ASYNC = textwrap.dedent("""
    import asyncio
    from engine import EngineConfig, SamplingParams
    from engine.client.async_llm import AsyncLLM

    llm = AsyncLLM.start(EngineConfig(max_model_len=256, kv_cache_memory_bytes=32 << 20))

    async def main():
        async for out in llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8)):
            print(out.deltas[0].text, end="")

    asyncio.run(main())
    llm.shutdown()
""")


def run_as_file(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=500)


def noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.search(r"nanobind|leaked|triton", line, re.I)]


def test_the_readme_has_the_snippets_this_file_runs():
    assert len(SNIPPETS) >= 2 and any("tensor_parallel_size=2" in s for s in SNIPPETS)


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_each_readme_snippet_runs_as_a_script(tmp_path, index):
    out = run_as_file(tmp_path, SNIPPETS[index])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout or "EngineStats" in out.stdout, out.stdout
    assert noise(out.stderr) == [], out.stderr[-3000:]


def test_an_async_engine_process_started_without_a_main_guard(tmp_path):
    out = run_as_file(tmp_path, ASYNC)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Paris" in out.stdout
    assert noise(out.stderr) == [], out.stderr[-3000:]


def test_an_engine_process_started_after_an_offline_run_gets_every_core(tiny_model_factory):
    """The offline engine pins the thread that steps it; an engine process started from that
    thread afterwards must still get the whole CPU set, not the one core it inherits."""
    import multiprocessing as mp

    from engine import LLM, SamplingParams
    from engine import spawn

    before = os.sched_getaffinity(0)
    llm = LLM(str(tiny_model_factory("pin-tiny")), device="cpu", dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=8 << 20)
    llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_report_cpus, args=(child,))
    spawn.start(proc)
    assert parent.recv() == before
    proc.join(30)


def _report_cpus(conn) -> None:
    conn.send(os.sched_getaffinity(0))
