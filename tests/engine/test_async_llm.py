"""AsyncLLM on a tiny random model: deltas, aborts, bad requests and a dying engine."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from prometheus_client import CollectorRegistry

from engine.client.async_llm import AsyncLLM, EngineDeadError
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import Collector
from engine.sampling_params import SamplingParams
from engine.serving.metrics import EngineMetrics

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def config(tiny_model_factory) -> EngineConfig:
    path = tiny_model_factory("async-tiny")
    # 2 layers x (K, V) x 2 heads x 16 dims x 16 slots x 4 bytes = 8 KiB per block: 64 blocks.
    return EngineConfig.create(model=str(path), device="cpu", dtype="float32", max_num_seqs=8,
                               max_num_batched_tokens=256, max_model_len=128, kv_cache_memory_bytes=64 * 8192)


@pytest.fixture(scope="module", params=["process", "thread"])
def core(request) -> str:
    """Every test runs against the engine in its own process (as the service runs it) and
    on a thread of this one."""
    return request.param


@pytest.fixture(scope="module")
def registry(core) -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture(scope="module")
def llm(config, registry, core):
    metrics = EngineMetrics("tiny", registry=registry)
    llm = AsyncLLM.start(config, metrics) if core == "process" else AsyncLLM(LLMEngine(config), metrics)
    yield llm
    llm.shutdown()


def run(coro, timeout: float = 120):
    """Run a coroutine with a deadline, so a hang fails the test instead of the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(gen):
    return [item async for item in gen]


def tokens(items, index: int = 0) -> list[int]:
    """A sequence's token ids, put back together from its stream's deltas."""
    return [t for item in items for d in item.deltas if d.index == index for t in d.token_ids]


def finish_reason(items, index: int = 0) -> str | None:
    return next((d.finish_reason for item in items for d in item.deltas if d.index == index and d.finish_reason),
                None)


