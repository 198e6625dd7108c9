"""The engine core: owns the KV cache, the scheduler and the executor that runs the model,
and runs one step at a time. What the sampled tokens then do to each sequence (stops,
forks, beams, speculation's settling) is engine/advance.py's.

Single-threaded by design: the serving layer drives it from one thread and funnels
requests and aborts into it between steps.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections import deque

import torch

from engine import intake, pooling, prompts, scoring, spec
from engine.advance import SequenceAdvancer
from engine.compiling import CompileWaits
from engine.beam import BeamSearch
from engine.config import EngineConfig, Placement
from engine.detokenizer import Detokenizer
from engine.errors import ParamError
from engine.executor import create_executor
from engine.kv_cache_manager import KVCacheManager
from engine.models import loader
from engine.messages import CompletionDelta, ModelInfo, RequestDelta, StepOutput
from engine.pooling import PoolingParams
from engine.request import Request
from engine.runner import StepInput, StepLogits, prepare, split_result
from engine.sampler import Sampler, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Batch, Scheduler
from engine.stats import EngineStats, StatsTracker, StepStats
from engine.structured import Grammars


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from engine.models import quantize

        config = quantize.settle(config)  # what "auto" stands for here, for every layer below
        self.config = config
        files = loader.resolve(config.model, loader.reads_blocks(config.quantization, config.tensor_parallel_size))
        hf_config = loader.load_config(files)
        placement = Placement.resolve(config, hf_config)
        self.model_name = config.model or loader.DEFAULT_MODEL_NAME
        self.hf_config = hf_config
        self.tokenizer = loader.load_tokenizer(files)
        generation = loader.load_generation_config(files)
        self.eos_token_ids = loader.eos_token_ids(hf_config, generation, self.tokenizer)
        self.sampling_defaults = loader.sampling_defaults(generation)
        self.hf_id = loader.hf_id(files)
        # Embeddings: the config's pooler, else a sentence-transformers checkpoint's own.
        self.pooler = config.pooler or pooling.from_checkpoint(files.path, hf_config)
        # Scores: a sequence-classification checkpoint's head, or the config's yes/no tokens.
        # Such a checkpoint has no LM head: it scores and embeds, and generates nothing.
        self.generates = not scoring.is_classifier(hf_config)
        scorer = config.scorer or (scoring.ScorerConfig() if not self.generates else None)
        self.score_template = scorer.template if scorer is not None else None
        self.score_head = scoring.head(files, hf_config, self.tokenizer, scorer) if scorer else None

        sc = config.speculative_config
        draft = spec.check(config, placement, files, hf_config, self.tokenizer)

        # Builds the model; the KV pool is sized from what is left once the weights are in.
        self.executor, resolved = create_executor(config, placement, files, hf_config,
                                                  draft.block_bytes(config.block_size) if draft else 0)
        self.resolved = resolved
        self.device, self.dtype = resolved.device, resolved.dtype
        self.max_model_len = resolved.max_model_len
        self.kv_manager = KVCacheManager(resolved.num_blocks, config.block_size, config.enable_prefix_caching,
                                         resolved.kv_groups.windows, resolved.state_slots)
        self.max_num_seqs = resolved.max_num_seqs(config)
        self.scheduler = Scheduler(self.kv_manager, self.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, sc.num_speculative_tokens if sc else 0,
                                   sc.disable_by_batch_size if sc else None, sc.max_batch_rows if sc else None)
        self._inflight: deque[tuple[Batch, StepInput]] = deque()  # submitted, logits not yet taken
        self.grammars = Grammars(self.tokenizer, hf_config.vocab_size, self.eos_token_ids,
                                 timeout_s=config.grammar_compile_timeout_s)
        self.compiles = CompileWaits(self.grammars)  # requests whose constraint is compiling
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed, grammars=self.grammars)
        self.proposer = None if sc is None else spec.create(
            sc, draft, config, placement, resolved.num_blocks, resolved.attention_backend, self.kv_manager,
            make_generator(config.seed + 1), self.executor.runner.cores)
        self.requests: dict[str, Request] = {}
        self.advancer = SequenceAdvancer(self.requests, self.scheduler, self.kv_manager, self.sampler, self.grammars,
                                         self.tokenizer, self.eos_token_ids, self.max_model_len, self.proposer)
        self.tracker = StatsTracker(self.scheduler, self.kv_manager, config.quantization,
                                    self.executor.weight_bytes(hf_config, resolved.dtype),
                                    sc.method if sc else None, sc.num_speculative_tokens if sc else 0)
        # Everything built so far (model, tokenizer, modules) lives as long as the engine:
        # keep it out of the collector's scans, which otherwise stall steps at random.
        gc.collect()
        gc.freeze()
        # ...but hand them back at exit: extension modules that count their live objects at
        # teardown (nanobind's, Triton's bindings which torch imports when Triton is installed)
        # would otherwise print pages of "leaked" lines for objects the collector never saw.
        atexit.register(gc.unfreeze)

    def info(self) -> ModelInfo:
        """The facts a client needs once, at start."""
        return ModelInfo(self.model_name, self.hf_id, self.max_model_len, self.hf_config.vocab_size,
                         self.sampling_defaults, self.stats(),
                         self.hf_config.hidden_size if self.pooler is not None else None,
                         self.score_head is not None, self.score_template)

    # -- requests -----------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompts.encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> bool:
        """Queue a request. `params` were validated where the request entered (LLM.generate,
        AsyncLLM.generate: SamplingParams.validate); this raises
        ParamError naming the field for what only the engine can check (engine/intake.py).
        `priority` orders the queue when the config's scheduling_policy is "priority".

        With `pooling_params` it is an embedding request: its prompt is pooled (the engine's
        pooler) and nothing is sampled; `params` are then ignored.

        False when its constraint is still compiling (off this thread): `compiles.poll`
        says when it has been queued, or why it failed."""
        if pooling_params is not None:
            self._check_pooling(pooling_params)
            params = SamplingParams(max_tokens=1, temperature=0.0)
        elif not self.generates:
            raise ParamError("model", f"{self.model_name} is a sequence-classification checkpoint: it has no "
                             "LM head to generate with; it serves scores (and embeddings with a pooler)")
        params = params or SamplingParams()
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ParamError("priority", "priority needs the engine's scheduling_policy to be \"priority\"")
        if request_id in self.requests or request_id in self.compiles:
            raise ParamError("request_id", f"request_id {request_id!r} is already in use")
        if params.use_beam_search and self.config.speculative_config is not None:
            raise ParamError("use_beam_search", "beam search cannot run on an engine with speculative_config")
        token_ids = self.tokenize(prompt)
        admitted = intake.admit(token_ids, params, vocab_size=self.hf_config.vocab_size,
                                max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                                tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids, device=self.device,
                                pooling=pooling_params is not None)

        def queue() -> None:
            self._queue(request_id, token_ids, params, admitted, cache_salt, priority, pooling_params)

        if params.structured is not None:
            return self.compiles.start(request_id, params.structured, queue)
        queue()
        return True

    def _check_pooling(self, params: PoolingParams) -> None:
        if params.task == "score":
            if self.score_head is None:
                raise ParamError("model", f"{self.model_name} serves no scores: serve a sequence-classification "
                                 "checkpoint, or set engine.scorer (classifier_from_token) in its preset")
            return
        if self.pooler is None:
            raise ParamError("model", f"{self.model_name} serves no embeddings: set engine.pooler "
                             "(last or mean pooling) in its preset, or serve an embedding checkpoint")
        pooling.check(params, self.pooler, self.hf_config.hidden_size)

    def _queue(self, request_id: str, token_ids: list[int], params: SamplingParams, admitted: intake.Admitted,
               cache_salt: str | None, priority: int, pooling_params: PoolingParams | None = None) -> None:
        now = time.monotonic()
        seq = self.advancer.new_seq(request_id, token_ids, params, admitted, 0, cache_salt, now)
        seq.priority = priority
        req = Request(request_id, params, [seq], [Detokenizer(self.tokenizer, token_ids, params)], now,
                      pending_forks=0 if params.use_beam_search else params.n - 1)
        if pooling_params is not None:
            seq.pool = "last" if pooling_params.task == "score" else self.pooler.pooling_type  # type: ignore[union-attr]
            req.pooling = pooling_params
        if params.use_beam_search:
            req.beam = BeamSearch(params.n, admitted.max_tokens, params.length_penalty, params.early_stopping,
                                  frozenset(() if params.ignore_eos else self.eos_token_ids),
                                  frozenset(params.stop_token_ids))
            seq.group = req.seqs
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        self.compiles.drop(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.pending_forks = 0
        for seq in req.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                if req.beam is None:
                    req.delta(seq).finish_reason = "abort"
                self.advancer.retire(seq)
        if req.beam is not None:
            req.deltas = {i: CompletionDelta(i, finish_reason="abort") for i in range(req.params.n)}
        return req.take_output()

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
        logits, sample, and report what changed in every request that did."""
        self.executor.check()
        depth = self.executor.depth
        share = None
        if depth > 1:  # one batch per stage: each takes its share of the sequences
            share = -(-(self.scheduler.num_running + self.scheduler.num_waiting) // depth)
        batch = self.scheduler.schedule(share)
        stats = StepStats(preemptions=batch.num_preempted, prefix_cache_query_tokens=batch.prefix_query_tokens,
                          prefix_cache_hit_tokens=batch.prefix_hit_tokens)
        outputs: list[RequestDelta] = []
        if batch.seqs:
            self._propose(batch)
            step = prepare(batch, self.kv_manager)
            for seq in batch.seqs:
                seq.in_flight = True
            self.executor.submit(step.tensors)
            self._inflight.append((batch, step))
        if self._inflight and (len(self._inflight) >= depth or not batch.seqs):
            done, step = self._inflight.popleft()
            outputs = self._complete(done, step, *split_result(self.executor.result()), stats)
        self.tracker.gauges(stats)
        self.tracker.add(stats)
        return StepOutput(outputs, stats)

    def _propose(self, batch: Batch) -> None:
        """Fill the speculative positions the scheduler allowed; a sequence's query shrinks to
        what was proposed (its spare slots stay allocated and serve its next tokens)."""
        at = [i for i, allow in enumerate(batch.spec_allow) if allow]
        if not at or self.proposer is None:
            return
        seqs = [batch.seqs[i] for i in at]
        self.proposer.propose(seqs, [batch.spec_allow[i] for i in at], batch.copies)
        for i, seq in zip(at, seqs):
            batch.num_new[i] = 1 + len(seq.spec_token_ids)

    def _complete(self, batch: Batch, step: StepInput, logits: torch.Tensor, pooled: torch.Tensor | None,
                  stats: StepStats) -> list[RequestDelta]:
        for seq, n in zip(batch.seqs, batch.num_new):
            seq.in_flight = False
            if seq.finished:  # aborted while its batch was in flight
                continue
            stats.prompt_tokens_computed += max(0, min(n, seq.num_prompt_tokens - seq.num_computed_tokens))
            seq.num_computed_tokens += n
        self.tracker.track_waste()
        embedded = self._pool(step, pooled, stats) if step.pool_spans else []
        k = sum(step.rows)
        out = StepLogits(logits[:k], step.sampling, step.rows, step.prompt_spans, logits[k:])
        row = 0
        for seq, first, count in out.prompt_spans:
            req = self.requests.get(seq.request_id)
            if req is not None and not seq.finished:  # else aborted while in flight
                req.score_prompt(seq, first, out.prompt_logits[row:row + count])
            row += count
        return embedded + self.advancer.advance(out, stats)

    def _pool(self, step: StepInput, pooled: torch.Tensor | None, stats: StepStats) -> list[RequestDelta]:
        """Fold this step's hidden-state rows into each embedding request's pooling; a request
        whose prompt is now computed gets its vector and ends, freeing its blocks at once."""
        assert pooled is not None
        pooled = pooled.float()
        outputs, row, now = [], 0, time.monotonic()
        for seq, first, count in step.pool_spans:
            rows, row = pooled[row:row + count], row + count
            req = self.requests.get(seq.request_id)
            if req is None or seq.finished or req.pooling is None:  # aborted while in flight
                continue
            if seq.pool == "mean":  # a preempted prompt is recomputed from its start
                total = rows.sum(0)
                seq.pool_sum = total if first == 0 else seq.pool_sum + total
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue
            vector = rows[-1] if seq.pool == "last" else seq.pool_sum / seq.num_prompt_tokens
            if req.pooling.task == "score":
                req.pooled = scoring.scores(self.score_head, vector)  # type: ignore[arg-type]
            else:
                req.pooled = pooling.finish(vector, req.pooling, self.pooler)  # type: ignore[arg-type]
            seq.finish_reason = req.delta(seq).finish_reason = "stop"
            req.metrics.first_token_time, req.metrics.first_scheduled_time = now, seq.first_scheduled_time
            stats.prompt_tokens += seq.num_prompt_tokens
            self.advancer.retire(seq)
            del self.requests[req.request_id]
            outputs.append(req.take_output())
        return outputs

    # -- statistics ---------------------------------------------------------------
    def gauges(self) -> StepStats:
        """Only the O(1) gauges, for callers that changed state outside a step (an abort)."""
        return self.tracker.gauges()

    def stats(self) -> EngineStats:
        """Read now: call it between steps (the serving layer asks on the engine thread)."""
        return self.tracker.snapshot()

    def reset_prefix_cache(self) -> None:
        self.kv_manager.reset_prefix_cache()
