"""Prometheus metrics for the engine, with vLLM's names and, by default, its prefix.

`vllm:num_requests_running`, `vllm:time_to_first_token_seconds` and the rest mean what
they mean in vLLM, so its dashboards and the Gateway API inference extension's endpoint
picker read them unchanged; service.metrics_prefix picks another prefix. Counters get
prometheus' `_total` suffix on exposition, exactly as vLLM's do.

prometheus_client is imported when EngineMetrics is built, not when this module is:
BentoML sets PROMETHEUS_MULTIPROC_DIR in its workers after importing the service
module, and prometheus_client fixes its mode at import. Metrics made in the worker land
in BentoML's multiprocess registry and so appear on the service's own /metrics (this is
what the deprecated `bentoml.metrics` shim does too). Gauges therefore declare how
processes combine: counts sum over live workers, usage takes the most loaded one.

All recording happens on the engine thread (AsyncLLM), one call per step, so the
per-request bookkeeping here needs no lock. Counters and gauges come from the step's
StepStats; latencies and finish reasons from its per-request outputs. Nothing here
counts tokens again.
"""

from __future__ import annotations

import time
from typing import Any

from engine.messages import RequestDelta, StepOutput
from engine.stats import EngineStats, StepStats

PREFIX = "vllm"

# vLLM's buckets (seconds), so histograms compare one to one.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    """The engine's gauges, counters and histograms, labelled with the served model name."""

    def __init__(self, model_name: str, prefix: str = PREFIX, registry: Any = None) -> None:
        import prometheus_client as prom  # late on purpose: see the module docstring

        kw: dict[str, Any] = {"labelnames": ["model_name"]}
        if registry is not None:  # tests pass their own; BentoML workers use the default
            kw["registry"] = registry
        p = prefix

        def gauge(name: str, doc: str, mode: str = "livesum") -> Any:
            return prom.Gauge(f"{p}:{name}", doc, multiprocess_mode=mode, **kw).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return prom.Counter(f"{p}:{name}", doc, **kw).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(f"{p}:{name}", doc, buckets=buckets, **kw).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "livemax")
        self.blocks_total = gauge("kv_cache_blocks_total", "KV blocks in the pool.")
        self.blocks_free = gauge("kv_cache_blocks_free", "KV blocks not referenced by any request.")
        self.blocks_shared = gauge("kv_cache_blocks_shared", "KV blocks held by more than one sequence.")
        self.blocks_cached_free = gauge("kv_cache_blocks_cached_free",
                                        "Free KV blocks that still hold a reusable cached prefix.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that reached decoding.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Sequences preempted to free KV blocks.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative proposals verified.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.")
        self._spec_per_pos = prom.Counter(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative tokens accepted, by their position in the proposal.",
                                          labelnames=["model_name", "position"],
                                          **({"registry": registry} if registry is not None else {}))
        self._success = prom.Counter(f"{p}:request_success", "Finished requests by finish reason.",
                                     labelnames=["model_name", "finished_reason"],
                                     **({"registry": registry} if registry is not None else {}))
        self._model_name = model_name
        self.weight_bytes = prom.Gauge(f"{p}:model_weight_bytes", "Bytes the model's weights take, by format.",
                                       labelnames=["model_name", "quantization"], multiprocess_mode="livemax",
                                       **({"registry": registry} if registry is not None else {}))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling.",
                                    REQUEST_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Time between a request's tokens (vLLM's older "
                              "name for inter_token_latency_seconds).", ITL_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduling to first token.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                        TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens", "Tokens each finished request generated.",
                                            TOKEN_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens each engine step computed.",
                                          TOKEN_BUCKETS)
        self._cache_info = prom.Gauge(f"{p}:cache_config_info", "The KV cache's configuration, in the labels.",
                                      labelnames=["model_name", "block_size", "num_gpu_blocks", "cache_dtype",
                                                  "enable_prefix_caching"], multiprocess_mode="livemax",
                                      **({"registry": registry} if registry is not None else {}))
        self._last_token: dict[str, float] = {}  # live requests that have tokens: when the last came

    def record_start(self, stats: EngineStats, block_size: int = 16, cache_dtype: str = "auto",
                     prefix_caching: bool = True) -> None:
        """The pool's size, its configuration and the gauges before the first step."""
        self.blocks_total.set(stats.blocks_total)
        self._cache_info.labels(self._model_name, str(block_size), str(stats.blocks_total), cache_dtype,
                                str(prefix_caching)).set(1)
        self.weight_bytes.labels(self._model_name, stats.quantization or "none").set(stats.weight_bytes)
        for gauge, value in ((self.running, stats.num_running), (self.waiting, stats.num_waiting),
                             (self.kv_usage, stats.kv_cache_usage), (self.blocks_free, stats.blocks_free),
                             (self.blocks_shared, stats.blocks_shared),
                             (self.blocks_cached_free, stats.blocks_cached_free)):
            gauge.set(value)

    def record_step(self, step: StepOutput, now: float | None = None) -> None:
        self.record_outputs(step.outputs, now)
        self.record_stats(step.stats)

    def record_outputs(self, outputs: list[RequestDelta], now: float | None = None) -> None:
        """Observe latencies and finishes from one step's outputs."""
        now = time.monotonic() if now is None else now
        for out in outputs:
            if any(d.token_ids for d in out.deltas):
                last = self._last_token.get(out.request_id)
                m = out.metrics
                if last is not None:
                    self.itl.observe(now - last)
                    self.tpot.observe(now - last)
                elif m is not None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                self._last_token[out.request_id] = now
            if out.finished:
                self._finish(out, now)

    def _finish(self, out: RequestDelta, now: float) -> None:
        self._last_token.pop(out.request_id, None)
        reasons = out.finish_reasons or []
        reason = "abort" if "abort" in reasons or not reasons else reasons[0]
        self._success.labels(self._model_name, reason).inc()
        m = out.metrics
        if m is None or reason == "abort":
            return
        finished = m.finished_time or now
        self.e2e.observe(finished - m.arrival_time)
        self.request_prompt.observe(out.num_prompt_tokens)
        self.request_generation.observe(out.num_output_tokens)
        if m.first_token_time is not None:
            self.decode_time.observe(finished - m.first_token_time)
            if m.first_scheduled_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)

    def record_stats(self, stats: StepStats) -> None:
        """Set the gauges and advance the counters by one step's increments."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.blocks_free.set(stats.blocks_free)
        self.blocks_shared.set(stats.blocks_shared)
        self.blocks_cached_free.set(stats.blocks_cached_free)
        for grown, counter in ((stats.prefix_cache_query_tokens, self.prefix_queries),
                               (stats.prefix_cache_hit_tokens, self.prefix_hits),
                               (stats.preemptions, self.preemptions),
                               (stats.generation_tokens, self.generation_tokens),
                               (stats.prompt_tokens, self.prompt_tokens),
                               (stats.spec_drafts, self.spec_drafts),
                               (stats.spec_draft_tokens, self.spec_draft_tokens),
                               (stats.spec_accepted_tokens, self.spec_accepted)):
            if grown > 0:
                counter.inc(grown)
        computed = stats.prompt_tokens_computed + stats.generation_tokens
        if computed > 0:
            self.iteration_tokens.observe(computed)
        for pos, n in stats.spec_accepted_per_pos.items():
            self._spec_per_pos.labels(self._model_name, str(pos)).inc(n)


_CACHE: dict[str, EngineMetrics] = {}


def engine_metrics(model_name: str, prefix: str = PREFIX) -> EngineMetrics:
    """One EngineMetrics per process and prefix: prometheus refuses to register a name twice."""
    if prefix not in _CACHE:
        _CACHE[prefix] = EngineMetrics(model_name, prefix)
    elif _CACHE[prefix]._model_name != model_name:
        raise ValueError(f"metrics under {prefix!r} already label model {_CACHE[prefix]._model_name!r}")
    return _CACHE[prefix]
