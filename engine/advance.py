"""The step's second half: what the sampled tokens do to the sequences.

The engine (engine.py) schedules a batch and runs the model; with the logits back, this
samples each row (verifying speculated tokens against them), appends what was chosen,
applies the stops and the grammar, forks n > 1 samples and beam candidates onto shared
blocks, settles speculation's KV positions, and reports what changed in each request.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from typing import Any

from engine import intake, stopping
from engine.kv_cache_manager import KVCacheManager
from engine.messages import RequestDelta, TokenLogprobs
from engine.rejection_sampler import Draft, Verdict
from engine.request import Request
from engine.runner import StepLogits
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.stats import StepStats
from engine.structured import Grammars


def _child_seed(seed: int, index: int) -> int:
    """Sample `index` of a seeded n > 1 request draws from a seed of its own, derived from
    the request's: each sample is reproducible alone, and no two share a stream."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class SequenceAdvancer:
    def __init__(self, requests: dict[str, Request], scheduler: Scheduler, kv_manager: KVCacheManager,
                 sampler: Sampler, grammars: Grammars, tokenizer: Any, eos_token_ids: list[int],
                 max_model_len: int, proposer: Any) -> None:
        self.requests = requests  # the engine's own dict: both see every request
        self.scheduler, self.kv_manager, self.sampler, self.grammars = scheduler, kv_manager, sampler, grammars
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, eos_token_ids, max_model_len
        self.proposer = proposer
        self._seq_ids = itertools.count()

    def new_seq(self, request_id: str, token_ids: list[int], params: SamplingParams, admitted: intake.Admitted,
                index: int, cache_salt: str | None, now: float) -> Sequence:
        gen = make_generator(_child_seed(params.seed, index)) if params.seed is not None else None
        matcher = self.grammars.matcher(params.structured) if params.structured is not None else None
        return Sequence(next(self._seq_ids), request_id, index, token_ids, params, admitted.max_tokens,
                        generator=gen, cache_salt=cache_salt, arrival_time=now, matcher=matcher,
                        rules=admitted.rules)

    def advance(self, out: StepLogits, stats: StepStats) -> list[RequestDelta]:
        """Sample (or verify) every row of the step, append what was chosen, and report
        each request that changed."""
        rows: list[SamplingRow] = []
        row_seqs: list[Sequence] = []
        drafts: list[Draft] = []
        logit_rows: list[int] = []
        beams: dict[str, Request] = {}
        first = 0
        for seq, n in zip(out.sampling, out.rows):
            if not seq.finished:  # else aborted while in flight
                req = self.requests[seq.request_id]
                if req.beam is not None:
                    req.beam.offer(seq, out.logits[first])
                    beams[req.request_id] = req
                    first += n
                    continue
                family = [seq, *self._fork(req, seq)] if n == 1 else [seq]
                for s in family:
                    spec_ids, done = s.spec_token_ids, s.output_token_ids
                    for j in range(n):
                        outputs = done + spec_ids[:j] if j else done
                        rows.append(SamplingRow(s.params, s.generator, s.prompt_token_ids, outputs, s.matcher,
                                                s.rules, spec_ids[:j]))
                        logit_rows.append(first + j)
                    row_seqs.append(s)
                    drafts.append(Draft(spec_ids, s.spec_probs))
            first += n
        changed: dict[str, Request] = {}
        now = time.monotonic()
        for req in beams.values():
            if req.beam.ready(req.seqs):  # type: ignore[union-attr]
                self._beam_step(req, now, stats)
                if req.finished:
                    changed[req.request_id] = req
        verdicts = []
        if rows:
            logits = out.logits if len(logit_rows) == out.logits.shape[0] else out.logits[logit_rows]
            verdicts = self.sampler.verify(logits, rows, drafts)
        for seq, draft, verdict in zip(row_seqs, drafts, verdicts):
            req = self.requests[seq.request_id]
            if draft.tokens:
                self._settle(seq, draft, verdict, stats)
            lps = verdict.logprobs or [None] * len(verdict.token_ids)
            for tok, lp in zip(verdict.token_ids, lps):
                self._append(seq, req, tok, lp, now, stats)
                stats.generation_tokens += 1
                if seq.finished:  # a stop inside an accepted run: nothing after it is emitted
                    break
            if verdict.no_token and not seq.finished:
                self._end(seq, req, f"no token is left to sample: {intake.constraints(seq.params)} exclude "
                          f"every token after {seq.num_output_tokens} generated")
            elif verdict.not_finite and not seq.finished:
                self._end(seq, req, f"the next token's scores are not finite numbers (NaN or infinity) after "
                          f"{seq.num_output_tokens} generated: the model overflowed under these sampling settings")
            changed[req.request_id] = req
        outputs = []
        for req in changed.values():
            if req.finished:
                del self.requests[req.request_id]
            outputs.append(req.take_output())
        return outputs

    def _settle(self, seq: Sequence, draft: Draft, verdict: Verdict, stats: StepStats) -> None:
        """The rejected proposals' KV positions become free to overwrite: the computed count
        moves back by them (their slots stay the sequence's; their tokens were never hashed)."""
        seq.num_computed_tokens -= len(draft.tokens) - verdict.num_accepted
        seq.spec_token_ids, seq.spec_probs = [], None
        stats.spec_drafts += 1
        stats.spec_draft_tokens += len(draft.tokens)
        stats.spec_accepted_tokens += verdict.num_accepted
        for j in range(verdict.num_accepted):
            stats.spec_accepted_per_pos[j] = stats.spec_accepted_per_pos.get(j, 0) + 1

    def _fork(self, req: Request, parent: Sequence) -> list[Sequence]:
        children = req.fork(parent, lambda i: self.new_seq(
            req.request_id, parent.prompt_token_ids, req.params,
            intake.Admitted(parent.max_tokens, parent.rules), i, parent.cache_salt, req.arrival_time))
        for child in children:
            self.kv_manager.fork(parent, child)
            self.scheduler.add_running(child)
        return children

    def _beam_step(self, req: Request, now: float, stats: StepStats) -> None:
        """One token for every beam: survivors fork from their parents (sharing blocks,
        copy-on-write), beams with no survivor free their blocks at once."""
        beam, live = req.beam, list(req.seqs)
        assert beam is not None
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time, req.metrics.first_scheduled_time = now, live[0].first_scheduled_time
            stats.prompt_tokens += live[0].num_prompt_tokens
        chosen = beam.step(live)
        stats.generation_tokens += len(live)
        parents = {c.parent.seq_id for c in chosen}
        for seq in live:
            if seq.seq_id not in parents:
                beam.cum.pop(seq.seq_id, None)
                self.retire(seq)
        if beam.done:
            req.deltas = {d.index: d for d in beam.outputs(self.tokenizer, live[0].prompt_token_ids, req.params)}
            return
        # A parent carries its best continuation on; the others fork from it, every fork
        # copying the parent's tokens before any token is appended.
        seats: list[Sequence] = []
        for c in chosen:
            seats.append(c.parent if all(s is not c.parent for s in seats) else self._fork_beam(req, c.parent))
        for c, seq in zip(chosen, seats):
            seq.token_ids.append(c.token)
            beam.cum[seq.seq_id] = c.cum_logprob
        req.seqs[:] = seats  # best first, as transformers orders its beams

    def _fork_beam(self, req: Request, parent: Sequence) -> Sequence:
        child = self.new_seq(req.request_id, parent.prompt_token_ids, req.params,
                              intake.Admitted(parent.max_tokens, parent.rules), 0, parent.cache_salt, req.arrival_time)
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens, child.num_cached_tokens = parent.num_computed_tokens, parent.num_cached_tokens
        child.num_preemptions, child.first_scheduled_time = parent.num_preemptions, parent.first_scheduled_time
        child.priority, child.group = parent.priority, req.seqs
        self.kv_manager.fork(parent, child)
        if parent.status is Status.RUNNING:
            self.scheduler.add_running(child)
        else:  # preempted after its row was computed: the child waits to be recomputed with it
            self.scheduler.add(child)
        return child

    def _append(self, seq: Sequence, req: Request, tok: int, lp: TokenLogprobs | None, now: float,
                stats: StepStats) -> None:
        seq.token_ids.append(tok)
        delta = req.delta(seq)
        delta.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
            delta.logprobs.append(lp)  # type: ignore[union-attr]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            req.metrics.first_scheduled_time = seq.first_scheduled_time
            stats.prompt_tokens += seq.num_prompt_tokens
        if seq.matcher is not None and not seq.matcher.accept(tok):  # the mask allowed it: never expected
            self._end(seq, req, "the structured-output grammar refused the sampled token")
            return
        verdict = stopping.after_token(seq, tok, req.detoks[seq.index], self.eos_token_ids, self.max_model_len)
        delta.text += verdict.text
        if verdict.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = verdict.finish_reason, verdict.stop_reason
            delta.finish_reason, delta.stop_reason = verdict.finish_reason, verdict.stop_reason
            self.retire(seq)

    def _end(self, seq: Sequence, req: Request, why: str) -> None:
        """End a sequence whose own constraints leave it nothing valid to generate: an
        "abort" with the reason, never a made-up token."""
        seq.finish_reason, seq.error = "abort", why
        delta = req.delta(seq)
        delta.text += req.detoks[seq.index].flush()
        delta.finish_reason, delta.error = "abort", why
        self.retire(seq)

    def retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        if self.proposer is not None:
            self.proposer.finish(seq)
