"""Start, wait for and stop the servers the benchmarks measure: ours, `vllm serve` and
llama.cpp's `llama-server`, each with every core of the machine.

scripts/bench_serving.py and scripts/bench_latency.py share these, so a peer is always
started the same way. Peers run from their own builds under the ignored .peers/ folder
(scripts/setup_vllm_peer.sh, scripts/peers/setup_llama_server.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"
LLAMA_SERVER = ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"
LLAMA_SERVER_AVX2 = ROOT / ".peers" / "llama.cpp" / "build-avx2" / "bin" / "llama-server"  # setup_llama_server.sh avx2


def all_cores() -> None:
    """For a server's process: our engine pinned the thread that stepped it (thread 0 of its
    OpenMP team) to one core, and a child inherits that; give the server every core back."""
    os.sched_setaffinity(0, range(os.cpu_count() or 1))


def vllm_env(kv_bytes: int, peer_defaults: bool) -> dict[str, str]:
    """vLLM's CPU settings. By default the fair ones, as its CPU docs advise and as our own
    server runs: its engine on every core, none reserved for its API process, OpenMP
    threads bound one per core. `peer_defaults` leaves vLLM's out-of-the-box choice (one
    core of two kept for the API process)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, kv_bytes >> 30))}
    for key in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(key, None)
    if not peer_defaults:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    return env


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float, log: Path) -> str:
    """Poll /v1/models until it answers; returns the served model id."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; log tail:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(url + "/v1/models", timeout=5)
            if r.status_code == 200:
                return r.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f}s; log tail:\n{log.read_text()[-3000:]}")


def start_ours(args, port: int, log: Path) -> subprocess.Popen:
    """`bentoml serve` on a preset written from the benchmark's flags."""
    preset = Path(tempfile.mkdtemp()) / "bench.yaml"
    preset.write_text(json.dumps({  # JSON is YAML
        "engine": {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                   "int8_activations": getattr(args, "int8_activations", False),
                   "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": 1024,
                   "kv_cache_memory_bytes": args.kv_bytes, "enable_prefix_caching": args.prefix_caching},
        "service": {"traffic": {"timeout": 3600, "concurrency": args.max_num_seqs}},
    }))
    env = {**os.environ, "PAGEDSERVE_CONFIG": str(preset)}
    bentoml = Path(sys.executable).parent / "bentoml"
    cmd = [str(bentoml), "serve", "service:LLMService", "--port", str(port)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            preexec_fn=all_cores)


def start_vllm(args, model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """`vllm serve` on the same weights, dtype and scheduler limits as ours."""
    if not VLLM_PYTHON.is_file():
        raise SystemExit("vLLM peer missing: run scripts/setup_vllm_peer.sh first")
    # `vllm serve` looks up the version of a distribution named "vllm", which vllm-cpu is not.
    cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--port", str(port),
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-model-len", "1024",
           "--seed", "0"]
    cmd.append("--enable-prefix-caching" if args.prefix_caching else "--no-enable-prefix-caching")
    return subprocess.Popen(cmd, cwd="/tmp", env=vllm_env(args.kv_bytes, args.peer_defaults),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=all_cores)


def start_llama(gguf: Path, port: int, slots: int, ctx: int, prefix_caching: bool, log: Path,
                binary: Path = LLAMA_SERVER) -> subprocess.Popen:
    """llama-server with every core (threads and affinity), `slots` parallel sequences of
    `ctx` tokens each; `binary` is LLAMA_SERVER or LLAMA_SERVER_AVX2."""
    if not binary.is_file():
        raise SystemExit(f"{binary} missing: run scripts/peers/setup_llama_server.sh first"
                         + (" with `avx2`" if binary == LLAMA_SERVER_AVX2 else ""))
    threads = str(os.cpu_count() or 1)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads,
           "-tb", threads, "--parallel", str(slots), "-c", str(ctx * slots), "--seed", "0"]
    cmd.append("--cache-prompt" if prefix_caching else "--no-cache-prompt")
    return subprocess.Popen(cmd, cwd="/tmp", stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=all_cores)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
