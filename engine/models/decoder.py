"""The decoder-only transformer every supported architecture is, over a paged KV cache.

Tokens from all requests are flattened into one batch; the attention metadata says which
sequence each token belongs to. An architecture is a subclass that reads its config into
an ArchSpec (engine/models/arch.py); the math follows transformers operation for
operation (fp32 norms, rotate-half RoPE, residual order) so greedy output in fp32 matches
it token for token. QKV and gate/up projections are fused into single matmuls: fewer,
larger GEMMs are what the CPU path needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import parallel
from engine.errors import ParamError
from engine.models import packed_linear
from engine.models.arch import HF_ACTIVATIONS, ArchSpec
from engine.models.layers import rotary
from engine.models.layers.attention import AttnMetadata
from engine.models.layers.block import DecoderLayer
from engine.models.layers.moe import SparseMoE
from engine.models.layers.norm import hidden_norm

__all__ = ["AttnMetadata", "DecoderForCausalLM", "head_dim", "kv_block_bytes", "num_kv_heads", "num_kv_layers"]

head_dim = rotary.head_dim


def num_kv_heads(config) -> int:
    return config.num_key_value_heads or config.num_attention_heads


def num_kv_layers(config) -> int:
    """The layers that keep KV: all but linear-attention ones (Qwen3.5's, Qwen3-Next's) and
    short convolutions (LFM2's), which keep a state per sequence instead."""
    types = getattr(config, "layer_types", None) or ()
    return config.num_hidden_layers - sum(t in ("linear_attention", "conv") for t in types)


def kv_block_bytes(config, block_size: int, dtype: torch.dtype, tp: int = 1, pp: int = 1,
                   layers_per_block: int | None = None) -> int:
    """Bytes of one KV block across the layers it serves (K and V): all of them, or a
    group's (engine/kv_groups.py); under parallelism, on the rank holding the most heads
    and layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = parallel.max_kv_heads(config, tp)
    layers = layers_per_block or parallel.max_layers(num_kv_layers(config), pp)
    return 2 * layers * block_size * heads * head_dim(config) * elem


def _check_activation(config, spec: ArchSpec) -> None:
    """A config whose `hidden_act` is not the activation the architecture computes is
    refused by name: a Llama-shaped checkpoint trained with GELU served with SiLU gives
    other tokens and no error. (Gemma's configs name theirs in `hidden_activation`.)"""
    name = getattr(config, "hidden_act", None)
    if name is None or getattr(config, "hidden_activation", None) is not None:
        return
    if HF_ACTIVATIONS.get(name) != spec.act:
        raise ParamError("model", f"{config.model_type} with hidden_act {name!r} is not supported: "
                                  f"this architecture computes {spec.act}")


class DecoderForCausalLM(nn.Module):
    """The whole model, or under parallelism one rank's part of it: its stage's layers
    (pipeline), its slice of every layer (tensor), its slice of the vocabulary for the
    embedding (first stage) and the head (last stage). Subclasses say what their
    architecture is (`spec`) and, where their checkpoints name tensors differently,
    how to rename them (`checkpoint_name`)."""

    # Each architecture's classmethod: its config read into an ArchSpec. The registry holds
    # only subclasses that define it; this class is never built on its own.
    spec: Callable[[object], ArchSpec]
    # How a checkpoint that stacks a layer's experts in one tensor lays them out: as Linear
    # weights [E, out, in], gate rows before up rows (transformers 5's own layout, and what
    # its GGUF reader makes of llama.cpp's merged ffn_*_exps), or gpt-oss's [E, in, out]
    # with gate and up columns interleaved (engine/models/weights.py reads both).
    interleaved_experts = False
    # `quantization: mxfp4`: the loader keeps MXFP4 expert checkpoints as blocks rather than
    # dequantizing them (engine/models/weights.py).
    keep_mxfp4 = False

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        """A checkpoint tensor's name in this model's terms; None for one it does not use."""
        return name

    @classmethod
    def engine_config(cls, config):
        """The config as the shared layers read it; an architecture whose keys differ
        returns a copy in their terms (LFM2)."""
        return config

    def __init__(self, config, max_positions: int, dist: parallel.Dist | None = None) -> None:
        super().__init__()
        self.config = config
        self.arch = spec = self.spec(config)
        _check_activation(config, spec)
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
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i, heads, tp) for i in range(*self.layer_range))
        if self.last:
            self.norm = hidden_norm(config, spec)
            if not self.tie:
                self.lm_head = nn.Linear(config.hidden_size, self.vocab_shard, bias=False)
            if spec.head_bias:  # beside the head, so that a tied or quantized head takes it alike
                self.lm_head_bias = nn.Parameter(torch.empty(self.vocab_shard), requires_grad=False)
        # cos/sin for every position, computed in fp32 exactly as transformers does; one
        # table per rope kind (Gemma 3's local layers turn on another base; NoPE layers by zero).
        kinds = rotary.kinds(config, spec.nope)[slice(*self.layer_range)]
        self.rope_kinds = sorted(set(kinds))
        self.layer_rope = [self.rope_kinds.index(k) for k in kinds]
        for i, kind in enumerate(self.rope_kinds):
            cos, sin = rotary.tables(config, kind, max_positions)
            self.register_buffer(f"cos_cache{i}", cos, persistent=False)
            self.register_buffer(f"sin_cache{i}", sin, persistent=False)
        if spec.q_position_scale:  # each position's query scale, computed as transformers does (fp32)
            beta, original = spec.q_position_scale
            at = torch.arange(max_positions, dtype=torch.int64)
            self.register_buffer("q_scale_cache", 1 + beta * torch.log(1 + torch.floor(at / original)),
                                 persistent=False)
        # the rotary's width (a partial rotary turns the first dims of a head only)
        self.rotary_dims = next((getattr(self, f"cos_cache{i}").shape[-1] for i, kind in enumerate(self.rope_kinds)
                                 if kind != rotary.NOPE), head_dim(config))
        self.fused = False
        # A sequence-classification checkpoint has no LM head: it is left unloaded and the
        # engine never samples from it (engine/scoring.py scores its hidden states).
        self.headless = False

    @property
    def graph_safe(self) -> bool:
        """Whether a forward pass runs without asking the host anything, so a CUDA graph
        can hold it (engine/cuda_graphs.py): an expert layer counts its tokens per expert
        on the host, a state-keeping layer reads its sequences' bounds there."""
        return self.arch.moe is None and self.arch.stateful is None

    @property
    def attention(self):
        """An attention module of this stage (their head counts and sizes are all alike);
        the first layer of a hybrid model may be a state-keeping one."""
        return next(layer.self_attn for layer in self.layers if not layer.is_linear)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tie else self.lm_head.weight

    def use_fused_ops(self, ops: Any) -> None:
        """The fused layer (DecoderLayer.forward_fused) on `ops` (the attention backend's
        fused_kernels()) where it runs the architecture (ArchSpec.fusable); last, once the
        weights are loaded, packed or quantized."""
        if not self.arch.fusable():
            return
        self.fused = True
        for layer in self.layers:
            layer.flatten(ops)

    def pack_linears(self) -> None:
        """Prepack every GEMM weight for oneDNN or the native GEMM (CPU only; after loading,
        never before); where packed_linear.glu_available, each silu gate/up with its activation."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                if not layer.mlp.packed:  # quantized experts (`mxfp4`) are their own modules already
                    layer.mlp.pack()  # each expert's GEMMs; its router and shared expert pack below
                continue
            gate_up = layer.mlp.gate_up_proj
            if layer.mlp.gated and layer.mlp.act_name == "silu" and packed_linear.glu_available(gate_up.weight.dtype):
                layer.mlp.gate_up_proj = packed_linear.PackedLinear(gate_up.weight, gate_up.bias, glu=True)
        packed_linear.pack(self.layers)
        if self.last:
            self.head = packed_linear.PackedLinear(self.lm_head_weight, None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        tp = self.dist.tp
        if tp.size == 1:
            h = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.vocab_lo
            outside = (local < 0) | (local >= self.vocab_hi - self.vocab_lo)
            h = self.embed_tokens(local.masked_fill(outside, 0))
            h = tp.all_reduce(h.masked_fill_(outside[:, None], 0))
        scale = self.arch.embed_scale
        if scale == 1.0:
            return h
        return h * (torch.tensor(scale, dtype=h.dtype) if self.arch.embed_scale_in_dtype else scale)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: list[AttnMetadata],
        logits_indices: torch.Tensor,
        hidden: torch.Tensor | None = None,
        pool_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """fp32 logits only at logits_indices (sampling needs no others) on the rank that
        samples; a later stage's input (`hidden`) on the others of a pipeline; None on the
        other tensor ranks of the last stage. kv_caches and metas are per layer: a hybrid
        model's local and global layers read their KV through their own block tables.
        With pool_indices (a single-rank engine's embedding requests), the logits and the
        final-normed hidden states at those rows."""
        pooling = pool_indices is not None and pool_indices.shape[0] > 0
        num_logits = logits_indices.shape[0]
        if pooling:  # one pass keeps both kinds of rows
            logits_indices = torch.cat([logits_indices, pool_indices])
        h = self.embed(input_ids) if self.first else hidden
        ropes = [(getattr(self, f"cos_cache{i}")[positions].to(h.dtype),
                  getattr(self, f"sin_cache{i}")[positions].to(h.dtype)) for i in range(len(self.rope_kinds))]
        q_scale = self.q_scale_cache[positions].to(h.dtype) if self.arch.q_position_scale else None
        # On the fused path the last stage's last layer keeps only the logits rows.
        picked = self.fused and self.last and len(self.layers) > 0
        if self.fused:
            pending = None
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                keep = logits_indices if picked and i == len(self.layers) - 1 else None
                cos, sin = ropes[self.layer_rope[i]]
                if layer.fused:
                    h, pending = layer.forward_fused(h, pending, cos, sin, kv_cache, metas[i], keep, q_scale)
                    continue
                # a layer on the module path among fused ones (Qwen3.5's gated attention)
                h = h + pending if pending is not None else h
                h, pending = layer(h, cos[:, None, :], sin[:, None, :], kv_cache, metas[i], q_scale), None
                h = h[keep] if keep is not None else h
            h = h + pending if pending is not None else h
        else:
            ropes = [(cos[:, None, :], sin[:, None, :]) for cos, sin in ropes]
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                cos, sin = ropes[self.layer_rope[i]]
                h = layer(h, cos, sin, kv_cache, metas[i], q_scale)
        if not self.last:
            return h
        h = self.norm(h if picked else h[logits_indices])
        pooled = h[num_logits:] if pooling else None
        h = h[:num_logits] if pooling else h
        head = getattr(self, "head", None)
        logits = (head(h) if head is not None else F.linear(h, self.lm_head_weight)).float()
        if self.arch.head_bias:
            logits = logits + self.lm_head_bias.float()
        logits = self._gather(self._finish(logits))
        return (logits, pooled) if pooled is not None and logits is not None else logits

    def _finish(self, logits: torch.Tensor) -> torch.Tensor:
        """Granite's and Cohere's logit scaling and Gemma 2's final soft-cap, per vocabulary shard."""
        spec = self.arch
        if spec.logit_divisor != 1.0:
            logits = logits / spec.logit_divisor
        if spec.logit_scale != 1.0:
            logits = logits * spec.logit_scale
        if spec.final_softcap:
            logits = torch.tanh(logits / spec.final_softcap) * spec.final_softcap
        return logits

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

    def load_weights(self, weights: Iterable[tuple[str, object]], absent: Callable[[str], bool] | None = None
                     ) -> None:
        from engine.models.weights import load

        load(self, ((new, src) for name, src in weights if (new := self.checkpoint_name(name)) is not None), absent)
