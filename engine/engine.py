"""The engine core: owns the model, the KV cache and the scheduler, and runs one step at a time.

Single-threaded by design: AsyncLLM drives it from one thread and funnels requests and
aborts into it between steps.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field, replace

import torch

from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.models import loader
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.request import Request, Status
from engine.runner import ModelRunner, kv_block_bytes
from engine.sampler import Sampler, SamplingRow, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

CPU_KV_DEFAULT_BYTES = 2 << 30


@dataclass(eq=False)
class Group:
    """A user request: n sequences that share a prompt, forked once the prompt is computed."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Request]
    detoks: list[Detokenizer]
    arrival_time: float
    pending_forks: int = 0
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time)

    @property
    def finished(self) -> bool:
        return self.pending_forks == 0 and all(s.finished for s in self.seqs)


def _child_seed(seed: int, index: int) -> int:
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.dtype = _resolve_dtype(config.dtype, self.device)
        files = loader.resolve(config.model)
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.hf_config = loader.load_config(files)
        self.tokenizer = loader.load_tokenizer(files)
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer)

        block_bytes = kv_block_bytes(self.hf_config, config.block_size, self.dtype)
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        model = loader.build_model(
            None if config.load_format == "dummy" else files, self.hf_config, self.dtype, self.device,
            max_positions=max(max_pos, config.max_model_len or 0), dummy=config.load_format == "dummy",
            seed=config.seed,
        )
        num_blocks = self._num_blocks(block_bytes)
        capacity = num_blocks * config.block_size
        self.max_model_len = config.max_model_len or min(max_pos, capacity)
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) needs {cdiv(self.max_model_len, config.block_size)} "
                f"KV blocks but kv_cache_memory_bytes only holds {num_blocks}; raise the memory or lower it"
            )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv, num_blocks, self.dtype, self.device, config.attention_backend)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.groups: dict[str, Group] = {}
        self._seq_group: dict[str, Group] = {}
        self._waste_sum = 0.0
        self._prompt_tokens_computed = 0  # prompt tokens that went through the model
        self._waste_steps = 0

    def _num_blocks(self, block_bytes: int) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.gpu_memory_utilization)
            else:
                budget = CPU_KV_DEFAULT_BYTES
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({budget}) is smaller than one KV block ({block_bytes} bytes)"
            )
        return num_blocks

    # -- requests -----------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError naming the field if it can never run."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt has {n_prompt} tokens; max_model_len is {self.max_model_len}, which must also leave room "
                "for at least one generated token"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - n_prompt
        elif n_prompt + max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens ({max_tokens}) plus the prompt's {n_prompt} tokens exceeds max_model_len "
                f"({self.max_model_len})"
            )
        params = replace(params, max_tokens=max_tokens)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})")
        now = time.monotonic()
        seq = self._new_seq(f"{request_id}#0", token_ids, params, 0, cache_salt, now)
        group = Group(request_id, prompt if isinstance(prompt, str) else None, params, [seq],
                      [Detokenizer(self.tokenizer, token_ids, params)], now, pending_forks=params.n - 1)
        self.groups[request_id] = group
        self._seq_group[seq.request_id] = group
        self.scheduler.add(seq)

    def _new_seq(self, seq_id, token_ids, params, index, cache_salt, now) -> Request:
        gen = make_generator(_child_seed(params.seed, index)) if params.seed is not None else None
        return Request(seq_id, token_ids, params, generator=gen, cache_salt=cache_salt, arrival_time=now)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks. Unknown or finished ids are ignored."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        group.pending_forks = 0
        for seq in group.seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return self._pop_output(group)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # -- the step -----------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and report every request that changed."""
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        logits, sampling = self.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_new):
            self._prompt_tokens_computed += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
            req.num_computed_tokens += n
        self._track_waste()

        rows, row_of, logit_rows = [], [], []
        for i, req in enumerate(sampling):
            for seq in [req, *self._fork(req)]:
                rows.append(SamplingRow(seq.params, seq.generator, seq.prompt_token_ids, seq.output_token_ids))
                row_of.append(seq)
                logit_rows.append(i)
        if len(logit_rows) != len(sampling):
            logits = logits[logit_rows]
        out = self.sampler(logits, rows)

        changed: dict[str, Group] = {}
        now = time.monotonic()
        for seq, tok, lp in zip(row_of, out.token_ids, out.logprobs):
            group = self._seq_group[seq.request_id]
            self._append(seq, group, tok, lp, now)
            changed[group.request_id] = group
        return [self._pop_output(g) if g.finished else self._output(g) for g in changed.values()]

    def _fork(self, parent: Request) -> list[Request]:
        """Once the shared prompt is computed, split off the other n-1 sequences."""
        group = self._seq_group[parent.request_id]
        if group.pending_forks == 0 or parent.num_output_tokens > 0:
            return []
        children = []
        for i in range(1, group.pending_forks + 1):
            child = self._new_seq(f"{group.request_id}#{i}", parent.prompt_token_ids, group.params, i,
                                  parent.cache_salt, group.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = Status.RUNNING
            self.kv.fork(parent, child)
            self.scheduler.running.append(child)
            group.seqs.append(child)
            group.detoks.append(Detokenizer(self.tokenizer, parent.prompt_token_ids, group.params))
            self._seq_group[child.request_id] = group
            children.append(child)
        group.pending_forks = 0
        return children

    def _append(self, seq: Request, group: Group, tok: int, lp, now: float) -> None:
        seq.token_ids.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = now
            group.metrics.first_scheduled_time = seq.first_scheduled_time
        params = seq.params
        detok = group.detoks[group.seqs.index(seq)]
        if not params.ignore_eos and tok in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif tok in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tok
        else:
            detok.update([tok])
            if detok.stopped:
                seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            if not detok.stopped:
                detok.flush()
                if detok.stopped:  # held-back text completed a stop string
                    seq.finish_reason, seq.stop_reason = "stop", detok.stop_reason
            self.scheduler.finish(seq)

    def _output(self, group: Group) -> RequestOutput:
        outs = [
            CompletionOutput(i, d.text, s.output_token_ids, s.finish_reason, s.stop_reason,
                             list(s.logprobs) if s.params.logprobs is not None else None)
            for i, (s, d) in enumerate(zip(group.seqs, group.detoks))
        ]
        first = group.seqs[0]
        return RequestOutput(group.request_id, group.prompt, first.prompt_token_ids, outs, group.finished,
                             first.num_cached_tokens, group.metrics)

    def _pop_output(self, group: Group) -> RequestOutput:
        group.metrics.finished_time = time.monotonic()
        self.groups.pop(group.request_id, None)
        for s in group.seqs:
            self._seq_group.pop(s.request_id, None)
        out = self._output(group)
        out.finished = True
        return out

    # -- introspection ------------------------------------------------------------
    def _kv_fill(self) -> tuple[int, int]:
        """(allocated slots, stored tokens), counted per sequence."""
        allocated = stored = 0
        for req in self.scheduler.running:
            allocated += len(self.kv.tables.get(req.request_id, ())) * self.kv.block_size
            stored += req.num_computed_tokens
        return allocated, stored

    def _track_waste(self) -> None:
        allocated, stored = self._kv_fill()
        if allocated:
            self._waste_sum += (allocated - stored) / allocated
            self._waste_steps += 1

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def stats(self) -> dict[str, float | int]:
        pool = self.kv.pool
        allocated, stored = self._kv_fill()
        return {
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free,
            "blocks_used": pool.num_blocks - pool.num_free,
            "blocks_shared": pool.num_shared,
            "blocks_cached_free": pool.num_cached_free,
            "kv_cache_usage": self.kv.usage,
            "kv_waste": (allocated - stored) / allocated if allocated else 0.0,
            "kv_waste_mean": self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_cache_query_tokens": self.scheduler.prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "prompt_tokens_computed": self._prompt_tokens_computed,
        }


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _eos_ids(config, tokenizer) -> list[int]:
    ids = config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
