"""Iteration-level scheduling with a token budget, chunked prefill and preemption.

There are no prefill and decode phases. Every request knows some tokens and has
computed KV for some of them; each step it is given up to the gap between the two,
within the step's token budget. A long prompt simply takes several steps (chunked
prefill) while running requests keep decoding in the same forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, Status


@dataclass
class Batch:
    """What one step computes: each request with the number of new tokens it gets."""

    requests: list[Request] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        preempted = False

        # Running requests first, oldest first; the newest give way when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_new.append(num_new)
                budget -= num_new
                i += 1
                continue
            break  # req itself was preempted: it was the last one running

        # Then admit waiting requests, unless this step already had to preempt.
        while self.waiting and budget > 0 and not preempted:
            req = self.waiting[0]
            # A fresh n>1 request forks into n sequences once its prompt is computed.
            seats = req.params.n if req.num_output_tokens == 0 else 1
            if len(self.running) + seats > self.max_num_seqs:
                break
            cached = self.kv.find_cached(req)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req, num_new, cached):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
                self.prefix_query_tokens += req.num_tokens
                self.prefix_hit_tokens += num_cached
            req.status = Status.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new.append(num_new)
            budget -= num_new

        batch.copies = self.kv.take_copies()
        return batch

    def _preempt(self, req: Request) -> None:
        """Free everything the request holds; it is recomputed from its known tokens later."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.kv.free(req)