def wait_until(pred, timeout: float = 10.0) -> bool:
    """Stats are published at step boundaries, just after outputs: give the loop a moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def all_blocks_free(llm: AsyncLLM) -> bool:
    s = llm.stats()
    return s["blocks_free"] == s["blocks_total"] and s["num_running"] == 0 and s["num_waiting"] == 0


def test_deltas_reassemble_the_offline_output(llm, config):
    params = SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=12, logprobs=2, ignore_eos=True)
    items = run(collect(llm.generate("Hello there, how", params)))
    assert items[-1].finished and not any(o.finished for o in items[:-1])
    offline = LLMEngine(config)  # the same seeded request, stepped here to the end
    ids = offline.tokenize("Hello there, how")
    offline.add_request("r", ids, params)
    collector = Collector()
    collector.expect("r", None, ids)
    final = None
    while offline.has_unfinished():
        final = next((o for o in map(collector.add, offline.step().outputs) if o.finished), final)
    assert final is not None and items[-1].prompt_token_ids == final.prompt_token_ids
    for comp in final.outputs:
        mine = [d for o in items for d in o.deltas if d.index == comp.index]
        assert "".join(d.text for d in mine) == comp.text
        assert [t for d in mine for t in d.token_ids] == comp.token_ids
        assert [lp for d in mine for lp in d.logprobs] == comp.logprobs
        assert len(comp.token_ids) == 12
        assert [d.finish_reason for d in mine if d.finish_reason] == ["length"]  # reported exactly once
    assert wait_until(lambda: all_blocks_free(llm))


def test_a_rejected_request_raises_before_output_and_disturbs_no_one(llm):
    async def scenario():
        good = asyncio.create_task(collect(llm.generate("abc", SamplingParams(temperature=0, max_tokens=10,
                                                                              ignore_eos=True))))
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in llm.generate([5] * 200, SamplingParams(max_tokens=4)):
                pytest.fail("a rejected request yielded output")
        with pytest.raises(ValueError, match="temperature"):  # checked where it enters, before output
            async for _ in llm.generate("abc", SamplingParams(temperature=-1)):
                pytest.fail("a request with a bad field yielded output")
        return await good

    items = run(scenario())
    assert len(tokens(items)) == 10
    assert wait_until(lambda: all_blocks_free(llm))


def finished_as(registry, reason: str) -> float:
    labels = {"model_name": "tiny", "finished_reason": reason}
    return registry.get_sample_value("vllm:request_success_total", labels) or 0.0


async def settle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    """Wait, with this event loop still running, until the engine holds nothing."""
    deadline = time.monotonic() + timeout
    while not all_blocks_free(llm) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_leaving_the_stream_early_aborts_and_frees_blocks(llm, registry):
    aborted, ran_out = finished_as(registry, "abort"), finished_as(registry, "length")

    async def scenario():
        gen = llm.generate("abc " * 5, SamplingParams(max_tokens=100, ignore_eos=True))
        async for _ in gen:
            assert llm.stats()["blocks_free"] < llm.stats()["blocks_total"]
            break
        await gen.aclose()  # what a cancelled HTTP handler does
        await settle(llm)  # the loop stays open: only the abort itself can end the request early

    run(scenario())
    assert all_blocks_free(llm)
    assert finished_as(registry, "abort") == aborted + 1
    assert finished_as(registry, "length") == ran_out  # it did not simply run to max_tokens


def test_cancelling_the_consumer_task_aborts(llm, registry):
    aborted, ran_out = finished_as(registry, "abort"), finished_as(registry, "length")

    async def scenario():
        started = asyncio.Event()

        async def consume():
            async for _ in llm.generate("xyz " * 5, SamplingParams(max_tokens=100, ignore_eos=True)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await settle(llm)

    run(scenario())
    assert all_blocks_free(llm)
    assert finished_as(registry, "abort") == aborted + 1
    assert finished_as(registry, "length") == ran_out


def test_abort_by_id_ends_the_stream_with_reason_abort(llm):
    async def scenario():
        items = []
        async for item in llm.generate("zzz", SamplingParams(max_tokens=100, ignore_eos=True), request_id="r-1"):
            items.append(item)
            if len(items) == 2:
                llm.abort("r-1")
        return items

    items = run(scenario())
    assert items[-1].finished and finish_reason(items) == "abort"
    assert len(tokens(items)) < 100
    assert wait_until(lambda: all_blocks_free(llm))


def test_metrics_follow_the_requests(llm, registry):
    def value(name: str, **labels) -> float:
        return registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0

    before = {k: value(k) for k in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                                    "vllm:time_to_first_token_seconds_count",
                                    "vllm:e2e_request_latency_seconds_count",
                                    "vllm:inter_token_latency_seconds_count",
                                    "vllm:request_queue_time_seconds_count",
                                    "vllm:prefix_cache_queries_total")}
    length_before = value("vllm:request_success_total", finished_reason="length")
    items = run(collect(llm.generate([7, 8, 9, 10, 11], SamplingParams(max_tokens=6, ignore_eos=True))))
    assert len(tokens(items)) == 6
    assert wait_until(lambda: all_blocks_free(llm))
    grew = {k: value(k) - v for k, v in before.items()}
    assert grew["vllm:generation_tokens_total"] == 6
    assert grew["vllm:prompt_tokens_total"] == 5
    assert grew["vllm:time_to_first_token_seconds_count"] == 1
    assert grew["vllm:request_queue_time_seconds_count"] == 1
    assert grew["vllm:e2e_request_latency_seconds_count"] == 1
    assert grew["vllm:inter_token_latency_seconds_count"] >= 1
    assert grew["vllm:prefix_cache_queries_total"] >= 5
    assert value("vllm:request_success_total", finished_reason="length") == length_before + 1
    assert wait_until(lambda: value("vllm:kv_cache_blocks_free") == value("vllm:kv_cache_blocks_total"))
    assert value("vllm:kv_cache_blocks_total") == 64
    assert value("vllm:num_requests_running") == 0


def test_engine_errors_reach_every_waiting_request(config):
    engine = LLMEngine(config)
    llm = AsyncLLM(engine)
    real_step, calls = engine.step, itertools.count()

    def failing_step():
        if next(calls) >= 2:
            raise RuntimeError("device lost")
        return real_step()

    engine.step = failing_step

    async def scenario():
        gens = [llm.generate(f"prompt {i}", SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(3)]
        results = await asyncio.gather(*(collect(g) for g in gens), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "device lost" in str(results[0])
        with pytest.raises(EngineDeadError):  # later requests fail fast instead of queueing forever
            await collect(llm.generate("after", SamplingParams(max_tokens=2)))

    run(scenario(), timeout=60)
    assert not llm.is_alive and isinstance(llm.error, RuntimeError)
    assert llm.stats()["engine_alive"] is False


def test_a_killed_engine_process_fails_every_waiter_and_health(config):
    """The engine process dies mid-stream (OOM killer, a segfault in a kernel): every open
    stream and every later request gets EngineDeadError, and liveness turns false."""
    import os
    import signal

    llm = AsyncLLM.start(config)

    async def scenario():
        gens = [llm.generate(f"prompt {i}", SamplingParams(max_tokens=100, ignore_eos=True)) for i in range(3)]
        first = await gens[0].__anext__()  # running for real before the kill
        assert first.deltas
        os.kill(llm._core.pid, signal.SIGKILL)
        results = await asyncio.gather(*(collect(g) for g in gens), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError):
            await collect(llm.generate("after", SamplingParams(max_tokens=2)))

    run(scenario(), timeout=60)
    assert not llm.is_alive and "exited" in str(llm.error)
    assert llm.stats()["engine_alive"] is False
    llm.shutdown()


def test_a_stalled_core_turns_liveness_false_and_never_blocks_the_caller(config):
    """The engine process stopped dead (SIGSTOP: a step that never returns, as far as the
    server can tell). The caller's sends never block, though the pipe fills (2,000
    requests of 100 tokens, about 400 KB, where a pipe holds 64 KB); liveness turns false
    once the core has been silent for stall_timeout_s, and true again once it resumes."""
    import os
    import signal
    import threading

    llm = AsyncLLM.start(config, stall_timeout_s=1.5)
    rescued = threading.Event()

    def resume() -> None:
        rescued.set()
        try:
            os.kill(llm._core.pid, signal.SIGCONT)
        except ProcessLookupError:  # the test is over and the process gone
            pass

    async def scenario():
        assert llm.is_responsive
        os.kill(llm._core.pid, signal.SIGSTOP)
        # Should a send block this loop, only the rescue's SIGCONT would free it: the check
        # below is whether the rescue had to fire, not how long the sends took.
        rescue = threading.Timer(30.0, resume)
        rescue.start()
        try:
            gens = [llm.generate(list(range(5, 105)), SamplingParams(max_tokens=1)) for _ in range(2000)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)  # every request submitted
            assert not rescued.is_set()  # the sends went through with the core stopped
            while llm.is_responsive:  # turns false once the core has been silent for 1.5 s
                assert not rescued.is_set(), "liveness stayed true for the 30 s the core was stopped"
                await asyncio.sleep(0.05)
            assert llm.is_alive
        finally:
            rescue.cancel()
            resume()
        done, _ = await asyncio.wait(firsts, timeout=60)
        assert len(done) == len(firsts)  # every one answered, by the core or by its refusal
        for g in gens:
            await g.aclose()
        assert llm.is_responsive

    run(scenario(), timeout=120)
    llm.shutdown()


def test_stats_on_a_busy_core_hold_a_caller_briefly_and_ask_once(config):
    """/stats while the core is inside a long step: every caller gets the last reading
    after at most its timeout (it held a worker thread for 30 s), and however many ask,
    the core is asked once."""
    import threading

    from engine.messages import GetStats

    engine = LLMEngine(config)
    gate, inside, real_step = threading.Event(), threading.Event(), engine.step

    def long_step():
        inside.set()
        gate.wait(30)
        return real_step()

    engine.step = long_step
    llm = AsyncLLM(engine)
    asked = []
    real_put = llm._core._put
    llm._core._put = lambda cmd: (asked.append(cmd) if isinstance(cmd, GetStats) else None, real_put(cmd))[1]

    async def scenario():
        gen = llm.generate("hi", SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.to_thread(inside.wait, 10)
        start = time.monotonic()
        readings = await asyncio.gather(*(asyncio.to_thread(llm.stats, 0.3) for _ in range(6)))
        assert time.monotonic() - start < 15 and all(r["engine_alive"] for r in readings)  # it held one 30 s
        assert len(asked) == 1
        gate.set()
        await first
        await gen.aclose()

    try:
        run(scenario(), timeout=60)
    finally:
        gate.set()
        llm.shutdown()


def test_the_waiting_queue_is_bounded_and_gives_its_places_back(llm):
    """Requests waiting for their first token are bounded in number and prompt tokens; past
    a bound the caller is refused at once, and every place comes back however a request ends."""
    from engine.client.admission import Admission, QueueFullError, QueueLimits

    saved = llm.admission
    llm.admission = Admission(QueueLimits(max_waiting_requests=2, max_waiting_tokens=100))
    params = SamplingParams(max_tokens=4, temperature=0)

    async def burst(prompts):
        gens = [llm.generate(p, params) for p in prompts]
        # all admitted or refused before any output can arrive: the tasks start in order
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
        for g, f in zip(gens, firsts):
            if not isinstance(f, BaseException):
                await collect(g)
        return firsts

    try:
        by_count = run(burst([[5] * 40, [6] * 40, [7] * 10]))
        by_tokens = run(burst([[8] * 60, [9] * 60]))
        assert [isinstance(f, QueueFullError) for f in by_count] == [False, False, True]
        assert [isinstance(f, QueueFullError) for f in by_tokens] == [False, True]
        assert "2 requests are already waiting" in str(by_count[2]) and by_count[2].retry_after >= 1
        assert (llm.admission.requests, llm.admission.tokens) == (0, 0)
        assert len(tokens(run(collect(llm.generate([7] * 99, params))))) == 4  # an idle queue takes any prompt
    finally:
        llm.admission = saved
