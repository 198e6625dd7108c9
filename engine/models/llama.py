"""Llama-family decoder (Llama 2/3, SmolLM, Mistral-style) over a paged KV cache.

Tokens from all requests are flattened into one batch; the attention metadata says
which sequence each token belongs to. The math follows transformers' LlamaModel
operation for operation (fp32 norms, rotate-half RoPE, residual order) so greedy
output in fp32 matches it token for token. QKV and gate/up projections are fused
into single matmuls: fewer, larger GEMMs are what the CPU path needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.models import packed_linear
from kernels import cpu as cpu_kernels
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


def rope_inv_freq(config) -> torch.Tensor:
    """Inverse frequencies, with Llama-3 or linear scaling when the config asks for it."""
    dim = head_dim(config)
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / params["factor"]
    if kind == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads(config) -> int:
    return config.num_key_value_heads or config.num_attention_heads


def kv_block_bytes(config, block_size: int, dtype: torch.dtype, tp: int = 1, pp: int = 1) -> int:
    """Bytes of one KV block across all layers (K and V); under parallelism, on the rank
    holding the most heads and layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = parallel.max_kv_heads(config, tp)
    layers = parallel.max_layers(config.num_hidden_layers, pp)
    return 2 * layers * block_size * heads * head_dim(config) * elem


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    """Column-parallel qkv over this rank's heads, row-parallel o_proj, then the all-reduce."""

    def __init__(self, config, heads: parallel.Heads, tp: parallel.Group) -> None:
        super().__init__()
        self.heads, self.tp = heads, tp
        self.num_heads = heads.num_q
        self.num_kv_heads = heads.num_kv
        self.head_dim = head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)  # bias on tensor rank 0 only
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttnMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        q, k = qkv[:, : self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
        q = _rotate(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        k_cache, v_cache = kv_cache
        meta.backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = meta.backend.attention(q, k_cache, v_cache, meta, self.scale)
        return self.tp.all_reduce(self.o_proj(out.view(n, self.q_size)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    """Column-parallel gate/up over this rank's slice of the intermediate size, row-parallel down."""

    def __init__(self, config, tp: parallel.Group) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.tp = tp
        self.inter_range = parallel.split(config.intermediate_size, tp.size, tp.rank)
        self.inter = self.inter_range[1] - self.inter_range[0]
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.inter, bias=bias)
        self.down_proj = nn.Linear(self.inter, config.hidden_size, bias=bias)

    @property
    def glu(self) -> bool:
        """Whether gate_up_proj returns silu(gate) * up itself (PackedLinear with glu)."""
        return bool(getattr(self.gate_up_proj, "glu", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.glu:
            return self.tp.all_reduce(self.down_proj(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


@dataclass(frozen=True, slots=True)
class Flat:
    """One decoder layer's weights, projections and sizes as plain references."""

    norm1: torch.Tensor
    eps1: float
    norm2: torch.Tensor
    eps2: float
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    glu: bool  # gate_up returns silu(gate) * up itself
    down: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    q_size: int
    v_at: int  # where v starts in a qkv row
    scale: float
    reduce: Callable[[torch.Tensor], torch.Tensor] | None  # the tensor-parallel all-reduce, if any


class DecoderLayer(nn.Module):
    def __init__(self, config, heads: parallel.Heads, tp: parallel.Group) -> None:
        super().__init__()
        self.self_attn = Attention(config, heads, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, kv_cache, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def flatten(self) -> None:
        """Plain references to what forward_fused uses, taken once the weights are final
        (loaded, packed or quantized)."""
        attn, mlp = self.self_attn, self.mlp
        self.flat = Flat(
            norm1=self.input_layernorm.weight, eps1=self.input_layernorm.eps,
            norm2=self.post_attention_layernorm.weight, eps2=self.post_attention_layernorm.eps,
            qkv=attn.qkv_proj.forward, o=attn.o_proj.forward, gate_up=mlp.gate_up_proj.forward, glu=mlp.glu,
            down=mlp.down_proj.forward, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            q_size=attn.q_size, v_at=attn.q_size + attn.kv_size, scale=attn.scale,
            reduce=attn.tp.all_reduce if attn.tp.size > 1 else None)

    def forward_fused(self, residual, pending, cos, sin, kv_cache, meta,
                      keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer on the native CPU kernels: each residual add fused into the norm
        after it (`residual` updated in place, the MLP output returned as the next layer's
        `pending`), the rotary fused, and written flat, with no nn.Module call or module
        attribute lookup inside: at batch 1 on quantized weights the Python around the
        kernels had taken about 95 us a layer, a quarter of the step. cos and sin are
        [n, head_dim]. Returns (residual, pending).

        `keep`, on the model's last layer: the rows that need logits. Every row's K and V
        are stored, but only those rows go on through o_proj and the MLP; in a prefill
        chunk that is one row a prompt instead of all of them. Each GEMM row is computed
        on its own, so the kept rows' values are the same."""
        f = self.flat
        x = cpu_kernels.add_rms_norm(pending, residual, f.norm1, f.eps1)
        n = x.shape[0]
        qkv = f.qkv(x)
        q, k = cpu_kernels.rope_qk(qkv, cos, sin, f.heads, f.kv_heads)
        v = qkv[:, f.v_at:].view(n, f.kv_heads, f.head_dim)
        k_cache, v_cache = kv_cache
        backend = meta.backend
        backend.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = backend.attention(q, k_cache, v_cache, meta, f.scale).view(n, f.q_size)
        if keep is not None:
            out, residual = out[keep], residual[keep]
        out = f.o(out)
        x = cpu_kernels.add_rms_norm(out if f.reduce is None else f.reduce(out), residual, f.norm2, f.eps2)
        up = f.gate_up(x)
        out = f.down(up if f.glu else cpu_kernels.silu_mul(up))
        return residual, (out if f.reduce is None else f.reduce(out))


class LlamaForCausalLM(nn.Module):
    """The whole model, or under parallelism one rank's part of it: its stage's layers
    (pipeline), its slice of every layer (tensor), its slice of the vocabulary for the
    embedding (first stage) and the head (last stage)."""

    def __init__(self, config, max_positions: int, dist: parallel.Dist | None = None) -> None:
        super().__init__()
        self.config = config
        self.dist = dist = dist or parallel.single()
        layout, tp = dist.layout, dist.tp
        self.first, self.last = layout.first, layout.last
        self.tie = bool(getattr(config, "tie_word_embeddings", False))
        # Equal vocabulary shards (the last one padded with zero rows) so the gather is uniform.
        self.vocab_shard = -(-config.vocab_size // tp.size)
        self.vocab_lo = tp.rank * self.vocab_shard
        self.vocab_hi = min(config.vocab_size, self.vocab_lo + self.vocab_shard)
        if self.first or (self.last and self.tie):
            self.embed_tokens = nn.Embedding(self.vocab_shard, config.hidden_size)
        heads = parallel.split_heads(config.num_attention_heads, num_kv_heads(config), tp.size, tp.rank)
        self.layer_range = layout.layers(config.num_hidden_layers)
        self.layers = nn.ModuleList(DecoderLayer(config, heads, tp) for _ in range(*self.layer_range))
        if self.last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            if not self.tie:
                self.lm_head = nn.Linear(config.hidden_size, self.vocab_shard, bias=False)
        # cos/sin for every position, computed in fp32 exactly as transformers does.
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(config)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)
        self.fused = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie else self.lm_head.weight

    def use_fused_ops(self) -> None:
        """The native CPU kernels' fused layer (DecoderLayer.forward_fused); CPU only, and
        last, once the weights are loaded, packed or quantized."""
        self.fused = True
        for layer in self.layers:
            layer.flatten()

    def pack_linears(self) -> None:
        """Prepack every GEMM weight for oneDNN or the native GEMM (CPU only; after loading,
        never before); where packed_linear.glu_available, each gate/up with its activation."""
        for layer in self.layers:
            gate_up = layer.mlp.gate_up_proj
            if packed_linear.glu_available(gate_up.weight.dtype):
                layer.mlp.gate_up_proj = packed_linear.PackedLinear(gate_up.weight, gate_up.bias, glu=True)
        packed_linear.pack(self.layers)
        if self.last:
            self.head = packed_linear.PackedLinear(self.lm_head_weight, None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.dist.tp
        if tp.size == 1:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_lo
        outside = (local < 0) | (local >= self.vocab_hi - self.vocab_lo)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        return tp.all_reduce(h.masked_fill_(outside[:, None], 0))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttnMetadata,
        logits_indices: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """fp32 logits only at logits_indices (sampling needs no others) on the rank that
        samples; a later stage's input (`hidden`) on the others of a pipeline; None on the
        other tensor ranks of the last stage."""
        h = self.embed(input_ids) if self.first else hidden
        cos = self.cos_cache[positions].to(h.dtype)
        sin = self.sin_cache[positions].to(h.dtype)
        # On the fused path the last stage's last layer keeps only the logits rows.
        picked = self.fused and self.last and len(self.layers) > 0
        if self.fused:
            pending = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                keep = logits_indices if picked and i == len(self.layers) - 1 else None
                h, pending = layer.forward_fused(h, pending, cos, sin, kv_cache, meta, keep)
            h = h + pending if pending is not None else h
        else:
            cos, sin = cos[:, None, :], sin[:, None, :]
            for layer, kv_cache in zip(self.layers, kv_caches):
                h = layer(h, cos, sin, kv_cache, meta)
        if not self.last:
            return h
        h = self.norm(h if picked else h[logits_indices])
        head = getattr(self, "head", None)
        logits = (head(h) if head is not None else F.linear(h, self.lm_head_weight)).float()
        return self._gather(logits)

    def _gather(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The vocabulary shards to tensor rank 0, joined and cut to the true vocabulary."""
        tp = self.dist.tp
        if tp.size == 1:
            return logits
        if logits.shape[0] == 0:  # every rank knows the row count: nothing to send
            return logits.new_empty(0, self.config.vocab_size) if tp.rank == 0 else None
        if tp.rank != 0:
            tp.send(logits.contiguous(), 0).wait()
            return None
        parts = [logits]
        for r in range(1, tp.size):
            part = torch.empty_like(logits)
            tp.recv(part, r)
            parts.append(part)
        return torch.cat(parts, dim=-1)[:, : self.config.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> None:
        from engine.models.weights import load

        load(self, weights)
