"""The only way the engine touches the KV cache.

Each op has a Triton kernel and a pure-torch reference; attention also has a native
CPU kernel (kernels/cpu.py) that serves decode and chunked prefill in one call per
layer. `backend="auto"` picks Triton on CUDA tensors and torch on the CPU; "triton",
"torch" and "native" force one (Triton on the CPU needs TRITON_INTERPRET=1). An engine
does not call these: it holds one kernels.backend.AttentionBackend, chosen once.

Layouts:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     int64 [num_tokens], block_id * block_size + offset, -1 skips the token
  block_tables:     int32 [num_seqs, max_blocks_per_seq]
  seq_lens:         int32 [num_seqs], whole length including cached prefix and new tokens
  query_start_loc:  int32 [num_seqs + 1], cumulative query lengths
"""

from __future__ import annotations

import torch

from kernels import reference

__all__ = ["store_kv", "paged_attention", "paged_attention_decode", "paged_attention_prefill", "copy_blocks"]

_BACKENDS = ("auto", "torch", "triton", "native")


def _use_triton(backend: str, t: torch.Tensor) -> bool:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    return backend == "triton" or (backend == "auto" and t.is_cuda)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str = "auto",
) -> None:
    if _use_triton(backend, key):
        from kernels import triton_attention

        return triton_attention.store_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    if _use_triton(backend, query):
        from kernels import triton_attention

        return triton_attention.paged_attention_decode(
            query, k_cache, v_cache, block_tables, seq_lens, scale
        )
    return reference.paged_attention_decode(query, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    if _use_triton(backend, query):
        from kernels import triton_attention

        return triton_attention.paged_attention_prefill(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
        )
    return reference.paged_attention_prefill(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens (decode or prefill chunk) in one call."""
    if backend == "native":
        from kernels import cpu

        return cpu.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
    return paged_attention_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                   backend)


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write of shared partial blocks).

    A single indexed copy is already bandwidth-bound on every device; no kernel needed.
    """
    reference.copy_blocks(k_cache, v_cache, src, dst)
