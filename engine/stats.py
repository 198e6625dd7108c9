"""Engine statistics as typed records: per-step increments, and a snapshot read on demand."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """What one step did. Counters are increments for this step only; gauges are O(1) reads."""

    prompt_tokens_computed: int = 0  # prompt tokens that went through the model
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    blocks_free: int = 0
    blocks_shared: int = 0
    blocks_cached_free: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class EngineStats:
    """The engine as it stands now, with running totals since it started."""

    blocks_total: int
    blocks_free: int
    blocks_used: int
    blocks_shared: int
    blocks_cached_free: int
    kv_cache_usage: float
    kv_waste: float  # now: allocated-but-empty slots over allocated slots of running sequences
    kv_waste_mean: float  # the same, averaged over every step so far
    num_preemptions: int
    num_running: int
    num_waiting: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens_computed: int
    generation_tokens: int
