"""Tensor and pipeline parallelism over gloo: the same greedy output and logits as one process.

Tensor parallelism splits heads, so it runs on a tiny random model with the embedded
model's head layout (9 query heads over 3 KV heads: an uneven split at tp=2), one with 4 KV
heads, and one with a single KV head (replicated on both ranks); the README's snippet runs
the embedded model itself at tp=2 (tests/engine/test_readme.py). Pipeline parallelism
splits layers, whatever the heads, so the uneven model covers it (the kv4 model's pipeline
runs below, under preemption and in-flight aborts). Greedy output is compared to tp=1 on 8 prompts of 12 to 40 tokens; the
last position's logits must agree to 1e-4 relative.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor import ParallelExecutor
from engine.models.decoder import kv_block_bytes
from engine.outputs import Collector
from engine.runner import prepare
from tests.support.prompts import make_prompts

pytestmark = pytest.mark.timeout(900)

MODELS = {
    "uneven": dict(hidden_size=72, num_attention_heads=9, num_key_value_heads=3),
    "kv4": dict(num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False),
    "kv1": dict(num_attention_heads=4, num_key_value_heads=1),
}
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
CASES = [("uneven", "tp2"), ("uneven", "pp2"), ("kv4", "tp2"), ("kv1", "tp2")]
MAX_NEW = 12
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [p[: 12 + 4 * i] for i, p in enumerate(make_prompts(tokenizer, NUM_PROMPTS, 44))]  # 12..40 tokens


@pytest.fixture(scope="module")
def model_path(tiny_model_factory):
    def path(name: str) -> str:
        return str(tiny_model_factory(f"par_{name}", **MODELS[name]))

    return path


@pytest.fixture(scope="module")
def reference(model_path, prompts):
    """tp=1 results per model, computed once."""
    done: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in done:
            llm = LLM(model_path(name), dtype="float32")
            done[name] = (greedy(llm, prompts), last_logits(llm, prompts))
        return done[name]

    return get


def greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def last_logits(llm: LLM, prompts) -> torch.Tensor:
    """The logits of every prompt's last position, straight from the executor (one step)."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"logits-{i}", p, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    assert len(batch) == len(prompts)
    step = prepare(batch, engine.kv_manager)
    engine.executor.submit(step.tensors)
    logits = engine.executor.result()
    order = [int(s.request_id.split("-")[1]) for s in step.sampling]
    for i in range(len(prompts)):
        engine.abort(f"logits-{i}")
    assert engine.stats().blocks_used == 0
    return logits[torch.tensor(order).argsort()]


