"""Iteration-level scheduling with a token budget, chunked prefill and preemption.

There are no prefill and decode phases. Every sequence knows some tokens and has
computed KV for some of them; each step it is given up to the gap between the two,
within the step's token budget. A long prompt simply takes several steps (chunked
prefill) while running sequences keep decoding in the same forward pass.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.sequence import Sequence, Status


@dataclass
class Batch:
    """What one step computes: each sequence with the number of new tokens it gets."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks to copy first
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots, likewise
    # Per sequence: how many speculative tokens it may propose; its num_new already counts them.
    spec_allow: list[int] = field(default_factory=list)
    # What scheduling this step did, as increments.
    num_preempted: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    def __len__(self) -> int:
        return len(self.seqs)


# The prompt positions one step scores for prompt_logprobs, in all: each is a row of
# logits over the whole vocabulary (a 2,048-token chunk of a 128K-vocabulary model is 1 GB
# of fp32 that no KV sizing reserved), so a prompt that asks is computed this many
# positions a step, while the other sequences' tokens fill the rest of the budget.
PROMPT_LOGPROB_ROWS = 256
UNBOUNDED = 1 << 62


def _scored(seq: Sequence, num_new: int, computed: int | None = None) -> int:
    """How many of num_new positions score seq's prompt: position p scores token p + 1, so
    the prompt's last position scores nothing (it predicts the first output)."""
    if seq.params.prompt_logprobs is None:
        return 0
    c = seq.num_computed_tokens if computed is None else computed
    return max(0, min(c + num_new, seq.num_prompt_tokens - 1) - c)


