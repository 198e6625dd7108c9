"""Engine statistics as typed records (per-step increments, and a snapshot read on
demand), and the tracker that keeps them next to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepStats:
    """What one step did. Counters are increments for this step only; gauges are O(1) reads.
    The serving side's counters and gauges come from here and nowhere else."""

    prompt_tokens_computed: int = 0  # prompt tokens that went through the model
    prompt_tokens: int = 0  # prompt tokens of requests whose first token came this step
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Speculative decoding, as vLLM's spec_decode counters: sequences that proposed, tokens
    # proposed, tokens accepted, and accepted tokens by their position in the proposal.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: dict[int, int] = field(default_factory=dict)
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
    quantization: str | None = None  # the weights' format in force: None (the dtype), "gguf" or "int8"
    weight_bytes: int = 0  # what the model's weights take in memory (this process's part)
    spec_method: str | None = None  # speculative_config.method in force, if any
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)  # index j: drafts whose token j was accepted
    spec_acceptance_rate: float = 0.0  # accepted over proposed tokens
    spec_mean_accepted_length: float = 0.0  # tokens a speculating step emits: accepted drafts + the target's own


class StatsTracker:
    """Running totals of every step's counters, the KV waste average, and the gauges read
    from the scheduler and the block pool."""

    def __init__(self, scheduler: Any, kv_manager: Any, quantization: str | None = None,
                 weight_bytes: int = 0, spec_method: str | None = None, num_spec: int = 0) -> None:
        self.scheduler, self.kv_manager = scheduler, kv_manager
        self.quantization, self.weight_bytes = quantization, weight_bytes
        self.spec_method = spec_method
        self.accepted_per_pos = [0] * num_spec
        self.totals = StepStats()
        self._waste_sum = 0.0
        self._waste_steps = 0

    def track_waste(self) -> None:
        allocated, stored = self.scheduler.kv_fill()
        if allocated:
            self._waste_sum += (allocated - stored) / allocated
            self._waste_steps += 1

    def gauges(self, stats: StepStats | None = None) -> StepStats:
        """Fill `stats`' O(1) gauges (a fresh StepStats when a caller changed state outside a step)."""
        stats = stats or StepStats()
        pool = self.kv_manager.pool
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.blocks_free = pool.num_free
        stats.blocks_shared = pool.num_shared
        stats.blocks_cached_free = pool.num_cached_free
        stats.kv_cache_usage = self.kv_manager.usage
        return stats

    def add(self, stats: StepStats) -> None:
        t = self.totals
        t.prompt_tokens_computed += stats.prompt_tokens_computed
        t.generation_tokens += stats.generation_tokens
        t.preemptions += stats.preemptions
        t.prefix_cache_query_tokens += stats.prefix_cache_query_tokens
        t.prefix_cache_hit_tokens += stats.prefix_cache_hit_tokens
        t.spec_drafts += stats.spec_drafts
        t.spec_draft_tokens += stats.spec_draft_tokens
        t.spec_accepted_tokens += stats.spec_accepted_tokens
        for j, n in stats.spec_accepted_per_pos.items():
            self.accepted_per_pos[j] += n

    def snapshot(self) -> EngineStats:
        """Read now: call it between steps."""
        pool = self.kv_manager.pool
        allocated, stored = self.scheduler.kv_fill()
        t = self.totals
        return EngineStats(
            blocks_total=pool.num_blocks,
            blocks_free=pool.num_free,
            blocks_used=pool.num_blocks - pool.num_free,
            blocks_shared=pool.num_shared,
            blocks_cached_free=pool.num_cached_free,
            kv_cache_usage=self.kv_manager.usage,
            kv_waste=(allocated - stored) / allocated if allocated else 0.0,
            kv_waste_mean=self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            num_preemptions=t.preemptions,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            prefix_cache_query_tokens=t.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=t.prefix_cache_hit_tokens,
            prompt_tokens_computed=t.prompt_tokens_computed,
            generation_tokens=t.generation_tokens,
            quantization=self.quantization,
            weight_bytes=self.weight_bytes,
            spec_method=self.spec_method,
            spec_num_drafts=t.spec_drafts,
            spec_num_draft_tokens=t.spec_draft_tokens,
            spec_num_accepted_tokens=t.spec_accepted_tokens,
            spec_accepted_per_pos=list(self.accepted_per_pos),
            spec_acceptance_rate=t.spec_accepted_tokens / t.spec_draft_tokens if t.spec_draft_tokens else 0.0,
            spec_mean_accepted_length=1 + t.spec_accepted_tokens / t.spec_drafts if t.spec_drafts else 0.0,
        )