@pytest.mark.parametrize(("model", "layout"), CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def test_parallel_matches_one_process(model, layout, model_path, prompts, reference):
    want_tokens, want_logits = reference(model)
    tp, pp = LAYOUTS[layout]
    with LLM(model_path(model), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        assert isinstance(llm.engine.executor, ParallelExecutor)
        assert len(llm.engine.executor.procs) == tp * pp - 1
        got_logits = last_logits(llm, prompts)
        got_tokens = greedy(llm, prompts)
        assert llm.stats().blocks_used == 0
    rel = ((got_logits - want_logits).abs().amax(-1) / want_logits.abs().amax(-1)).max().item()
    assert rel < 1e-4, f"logits differ by {rel:.2e} relative"
    same = sum(g == w for g, w in zip(got_tokens, want_tokens))
    assert same >= NUM_PROMPTS - 1, f"greedy output matched tp=1 on only {same} of {NUM_PROMPTS} prompts"


def test_pipeline_keeps_batches_in_flight_through_preemption_and_chunking(model_path, prompts):
    """pp=2 with a small token budget (chunked prefill) and too few KV blocks (preemption):
    two batches are in flight at once, none of their sequences is preempted mid-flight,
    and the output is still tp=1's."""
    path = model_path("kv4")
    from engine.models.loader import load_config, resolve

    block = kv_block_bytes(load_config(resolve(path)), 16, torch.float32)
    small = dict(dtype="float32", max_num_seqs=16, max_num_batched_tokens=64, max_model_len=128,
                 kv_cache_memory_bytes=8 * block)
    ref = greedy(LLM(path, **small), prompts)
    with LLM(path, pipeline_parallel_size=2, **small) as llm:
        engine = llm.engine
        behind = []  # batches still in flight while the oldest one's logits are awaited
        result = engine.executor.result

        def spy():
            behind.append(len(engine._inflight))
            return result()

        engine.executor.result = spy
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        outputs, collector = {}, Collector()
        while engine.has_unfinished():
            for delta in engine.step().outputs:
                out = collector.add(delta)
                if out.finished:
                    outputs[int(out.request_id)] = out.outputs[0].token_ids
        stats = llm.stats()
    assert sum(behind) > len(behind) // 2  # most steps overlap two batches
    assert stats.num_preemptions > 0
    assert stats.blocks_used == 0
    assert sum(outputs[i] == ref[i] for i in range(NUM_PROMPTS)) >= NUM_PROMPTS - 1


def test_sizes_that_cannot_split_are_refused_naming_the_field(model_path):
    from engine.errors import ParamError

    with pytest.raises(ParamError) as err:
        LLM(model_path("kv1"), tensor_parallel_size=8)  # 4 query heads
    assert err.value.param == "tensor_parallel_size"
    with pytest.raises(ParamError) as err:
        LLM(model_path("kv1"), pipeline_parallel_size=3)  # 2 layers
    assert err.value.param == "pipeline_parallel_size"


def test_a_worker_dying_while_idle_is_noticed_and_fails_the_next_request(model_path):
    import os
    import signal
    import time

    from engine.executor import WorkerDiedError

    with LLM(model_path("kv1"), tensor_parallel_size=2) as llm:
        (worker,) = llm.engine.executor.procs
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while llm.engine.executor.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(WorkerDiedError, match="engine-rank1"):
            llm.engine.check_health()
        with pytest.raises(WorkerDiedError):
            llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)


def test_pipeline_sampling_features_and_aborts_in_flight(model_path, prompts):
    """Under pp=2: seeded n=2 sampling, logprobs and prompt logprobs as in one process; a
    request aborted while its batch is in flight ends at once, frees its blocks and leaves
    the others whole."""
    path = model_path("kv4")
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, n=2, logprobs=2, prompt_logprobs=1)
    want = LLM(path, dtype="float32").generate(prompts[:8], params, use_tqdm=False)
    with LLM(path, dtype="float32", pipeline_parallel_size=2) as llm:
        got = llm.generate(prompts[:8], params, use_tqdm=False)
        engine = llm.engine
        for i in range(6):
            engine.add_request(f"x{i}", prompts[i], SamplingParams(max_tokens=40, ignore_eos=True))
        while len(engine._inflight) == 0 or not any(s.in_flight for s in engine.scheduler.running):
            engine.step()
        aborted = [s.request_id for s in engine.scheduler.running if s.in_flight]
        for rid in aborted:
            assert engine.abort(rid).finished
        done, collector = {}, Collector()
        while engine.has_unfinished():
            for delta in engine.step().outputs:
                out = collector.add(delta)
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        assert llm.stats().blocks_used == 0
    assert aborted and not set(aborted) & set(done)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 40 for o in done.values())
    assert len(done) == 6 - len(aborted)
    for w, g in zip(want, got):
        assert [c.token_ids for c in w.outputs] == [c.token_ids for c in g.outputs]
        for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_a_worker_dying_at_start_up_fails_the_engine_start_at_once(model_path):
    """Killed before it joins the process group: the start fails within seconds, naming the
    worker, instead of waiting out the group's timeout."""
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from engine.executor import WorkerDiedError

    def kill_first_worker():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for child in multiprocessing.active_children():
                if child.name == "engine-rank1" and child.pid:
                    os.kill(child.pid, signal.SIGKILL)
                    return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="engine-rank1"):
        LLM(model_path("kv1"), tensor_parallel_size=2)
    killer.join()
    assert time.monotonic() - start < 30


def test_tensor_parallel_speculation_matches_one_process(model_path, prompts, reference):
    """A draft model under tp=2: it runs beside rank 0 on rank 0's cores, on block ids the
    workers' caches share, and greedy output stays tp=1's without speculation."""
    want_tokens, _ = reference("kv4")
    spec = {"method": "draft", "num_layers": 1, "num_speculative_tokens": 3}
    with LLM(model_path("kv4"), dtype="float32", tensor_parallel_size=2, speculative_config=spec) as llm:
        got_tokens = greedy(llm, prompts)
        stats = llm.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert stats.blocks_used == 0
    same = sum(g == w for g, w in zip(got_tokens, want_tokens))
    assert same >= NUM_PROMPTS - 1, f"greedy output matched tp=1 on only {same} of {NUM_PROMPTS} prompts"


def test_the_rendezvous_store_listens_on_loopback_only():
    """TCPStore's own server listens on every interface whatever host it is given; the
    engine's listens on 127.0.0.1 alone, and a worker rank still reaches it."""
    import datetime
    import socket

    from engine.parallel import open_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    timeout = datetime.timedelta(seconds=10)
    store = open_store(port, 2, True, timeout)
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                listening.append(addr)
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing on 0.0.0.0 or ::
    worker = open_store(port, 2, False, timeout)
    worker.set("k", "v")
    assert store.get("k") == b"v"
