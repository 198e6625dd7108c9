"""The engine core: owns the KV cache, the scheduler and the executor that runs the model,
and runs one step at a time.

Single-threaded by design: the serving layer drives it from one thread and funnels
requests and aborts into it between steps.
"""

from __future__ import annotations

import atexit
import gc
import hashlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from engine import intake
from engine.config import EngineConfig, Placement
from engine.detokenizer import Detokenizer
from engine.errors import ParamError
from engine.executor import create_executor
from engine.kv_cache_manager import KVCacheManager
from engine.models import loader
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.runner import StepInput, StepLogits, prepare
from engine.sampler import Sampler, SamplingRow, TokenLogprobs, make_generator, token_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats, StepStats
from engine.structured import Grammars


@dataclass
class StepOutput:
    """One step's result: every request that changed, and what the step did."""

    outputs: list[RequestOutput]
    stats: StepStats


def _child_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        files = loader.resolve(config.model)
        hf_config = loader.load_config(files)
        placement = Placement.resolve(config, hf_config)
        self.model_name = config.model or loader.DEFAULT_MODEL_NAME
        self.hf_config = hf_config
        self.tokenizer = loader.load_tokenizer(files)
        self.eos_token_ids = _eos_ids(hf_config, self.tokenizer)
        self.sampling_defaults = loader.load_sampling_defaults(files)  # generation_config.json
        self.hf_id = loader.hf_id(files)

        # Builds the model; the KV pool is sized from what is left once the weights are in.
        self.executor, resolved = create_executor(config, placement, files, hf_config)
        self.resolved = resolved
        self.device, self.dtype = resolved.device, resolved.dtype
        self.max_model_len = resolved.max_model_len
        self.kv_manager = KVCacheManager(resolved.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy)
        self._inflight: deque[tuple[Batch, StepInput]] = deque()  # submitted, logits not yet taken
        self.grammars = Grammars(self.tokenizer, hf_config.vocab_size, self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, grammars=self.grammars)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._totals = StepStats()  # running sums of every step's counters
        self._waste_sum = 0.0
        self._waste_steps = 0
        # Everything built so far (model, tokenizer, modules) lives as long as the engine:
        # keep it out of the collector's scans, which otherwise stall steps at random.
        gc.collect()
        gc.freeze()
        # ...but hand them back at exit: extension modules that count their live objects at
        # teardown (nanobind's, Triton's bindings which torch imports when Triton is installed)
        # would otherwise print pages of "leaked" lines for objects the collector never saw.
        atexit.register(gc.unfreeze)

    # -- requests -----------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt)
        ids = list(prompt)
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request. Raises ParamError naming the field if it can never run.
        `priority` orders the queue when the config's scheduling_policy is "priority"."""
        params = params or SamplingParams()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ParamError("priority", "priority needs the engine's scheduling_policy to be \"priority\"")
        if request_id in self.requests:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ParamError("prompt", "prompt must not be empty")
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ParamError(
                "prompt",
                f"prompt has {n_prompt} tokens; max_model_len is {self.max_model_len}, which must also leave "
                "room for at least one generated token",
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        elif n_prompt + max_tokens > self.max_model_len:
            raise ParamError(
                "max_tokens",
                f"max_tokens ({max_tokens}) plus the prompt's {n_prompt} tokens exceeds max_model_len "
                f"({self.max_model_len})",
            )
        params = replace(params, max_tokens=max_tokens,
                         bad_words_token_ids=intake.bad_words_ids(self.tokenizer, params))
        vocab = self.hf_config.vocab_size
        for name, ids in params.token_ids_used().items():
            if any(t >= vocab for t in ids):
                raise ParamError(name, f"{name} names token ids outside the vocabulary [0, {vocab})")
        intake.check_contradictions(params, self.eos_token_ids)
        if params.structured is not None:
            self.grammars.compile(params.structured)  # an invalid constraint fails here, alone
        if params.n > self.config.max_num_seqs:
            raise ParamError("n", f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        now = time.monotonic()
        seq = self._new_seq(request_id, token_ids, params, 0, cache_salt, now)
        seq.priority = priority
        self.requests[request_id] = Request(
            request_id, prompt if isinstance(prompt, str) else None, params, [seq],
            [Detokenizer(self.tokenizer, token_ids, params)], now, pending_forks=params.n - 1,
        )
        self.scheduler.add(seq)

    def _new_seq(self, request_id: str, token_ids: list[int], params: SamplingParams, index: int,
                 cache_salt: str | None, now: float) -> Sequence:
        gen = make_generator(_child_seed(params.seed, index)) if params.seed is not None else None
        matcher = self.grammars.matcher(params.structured) if params.structured is not None else None
        return Sequence(next(self._seq_ids), request_id, index, token_ids, params, generator=gen,
                        cache_salt=cache_salt, arrival_time=now, matcher=matcher)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.pending_forks = 0
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                req.delta(seq).finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._output(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._inflight)

    def check_health(self) -> None:
        """Raise WorkerDiedError if a parallel worker has gone: no step could run."""
        self.executor.check()

    def shutdown(self) -> None:
        """Stop the parallel workers, if any (idempotent)."""
        self.executor.close()

    # -- the step -----------------------------------------------------------------
    def step(self) -> StepOutput:
        """Schedule and submit a batch, then, once as many batches are in flight as the
        executor has stages (or nothing more could be scheduled), take the oldest one's
        logits, sample, and report every request that changed."""
        self.executor.check()
        depth = self.executor.depth
        share = None
        if depth > 1:  # one batch per stage: each takes its share of the sequences
            share = -(-(self.scheduler.num_running + self.scheduler.num_waiting) // depth)
        batch = self.scheduler.schedule(share)
        stats = StepStats(preemptions=batch.num_preempted, prefix_cache_query_tokens=batch.prefix_query_tokens,
                          prefix_cache_hit_tokens=batch.prefix_hit_tokens)
        outputs: list[RequestOutput] = []
        if batch.seqs:
            step = prepare(batch, self.kv_manager)
            for seq in batch.seqs:
                seq.in_flight = True
            self.executor.submit(step.tensors)
            self._inflight.append((batch, step))
        if self._inflight and (len(self._inflight) >= depth or not batch.seqs):
            done, step = self._inflight.popleft()
            outputs = self._complete(done, step, self.executor.result(), stats)
        self._fill_gauges(stats)
        self._accumulate(stats)
        return StepOutput(outputs, stats)

    def _complete(self, batch: Batch, step: StepInput, logits: torch.Tensor, stats: StepStats
                  ) -> list[RequestOutput]:
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.in_flight = False
            if seq.finished:  # aborted while its batch was in flight
                continue
            stats.prompt_tokens_computed += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            seq.num_computed_tokens += n
        self._track_waste()
        k = len(step.sampling)
        out = StepLogits(logits[:k], step.sampling, step.prompt_spans, logits[k:])
        if out.prompt_spans:
            self._prompt_logprobs(out)
        live = [i for i, seq in enumerate(out.sampling) if not seq.finished]
        if len(live) < k:
            return self._sample(out.logits[live], [out.sampling[i] for i in live], stats)
        return self._sample(out.logits, out.sampling, stats)

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence], stats: StepStats) -> list[RequestOutput]:
        rows, row_seqs, logit_rows = [], [], []
        for i, seq in enumerate(sampling):
            for s in [seq, *self._fork(seq)]:
                rows.append(SamplingRow(s.params, s.generator, s.prompt_token_ids, s.output_token_ids, s.matcher))
                row_seqs.append(s)
                logit_rows.append(i)
        if len(logit_rows) != len(sampling):
            logits = logits[logit_rows]
        out = self.sampler(logits, rows)
        no_token = set(out.no_token)
        stats.generation_tokens = len(row_seqs) - len(no_token)

        changed: dict[str, Request] = {}
        now = time.monotonic()
        for i, (seq, tok, lp) in enumerate(zip(row_seqs, out.token_ids, out.logprobs)):
            req = self.requests[seq.request_id]
            if i in no_token:
                self._end(seq, req, f"no token is left to sample: {intake.constraints(seq.params)} exclude "
                          f"every token after {seq.num_output_tokens} generated")
            else:
                self._append(seq, req, tok, lp, now)
            changed[req.request_id] = req
        return [self._output(r) for r in changed.values()]

    def _prompt_logprobs(self, out: StepLogits) -> None:
        """Extend each request's prompt logprobs by this step's chunk. A sequence recomputing
        its prompt after preemption (or a fork doing so) adds nothing already recorded."""
        row = 0
        for seq, first, count in out.prompt_spans:
            req = self.requests.get(seq.request_id)
            if req is None or seq.finished:  # aborted while in flight
                row += count
                continue
            have = len(req.prompt_logprobs)  # covers tokens [0, have): position have - 1 comes next
            skip = max(0, have - 1 - first)
            if skip < count:
                rows = out.prompt_logits[row + skip:row + count]
                targets = seq.token_ids[first + 1 + skip:first + 1 + count]
                k = seq.params.prompt_logprobs or 0
                req.prompt_logprobs.extend(token_logprobs(rows, targets, [k] * len(targets)))
            row += count

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Once the shared prompt is computed, split off the other n-1 sequences."""
        req = self.requests[parent.request_id]
        if req.pending_forks == 0 or parent.num_output_tokens > 0:
            return []
        children = []
        for i in range(1, req.pending_forks + 1):
            child = self._new_seq(req.request_id, parent.prompt_token_ids, req.params, i, parent.cache_salt,
                                  req.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens
            child.priority = parent.priority
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv_manager.fork(parent, child)
            self.scheduler.add_running(child)
            req.seqs.append(child)
            req.detoks.append(Detokenizer(self.tokenizer, parent.prompt_token_ids, req.params))
            children.append(child)
        req.pending_forks = 0
        return children

    def _append(self, seq: Sequence, req: Request, tok: int, lp: TokenLogprobs | None, now: float) -> None:
        seq.token_ids.append(tok)
        delta = req.delta(seq)
        delta.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
            delta.logprobs.append(lp)  # type: ignore[union-attr]
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            req.metrics.first_scheduled_time = seq.first_scheduled_time
        params = seq.params
        detok = req.detoks[seq.index]
        if seq.matcher is not None and not seq.matcher.accept(tok):  # the mask allowed it: never expected
            self._end(seq, req, "the structured-output grammar refused the sampled token")
            return
        grammar_done = seq.matcher is not None and seq.matcher.done
        if not params.ignore_eos and tok in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        else:
            delta.text += detok.update([tok])
            if detok.stopped:
                seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            elif grammar_done:  # the constraint is complete: nothing may follow
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if not detok.stopped:
                delta.text += detok.flush()
                if detok.stopped:  # held-back text completed a stop string
                    seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
            self.scheduler.finish(seq)

    def _end(self, seq: Sequence, req: Request, why: str) -> None:
        """End a sequence whose own constraints leave it nothing valid to generate: an
        "abort" with the reason, never a made-up token."""
        seq.finish_reason, seq.error = "abort", why
        delta = req.delta(seq)
        delta.text += req.detoks[seq.index].flush()
        delta.finish_reason, delta.error = "abort", why
        self.scheduler.finish(seq)

    def _output(self, req: Request) -> RequestOutput:
        """The request's state now, with the deltas gathered since its last output."""
        finished = req.finished
        if finished:
            req.metrics.finished_time = time.monotonic()
            self.requests.pop(req.request_id, None)
        outs = [
            CompletionOutput(s.index, d.text, s.output_token_ids, s.finish_reason, s.stop_reason,
                             list(s.logprobs) if s.params.logprobs is not None else None,
                             req.deltas.get(s.index), s.error)
            for s, d in zip(req.seqs, req.detoks)
        ]
        req.deltas = {}
        first = req.seqs[0]
        prompt_lps = None
        if (req.prompt_logprobs and not req.prompt_logprobs_sent
                and len(req.prompt_logprobs) == first.num_prompt_tokens):
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(req.request_id, req.prompt, first.prompt_token_ids, outs, finished,
                             first.num_cached_tokens, req.metrics, prompt_lps)

    # -- statistics ---------------------------------------------------------------
    def _track_waste(self) -> None:
        allocated, stored = self.scheduler.kv_fill()
        if allocated:
            self._waste_sum += (allocated - stored) / allocated
            self._waste_steps += 1

    def gauges(self) -> StepStats:
        """Only the O(1) gauges, for callers that changed state outside a step (an abort)."""
        stats = StepStats()
        self._fill_gauges(stats)
        return stats

    def _fill_gauges(self, stats: StepStats) -> None:
        pool = self.kv_manager.pool
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.blocks_free = pool.num_free
        stats.blocks_shared = pool.num_shared
        stats.blocks_cached_free = pool.num_cached_free
        stats.kv_cache_usage = self.kv_manager.usage

    def _accumulate(self, stats: StepStats) -> None:
        t = self._totals
        t.prompt_tokens_computed += stats.prompt_tokens_computed
        t.generation_tokens += stats.generation_tokens
        t.preemptions += stats.preemptions
        t.prefix_cache_query_tokens += stats.prefix_cache_query_tokens
        t.prefix_cache_hit_tokens += stats.prefix_cache_hit_tokens

    def stats(self) -> EngineStats:
        """Read now: call it between steps (the serving layer asks on the engine thread)."""
        pool = self.kv_manager.pool
        allocated, stored = self.scheduler.kv_fill()
        t = self._totals
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
        )

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A text prompt's token ids, special tokens (BOS) included, as transformers adds them."""
    return tokenizer.encode(text, add_special_tokens=True)


def _eos_ids(config, tokenizer) -> list[int]:
    ids = config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
