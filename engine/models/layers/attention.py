"""Self-attention over the paged KV cache, with every variant the supported
architectures need: QKV biases, q/k RMSNorm (per head, or over all heads as OLMo 2 does),
partial rotary, a sliding window per layer, score soft-capping, attention sinks (gpt-oss)
and any score scale."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine import parallel
from engine.models.arch import ArchSpec
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rotary import head_dim, rotate
from kernels.backend import AttentionBackend, TorchBackend


@dataclass
class AttnMetadata:
    """Per-step attention layout. Decode tokens (one per sequence) come first."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # int32 [num_decodes, max_blocks]
    decode_seq_lens: torch.Tensor  # int32 [num_decodes]
    prefill_block_tables: torch.Tensor  # int32 [num_prefills, max_blocks]
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1]
    prefill_seq_lens: torch.Tensor  # int32 [num_prefills]
    # The whole batch at once, for kernels that take decode and prefill in one call.
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    backend: AttentionBackend = field(default_factory=TorchBackend)
    # Each sequence's state slot, for layers that keep a state instead of KV
    # (engine/models/layers/gated_delta.py, short_conv.py); None where the model has none.
    # With them, computed once a step: which sequences start at position 0 (their state
    # from zeros), and the batch's query starts as int64, as the state kernels read them.
    state_slots: torch.Tensor | None = None
    state_fresh: torch.Tensor | None = None
    state_starts: torch.Tensor | None = None


class Attention(nn.Module):
    """Column-parallel qkv over this rank's heads, row-parallel o_proj, then the all-reduce."""

    def __init__(self, config, spec: ArchSpec, layer: int, heads: parallel.Heads, tp: parallel.Group) -> None:
        super().__init__()
        self.heads, self.tp = heads, tp
        self.num_heads = heads.num_q
        self.num_kv_heads = heads.num_kv
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q_proj's rows: each head's query, followed by its gate where the outputs are gated
        self.gated = spec.attn_gate
        self.q_rows = self.q_size * (2 if self.gated else 1)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_rows + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=spec.o_bias)  # bias on tensor rank 0 only
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim**-0.5
        self.window = spec.windows[layer]
        self.softcap = spec.attn_softcap
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            eps = config.rms_norm_eps
            q_dim, k_dim = (self.q_size, self.kv_size) if spec.qk_norm == "all" else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_dim, eps, spec.norm_offset, spec.late_cast)
            self.k_norm = RMSNorm(k_dim, eps, spec.norm_offset, spec.late_cast)
        # this rank's heads' sink logits (engine/models/weights.py slices them), where the architecture has them
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if spec.sinks else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [n, H, D], k and v [n, Hkv, D], normed where the architecture norms them, not
        rotated; and the output gate [n, H * D] where the architecture gates (else None)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
            gate = gate.reshape(n, self.q_size)
        if self.qk_norm == "all":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(n, self.num_kv_heads, self.head_dim), gate

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttnMetadata,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[0]
        q, k, v, gate = self.project(x)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if self.qk_norm == "rotated":  # HunYuan norms each head after turning it
            q, k = self.q_norm(q), self.k_norm(k)
        if q_scale is not None:  # Llama 4's temperature by position (Ministral 3), after the rotary
            q = q * q_scale[:, None, None]
        k_cache, v_cache = kv_cache
        meta.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        sinks = self.sinks.float() if self.sinks is not None else None
        out = meta.backend.attention(q, k_cache, v_cache, meta, self.scale, self.window, self.softcap, sinks)
        out = out.view(n, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.tp.all_reduce(self.o_proj(out))
