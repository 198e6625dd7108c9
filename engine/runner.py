"""Turns a scheduled batch into one forward pass over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
import kernels.cpu
from engine.kv_cache_manager import KVCacheManager
from engine.models.llama import AttnMetadata, LlamaForCausalLM, head_dim, num_kv_heads
from engine.scheduler import Batch
from engine.sequence import Sequence


@dataclass
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttnMetadata
    logits_indices: torch.Tensor
    sampling: list[Sequence]  # in the order of the first logits rows
    # (sequence, first position, count) for prompt tokens whose logprobs were asked for;
    # their logits rows follow the sampling rows, in this order.
    prompt_spans: list[tuple[Sequence, int, int]]


@dataclass
class StepLogits:
    logits: torch.Tensor  # fp32, one row per sampling sequence
    sampling: list[Sequence]
    prompt_spans: list[tuple[Sequence, int, int]]
    prompt_logits: torch.Tensor  # fp32, one row per position in prompt_spans: it predicts the next token


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_manager: KVCacheManager,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "auto",
    ) -> None:
        self.model = model
        self.kv_manager = kv_manager
        self.device = device
        self.backend = backend
        self._threads_bound = backend != "native"  # pinned on first use, by the thread that steps
        cfg = model.config
        shape = (num_blocks, kv_manager.block_size, num_kv_heads(cfg), head_dim(cfg))
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_hidden_layers)
        ]

    def prepare(self, batch: Batch) -> StepInput:
        bs = self.kv_manager.block_size
        # Single-token queries go first so they can take the decode kernel.
        order = sorted(range(len(batch)), key=lambda i: batch.num_new[i] != 1)
        reqs = [batch.seqs[i] for i in order]
        num_new = np.array([batch.num_new[i] for i in order], dtype=np.int64)
        computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
        seq_lens = computed + num_new
        num_decodes = int((num_new == 1).sum())

        ids: list[int] = []
        for r, c, n in zip(reqs, computed.tolist(), num_new.tolist()):
            ids.extend(r.token_ids[c : c + n])
        starts = np.concatenate(([0], np.cumsum(num_new)))
        total = int(starts[-1])
        req_of_token = np.repeat(np.arange(len(reqs)), num_new)
        positions = np.arange(total) - starts[req_of_token] + computed[req_of_token]

        tables = [self.kv_manager.block_ids(r) for r in reqs]
        width = max(len(t) for t in tables)
        table_np = np.zeros((len(reqs), width), dtype=np.int64)
        for i, t in enumerate(tables):
            table_np[i, : len(t)] = t
        slots = table_np[req_of_token, positions // bs] * bs + positions % bs

        sampling_rows = [i for i, r in enumerate(reqs) if seq_lens[i] == r.num_tokens]
        logits_idx = starts[1:][sampling_rows] - 1
        spans: list[tuple[Sequence, int, int]] = []
        for i, r in enumerate(reqs):
            if r.params.prompt_logprobs is not None:
                # position p predicts token p + 1: the prompt's last position predicts the first output
                c = int(computed[i])
                count = min(c + int(num_new[i]), r.num_prompt_tokens - 1) - c
                if count > 0:
                    spans.append((r, c, count))
                    logits_idx = np.concatenate((logits_idx, np.arange(starts[i], starts[i] + count)))

        dev = self.device
        block_tables = torch.from_numpy(table_np.astype(np.int32)).to(dev)
        seq_lens_t = torch.from_numpy(seq_lens.astype(np.int32)).to(dev)
        nd = num_decodes
        prefill_qsl = torch.from_numpy((starts[nd:] - starts[nd]).astype(np.int32)).to(dev)
        meta = AttnMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            num_decode_tokens=nd,
            decode_block_tables=block_tables[:nd],
            decode_seq_lens=seq_lens_t[:nd],
            prefill_block_tables=block_tables[nd:],
            prefill_query_start_loc=prefill_qsl,
            prefill_seq_lens=seq_lens_t[nd:],
            block_tables=block_tables,
            query_start_loc=torch.from_numpy(starts.astype(np.int32)).to(dev),
            seq_lens=seq_lens_t,
            backend=self.backend,
        )
        return StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.from_numpy(logits_idx).to(dev),
            sampling=[reqs[i] for i in sampling_rows],
            prompt_spans=spans,
        )

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepLogits:
        """Run the step: fp32 logits for the sequences that sample and the prompt positions asked for."""
        if not self._threads_bound:
            kernels.cpu.bind_threads()
            self._threads_bound = True
        if batch.copies:
            self._copy_blocks(batch.copies)
        step = self.prepare(batch)
        logits = self.model(step.input_ids, step.positions, self.kv_caches, step.meta, step.logits_indices)
        k = len(step.sampling)
        return StepLogits(logits[:k], step.sampling, step.prompt_spans, logits[k:])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            kernels.copy_blocks(k, v, src, dst)