def _scored_room(seq: Sequence, room: int, computed: int | None = None) -> int:
    """The most new tokens seq may take with `room` scored rows left in the step."""
    c = seq.num_computed_tokens if computed is None else computed
    to_score = seq.num_prompt_tokens - 1 - c if seq.params.prompt_logprobs is not None else 0
    return UNBOUNDED if to_score <= room else max(0, room)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", num_spec: int = 0, spec_max_batch: int | None = None,
                 spec_max_rows: int | None = None) -> None:
        self.kv_manager = kv_manager
        # Speculative decoding: a decoding sequence may get num_spec extra query positions (and
        # their KV slots) while no more than spec_max_batch sequences run, and no more than
        # spec_max_rows // running - 1 each.
        self.num_spec = num_spec
        self.spec_max_batch = spec_max_batch
        self.spec_max_rows = spec_max_rows
        self.by_priority = policy == "priority"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        if self.by_priority:
            self._insert(seq)
        else:
            self.waiting.append(seq)

    def _insert(self, seq: Sequence) -> None:
        """Into the waiting queue in (priority, arrival) order."""
        key = _rank(seq)
        at = next((i for i, other in enumerate(self.waiting) if _rank(other) > key), len(self.waiting))
        self.waiting.insert(at, seq)

    def add_running(self, seq: Sequence) -> None:
        """Seat a sequence whose KV already exists (a fork of a running one)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None) -> Batch:
        """The next batch; `max_seqs` caps its sequences, so that a pipeline's stages each get
        a share of the running ones instead of one batch holding them all."""
        batch = Batch()
        cap = max_seqs or self.max_num_seqs
        budget = self.max_num_batched_tokens
        kv = self.kv_manager

        # Running sequences first, oldest (or most urgent) first; the newest (or least urgent)
        # give way when blocks run out.
        if self.by_priority:
            self.running.sort(key=_rank)
        spec = self.num_spec
        if self.spec_max_batch is not None and len(self.running) > self.spec_max_batch:
            spec = 0
        if self.spec_max_rows is not None:
            spec = min(spec, max(0, self.spec_max_rows // max(1, len(self.running)) - 1))
        scheduled: set[int] = set()
        scored = PROMPT_LOGPROB_ROWS  # prompt positions this step may still score
        for seq in list(self.running):  # a copy: preemption takes sequences out of running
            if budget <= 0 or len(batch.seqs) >= cap:
                break
            if seq.status is not Status.RUNNING or seq.in_flight or seq.seq_id in scheduled:
                continue
            gap = seq.num_tokens - seq.num_computed_tokens
            if gap == 0:
                continue  # a beam whose next-token row waits for its siblings' (engine/beam.py)
            # A request's decoding beams go together, or wait together for the next step.
            unit = self._unit(seq, scheduled) if gap == 1 and seq.group is not None else [seq]
            if len(unit) > 1 and (len(unit) > budget or len(batch.seqs) + len(unit) > cap):
                break
            nums = [1] * len(unit) if len(unit) > 1 else [min(gap, budget, _scored_room(seq, scored))]
            if not nums[0]:
                continue  # its prompt's scores wait for the next step's rows
            allow = 0
            if spec and len(unit) == 1 and gap == 1:
                # never past max_tokens: the step emits at most allow + 1 tokens
                allow = max(0, min(spec, budget - 1, seq.max_tokens - seq.num_output_tokens - 1))
                nums[0] += allow
            if not self._allocate(unit, nums, batch, scheduled):
                break  # the unit itself was preempted: nothing after it was still running
            for member, num_new in zip(unit, nums):
                batch.seqs.append(member)
                batch.num_new.append(num_new)
                batch.spec_allow.append(allow)
                scheduled.add(member.seq_id)
                budget -= num_new
                scored -= _scored(member, num_new)

        # Then admit waiting sequences, unless this step already had to preempt.
        while self.waiting and budget > 0 and not batch.num_preempted and len(batch.seqs) < cap:
            seq = self.waiting[0]
            # A fresh n>1 request forks into n sequences once its prompt is computed.
            seats = seq.params.n if seq.num_output_tokens == 0 else 1
            if len(self.running) + seats > self.max_num_seqs:
                break
            cached = kv.find_cached(seq)
            num_cached = len(cached) * kv.block_size
            num_new = min(seq.num_tokens - num_cached, budget, _scored_room(seq, scored, num_cached))
            if not num_new or not kv.allocate(seq, num_new, cached):
                break
            scored -= _scored(seq, num_new, num_cached)
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                batch.prefix_query_tokens += seq.num_tokens
                batch.prefix_hit_tokens += num_cached
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new.append(num_new)
            batch.spec_allow.append(0)
            budget -= num_new

        batch.copies = kv.take_copies()
        batch.state_copies = kv.take_state_copies()
        return batch

    def _unit(self, seq: Sequence, scheduled: set[int]) -> list[Sequence]:
        """seq and its beam siblings that are running, decoding and not yet in a batch."""
        return [m for m in seq.group or [seq] if m.status is Status.RUNNING and not m.in_flight
                and m.seq_id not in scheduled and m.num_tokens - m.num_computed_tokens == 1]

    def _allocate(self, unit: list[Sequence], nums: list[int], batch: Batch, scheduled: set[int]) -> bool:
        """Blocks for every sequence of the unit, preempting from the back of the running
        list until they fit; False if the unit itself had to give way."""
        kv = self.kv_manager
        while not all(kv.allocate(member, n) for member, n in zip(unit, nums)):
            gone = self._preempt(self._victim(scheduled), scheduled)
            batch.num_preempted += len(gone)
            if any(member in gone for member in unit):
                return False
        return True

    def _victim(self, scheduled: set[int]) -> Sequence:
        """The last running sequence neither in flight nor in this batch (the unit being
        scheduled is neither)."""
        at = next(j for j in range(len(self.running) - 1, -1, -1)
                  if not self.running[j].in_flight and self.running[j].seq_id not in scheduled)
        return self.running.pop(at)

    def _preempt(self, victim: Sequence, scheduled: set[int]) -> list[Sequence]:
        """Free what the victim holds and, for a beam, what its siblings hold (those not in
        flight or in this batch): a request's beams wait and come back together."""
        gone = [victim]
        for member in victim.group or ():
            if (member is not victim and member.status is Status.RUNNING and not member.in_flight
                    and member.seq_id not in scheduled):
                self.running.remove(member)
                gone.append(member)
        for seq in gone:
            self._requeue(seq)
        return gone

    def _requeue(self, seq: Sequence) -> None:
        """Free everything the sequence holds; it is recomputed from its known tokens later."""
        self.kv_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.spec_token_ids, seq.spec_probs = [], None
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        if self.by_priority:
            self._insert(seq)  # ahead of later arrivals of its priority
        else:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.kv_manager.free(seq)

    def kv_fill(self) -> tuple[int, int]:
        """(allocated slots, stored tokens) over the running sequences: the waste measure."""
        allocated = stored = 0
        for seq in self.running:
            allocated += self.kv_manager.num_slots(seq)
            stored += self.kv_manager.num_stored(seq)
        return allocated, stored


def _rank(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id
