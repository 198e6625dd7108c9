"""CUDA graphs for decode steps, as vLLM captures them.

A decode step launches a few hundred small kernels whose launch cost, at small batches,
is most of the step. Each padded batch size in `sizes` is captured once at start-up as a
graph over persistent input buffers (token ids, positions, slots, block tables, sequence
lengths, query starts, logits rows); a step copies its inputs into the buffers, pads the
rest, replays the smallest graph that holds it and reads the logits back. Anything else
(prefill, mixed, speculative or prompt-logprob steps, more sequences than the largest
size, a table wider than captured) runs eagerly.

Padded rows are one-token queries at position 0 of block 0 with no cache slot (slot -1 is
never written): they read whatever block 0 holds and their logits are dropped.

The graphs share one memory pool, captured largest first, so the pool is about one
largest step's activations (`pool_bytes` estimates it before the KV pool is sized).
`capture` is how a callable becomes replayable: `cuda_capture` records a CUDA graph; the
CPU tests pass `eager_capture` (replaying calls it again), which runs every other part of
this file (buckets, buffers, padding, the fallback) as the device does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.models.decoder import head_dim, num_kv_heads
from engine.runner import StepTensors

if TYPE_CHECKING:
    from engine.runner import ModelRunner

log = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor], Any], Replay]
MAX_SIZE = 256  # vLLM's default largest captured batch


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (and MAX_SIZE)."""
    top = min(max_num_seqs, MAX_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes if sizes[-1] == top else sizes + [top]


def bucket(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n sequences; None past the largest."""
    return next((s for s in sizes if s >= n), None)


def pool_bytes(hf_config: Any, max_size: int, dtype: torch.dtype) -> int:
    """What the graphs' shared pool holds at most: one largest step's activations, the
    fp32 logits included, with room for the attention's split-K partials; the estimate
    the KV pool is sized around (start-up logs the measured figure beside it)."""
    width = torch.finfo(dtype).bits // 8
    heads, kv, d = hf_config.num_attention_heads, num_kv_heads(hf_config), head_dim(hf_config)
    per_row = (hf_config.vocab_size * 4 + 8 * hf_config.hidden_size * width
               + 3 * hf_config.intermediate_size * width + 2 * (heads + 2 * kv) * d * width
               + heads * 64 * (d + 2) * 4)
    return max_size * per_row + (16 << 20)


def wanted(config: Any, device: torch.device, backend: Any, model: Any) -> list[int]:
    """The sizes to capture, or none: CUDA only, one process (tp = pp = 1), a backend and a
    model whose forward never asks the host (the Triton kernels; no expert layer, which
    counts its experts' tokens on the host), not enforce_eager."""
    if (config.enforce_eager or device.type != "cuda" or not backend.graph_safe or not model.graph_safe
            or config.tensor_parallel_size * config.pipeline_parallel_size != 1):
        return []
    return sorted(set(config.cuda_graph_sizes or default_sizes(config.max_num_seqs)))


def cuda_capture(fn: Callable[[], torch.Tensor], pool: Any) -> Replay:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.pool = graph.pool()  # type: ignore[attr-defined]
    return replay


def eager_capture(fn: Callable[[], torch.Tensor], pool: Any) -> Replay:
    return fn


class DecodeGraphs:
    """One runner's decode graphs and the buffers they read. The buffers are as wide as the
    largest size and as long as max_model_len's block table, so any decode step that fits
    reuses a graph whatever its sequences' lengths."""

    def __init__(self, runner: ModelRunner, sizes: list[int], max_blocks: int,
                 capture: Capture = cuda_capture) -> None:
        self.runner, self.sizes, self.width = runner, sorted(set(sizes)), max_blocks
        self.capture = capture
        n, dev, extra = self.sizes[-1], runner.device, runner.groups.num_groups - 1
        i64 = dict(dtype=torch.int64, device=dev)
        self.ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slots = torch.full((n,), -1, **i64)
        self.tables = torch.zeros(n, max_blocks, **i64)
        self.starts = torch.arange(n + 1, **i64)
        self.lens = torch.ones(n, **i64)
        self.rows = torch.arange(n, **i64)
        self.group_tables = torch.zeros(extra, n, max_blocks, **i64)
        self.group_slots = torch.full((extra, n), -1, **i64)
        self.graphs: dict[int, Replay] = {}

    def _step(self, size: int) -> StepTensors:
        """The step a graph of this size runs: views of the persistent buffers."""
        return StepTensors(self.ids[:size], self.positions[:size], self.slots[:size], self.tables[:size],
                           self.starts[:size + 1], self.lens[:size], self.rows[:size],
                           torch.zeros(0, 2, dtype=torch.int64, device=self.ids.device), size,
                           self.group_tables[:, :size], self.group_slots[:, :size])

    def capture_all(self) -> None:
        """Every size, largest first into one pool; logs the time and the memory taken."""
        cuda = self.runner.device.type == "cuda"
        before = torch.cuda.memory_reserved(self.runner.device) if cuda else 0
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            step = self._step(size)
            self.runner.eager(step)  # warm-up: lazy allocations and autotuning stay out of the graph
            if cuda:
                torch.cuda.synchronize(self.runner.device)
            replay = self.capture(lambda step=step: self.runner.eager(step), pool)
            pool = getattr(replay, "pool", pool)
            self.graphs[size] = replay
        taken = (torch.cuda.memory_reserved(self.runner.device) - before) if cuda else 0
        log.info("captured %d decode graphs (batch sizes %d..%d) in %.1f s, %.1f MiB", len(self.sizes),
                 self.sizes[0], self.sizes[-1], time.perf_counter() - start, taken / 2**20)

    def fits(self, step: StepTensors) -> int | None:
        """The graph size for a pure decode step, or None when it must run eagerly."""
        n = step.input_ids.shape[0]
        if (step.num_decodes != n or step.seq_lens.shape[0] != n or step.logits_indices.shape[0] != n
                or step.copies.shape[0] or step.pool_indices.shape[0] or step.block_tables.shape[1] > self.width):
            return None
        return bucket(n, self.sizes)

    def run(self, step: StepTensors) -> torch.Tensor | None:
        """The step's logits through its graph; None when it has none (run it eagerly)."""
        size = self.fits(step)
        if size is None or size not in self.graphs:
            return None
        n, w = step.input_ids.shape[0], step.block_tables.shape[1]
        self.ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slots[:n].copy_(step.slot_mapping, non_blocking=True)
        self.tables[:n, :w].copy_(step.block_tables, non_blocking=True)
        self.lens[:n].copy_(step.seq_lens, non_blocking=True)
        for g in range(step.group_tables.shape[0]):
            self.group_tables[g, :n, :w].copy_(step.group_tables[g], non_blocking=True)
            self.group_slots[g, :n].copy_(step.group_slots[g], non_blocking=True)
        # the padding: one-token queries at position 0 of block 0 that write nothing
        self.ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(-1)
        self.tables[n:size].zero_()
        self.lens[n:size].fill_(1)
        self.group_tables[:, n:size].zero_()
        self.group_slots[:, n:size].fill_(-1)
        return self.graphs[size]()[:n].clone()  # the graph's buffer is the next replay's output
