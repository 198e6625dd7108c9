"""Turns a scheduled batch into one forward pass over the paged KV cache.

The driver turns the batch into StepTensors (`prepare`); every rank's ModelRunner runs
its part of the forward pass from them. Under parallelism the StepTensors are what
crosses to the workers, packed into one int64 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

import kernels
import kernels.cpu
from kernels.backend import AttentionBackend, TorchBackend
from engine import kv_groups
from engine.kv_cache_manager import KVCacheManager
from engine.models.decoder import AttnMetadata, DecoderForCausalLM, head_dim
from engine.scheduler import Batch
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.cuda_graphs import DecodeGraphs

HEADER = 8  # int64s: kind, tokens, seqs, table width, decodes, logits rows, copies, groups past the first
STEP, NOOP, STOP = 0, 1, 2


@dataclass
class StepTensors:
    """Everything any rank needs for one forward pass, and nothing about the requests."""

    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    slot_mapping: torch.Tensor  # int64 [tokens]
    block_tables: torch.Tensor  # int64 [seqs, width]; decode sequences first
    query_start_loc: torch.Tensor  # int64 [seqs + 1]
    seq_lens: torch.Tensor  # int64 [seqs]
    logits_indices: torch.Tensor  # int64 [rows]
    copies: torch.Tensor  # int64 [copies, 2]: (src, dst) blocks to copy before the pass
    num_decodes: int
    # The other KV groups' tables and slots (engine/kv_groups.py), when the model has several.
    group_tables: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, 0, dtype=torch.int64))
    group_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.int64))
    # Rows whose final hidden states embedding requests pool (engine/pooling.py). Never
    # packed: a pooling engine has one rank (EngineConfig refuses parallelism with a pooler).
    pool_indices: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # A linear-attention model's state slot per sequence, and the (src, dst) slots to copy
    # first (engine/state_slots.py). Never packed either: such a model has one rank.
    state_slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    state_copies: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))

    def pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert not self.state_slots.shape[0], "a linear-attention model runs on one rank"
        n, (s, w) = self.input_ids.shape[0], self.block_tables.shape
        header = torch.tensor([STEP, n, s, w, self.num_decodes, self.logits_indices.shape[0],
                               self.copies.shape[0], self.group_slots.shape[0]], dtype=torch.int64)
        body = torch.cat([self.input_ids, self.positions, self.slot_mapping, self.block_tables.reshape(-1),
                          self.query_start_loc, self.seq_lens, self.logits_indices, self.copies.reshape(-1),
                          self.group_slots.reshape(-1), self.group_tables.reshape(-1)])
        return header, body

    @staticmethod
    def body_size(header: torch.Tensor) -> int:
        _, n, s, w, _, rows, c, e = header.tolist()
        return 3 * n + s * w + (s + 1) + s + rows + 2 * c + e * (n + s * w)

    @classmethod
    def unpack(cls, header: torch.Tensor, body: torch.Tensor) -> "StepTensors":
        _, n, s, w, nd, rows, c, e = header.tolist()
        sizes = [n, n, n, s * w, s + 1, s, rows, 2 * c, e * n, e * s * w]
        ids, pos, slots, tables, qsl, lens, idx, copies, gslots, gtables = body.split(sizes)
        return cls(ids, pos, slots, tables.view(s, w), qsl, lens, idx, copies.view(c, 2), nd,
                   gtables.view(e, s, w), gslots.view(e, n))

    def to(self, device: torch.device) -> "StepTensors":
        if device.type == "cpu":
            return self
        moved = [t.to(device, non_blocking=True) for t in (
            self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.query_start_loc,
            self.seq_lens, self.logits_indices, self.copies, self.group_tables, self.group_slots, self.pool_indices,
            self.state_slots, self.state_copies)]
        return StepTensors(*moved[:8], self.num_decodes, *moved[8:])


@dataclass
class StepInput:
    tensors: StepTensors
    sampling: list[Sequence]  # in the order of the first logits rows
    # Logits rows per sampling sequence: 1, plus its speculative tokens when it has some
    # (row j predicts the token after its j-th proposed one).
    rows: list[int]
    # (sequence, first position, count) for prompt tokens whose logprobs were asked for;
    # their logits rows follow the sampling rows, in this order.
    prompt_spans: list[tuple[Sequence, int, int]]
    # (sequence, first position, count) whose hidden states an embedding request pools, in
    # the order of StepTensors.pool_indices: a mean its chunk's every row, a last its final one.
    pool_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)


# What a pass gives back: the logits, and with them the pooled rows when the step has some.
StepResult = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def split_result(result: StepResult) -> tuple[torch.Tensor, torch.Tensor | None]:
    return result if isinstance(result, tuple) else (result, None)


@dataclass
class StepLogits:
    logits: torch.Tensor  # fp32, the sampling sequences' rows (StepInput.rows of each)
    sampling: list[Sequence]
    rows: list[int]
    prompt_spans: list[tuple[Sequence, int, int]]
    prompt_logits: torch.Tensor  # fp32, one row per position in prompt_spans: it predicts the next token


def flatten(tokens: list[list[int]], first: list[int], tables: list[list[int]], block_size: int
            ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Queries of several sequences as one flat batch: sequence i's tokens at positions
    first[i]..; gives (ids, positions, slots, table array, query starts)."""
    num_new = np.array([len(t) for t in tokens], dtype=np.int64)
    computed = np.array(first, dtype=np.int64)
    ids = [t for ts in tokens for t in ts]
    starts = np.concatenate(([0], np.cumsum(num_new)))
    req_of_token = np.repeat(np.arange(len(tokens)), num_new)
    positions = np.arange(int(starts[-1])) - starts[req_of_token] + computed[req_of_token]
    table_np, slots = table_and_slots(tables, req_of_token, positions, block_size)
    return ids, positions, slots, table_np, starts


def table_and_slots(tables: list[list[int]], req_of_token: np.ndarray, positions: np.ndarray, block_size: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The tables as one array, and each token's cache slot through its sequence's table."""
    width = max(len(t) for t in tables)
    table_np = np.zeros((len(tables), width), dtype=np.int64)
    for i, t in enumerate(tables):
        table_np[i, : len(t)] = t
    return table_np, table_np[req_of_token, positions // block_size] * block_size + positions % block_size


def prepare(batch: Batch, kv_manager: KVCacheManager) -> StepInput:
    """The batch as flat token arrays, block tables and the rows to compute logits for."""
    # Single-token queries go first so they can take the decode kernel.
    order = sorted(range(len(batch)), key=lambda i: batch.num_new[i] != 1)
    reqs = [batch.seqs[i] for i in order]
    num_new = np.array([batch.num_new[i] for i in order], dtype=np.int64)
    computed = np.array([r.num_computed_tokens for r in reqs], dtype=np.int64)
    seq_lens = computed + num_new
    # A speculating sequence's query runs past its known tokens into its proposed ones.
    tokens = [r.token_ids[c:c + n] + r.spec_token_ids[:max(0, c + n - r.num_tokens)]
              for r, c, n in zip(reqs, computed.tolist(), num_new.tolist())]
    ids, positions, slots, table_np, starts = flatten(
        tokens, computed.tolist(), [kv_manager.block_ids(r) for r in reqs], kv_manager.block_size)

    sampling_rows = [i for i, r in enumerate(reqs)
                     if seq_lens[i] == r.num_tokens + len(r.spec_token_ids) and r.pool is None]
    rows = [1 + len(reqs[i].spec_token_ids) for i in sampling_rows]
    # each sampling sequence's last rows[i] positions, in order
    counts = np.array(rows, dtype=np.int64)
    logits_idx = (np.repeat(starts[1:][sampling_rows] - counts, counts)
                  + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
    spans: list[tuple[Sequence, int, int]] = []
    for i, r in enumerate(reqs):
        if r.params.prompt_logprobs is not None:
            # position p predicts token p + 1: the prompt's last position predicts the first output
            c = int(computed[i])
            count = min(c + int(num_new[i]), r.num_prompt_tokens - 1) - c
            if count > 0:
                spans.append((r, c, count))
                logits_idx = np.concatenate((logits_idx, np.arange(starts[i], starts[i] + count)))

    pool_spans: list[tuple[Sequence, int, int]] = []
    pool_idx: list[np.ndarray] = []
    for i, r in enumerate(reqs):
        if r.pool == "mean":
            pool_spans.append((r, int(computed[i]), int(num_new[i])))
            pool_idx.append(np.arange(starts[i], starts[i + 1]))
        elif r.pool == "last" and seq_lens[i] == r.num_tokens:
            pool_spans.append((r, int(seq_lens[i]) - 1, 1))
            pool_idx.append(np.array([starts[i + 1] - 1]))

    tensors = StepTensors(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots),
        block_tables=torch.from_numpy(table_np),
        query_start_loc=torch.from_numpy(starts.astype(np.int64)),
        seq_lens=torch.from_numpy(seq_lens),
        logits_indices=torch.from_numpy(np.asarray(logits_idx, dtype=np.int64)),
        copies=torch.tensor(batch.copies, dtype=torch.int64).view(-1, 2),
        num_decodes=int((num_new == 1).sum()),
        pool_indices=torch.from_numpy(np.concatenate(pool_idx).astype(np.int64)) if pool_idx
        else torch.zeros(0, dtype=torch.int64),
    )
    if kv_manager.states is not None:
        tensors.state_slots = torch.tensor([kv_manager.state_slot(r) for r in reqs], dtype=torch.int64)
        tensors.state_copies = torch.tensor(batch.state_copies, dtype=torch.int64).view(-1, 2)
    if kv_manager.num_groups > 1:
        req_of_token = np.repeat(np.arange(len(reqs)), num_new)
        extra = [table_and_slots([kv_manager.block_ids(r, g) for r in reqs], req_of_token, positions,
                                 kv_manager.block_size) for g in range(1, kv_manager.num_groups)]
        tensors.group_tables = torch.from_numpy(np.stack([t for t, _ in extra]))
        tensors.group_slots = torch.from_numpy(np.stack([s for _, s in extra]))
    return StepInput(tensors, [reqs[i] for i in sampling_rows], rows, spans, pool_spans)


class ModelRunner:
    """One rank's model part and KV cache (its heads of its stage's layers)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend = TorchBackend(),
        cores: list[int] | None = None,
        groups: kv_groups.KVGroups | None = None,
        state_slots: int = 0,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.backend = backend
        self.cores = cores
        self._threads_bound = not backend.pins_threads  # pinned on first use, by the thread that steps
        if device.type == "cpu":
            kernels.cpu.keep_freed_memory()
        kv_layers = [i for i, layer in enumerate(model.layers) if not layer.is_linear]
        num_kv = model.attention.num_kv_heads if kv_layers else 0
        shape = (num_blocks, block_size, num_kv, head_dim(model.config))
        # One K/V pair per KV layer of a block (engine/kv_groups.py); each layer reads its own.
        self.groups = groups = groups or kv_groups.single(len(kv_layers))
        self.kv_slots = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(groups.layers_per_block)
        ]
        # Per layer: its K/V pair and its group's metadata; a state-keeping layer's state
        # tensors (a row per slot: its mixer's state_layout) and group 0's.
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.layer_group: list[int] = []
        for layer in model.layers:
            if layer.is_linear:
                self.kv_caches.append(tuple(
                    torch.zeros(state_slots, *shape, dtype=torch.float32 if fp32 else dtype, device=device)
                    for shape, fp32 in layer.mixer.spec.state_layout()))
                self.layer_group.append(0)
            else:
                a = kv_layers.index(len(self.layer_group))  # its place among the KV layers
                self.kv_caches.append(self.kv_slots[groups.slot_of[a]])
                self.layer_group.append(groups.group_of[a])
        self.graphs: DecodeGraphs | None = None  # engine/cuda_graphs.py, set once captured

    @torch.inference_mode()
    def forward(self, step: StepTensors, hidden: torch.Tensor | None = None) -> StepResult | None:
        """This rank's part of the pass: logits on the rank that samples, the hidden state
        for the next stage on a pipeline's other stages, None on the other tensor ranks. A
        decode step that a captured CUDA graph holds replays it."""
        if self.graphs is not None and hidden is None:
            logits = self.graphs.run(step)
            if logits is not None:
                return logits
        return self.eager(step, hidden)

    @torch.inference_mode()
    def eager(self, step: StepTensors, hidden: torch.Tensor | None = None) -> StepResult | None:
        if not self._threads_bound:
            kernels.cpu.bind_threads(self.cores)
            self._threads_bound = True
        step = step.to(self.device)
        if step.copies.shape[0]:
            for k, v in self.kv_slots:
                kernels.copy_blocks(k, v, step.copies[:, 0], step.copies[:, 1])
        for src, dst in step.state_copies.tolist():  # in the order the forks happened
            for layer, states in zip(self.model.layers, self.kv_caches):
                if layer.is_linear:
                    for t in states:
                        t[dst] = t[src]
        metas = self.metas(step)
        return self.model(step.input_ids, step.positions, self.kv_caches, [metas[g] for g in self.layer_group],
                          step.logits_indices, hidden, step.pool_indices)

    def metas(self, step: StepTensors) -> list[AttnMetadata]:
        """Each KV group's attention metadata: its own tables and slots, the batch's shape."""
        lens = step.seq_lens.to(torch.int32)
        qsl = step.query_start_loc.to(torch.int32)
        out = [self.meta(step.block_tables, step.slot_mapping, step.num_decodes, lens, qsl)]
        for tables, slots in zip(step.group_tables, step.group_slots):
            out.append(self.meta(tables, slots, step.num_decodes, lens, qsl))
        if step.state_slots.shape[0]:
            qsl = step.query_start_loc
            fresh = (step.seq_lens - (qsl[1:] - qsl[:-1])) == 0  # the first new token at position 0
            for meta in out:
                meta.state_slots, meta.state_fresh, meta.state_starts = step.state_slots, fresh, qsl
        return out

    def meta(self, block_tables: torch.Tensor, slot_mapping: torch.Tensor, nd: int, lens: torch.Tensor,
             qsl: torch.Tensor) -> AttnMetadata:
        tables = block_tables.to(torch.int32)
        return AttnMetadata(
            slot_mapping=slot_mapping,
            num_decode_tokens=nd,
            decode_block_tables=tables[:nd],
            decode_seq_lens=lens[:nd],
            prefill_block_tables=tables[nd:],
            prefill_query_start_loc=qsl[nd:] - qsl[nd],
            prefill_seq_lens=lens[nd:],
            block_tables=tables,
            query_start_loc=qsl,
            seq_lens=lens,
            backend=self.backend,
        )

    def hidden_buffer(self, step: StepTensors) -> torch.Tensor:
        """Where a later pipeline stage receives its input activations."""
        return torch.empty(step.input_ids.shape[0], self.model.config.hidden_size,
                           dtype=self.dtype, device=self.device)
