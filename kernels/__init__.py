"""The only code that touches the KV cache.

Each op has a Triton kernel (triton_attention.py) and a pure-torch reference
(reference.py), the test oracle; attention also has a native CPU kernel (cpu.py) that
serves decode and chunked prefill in one call per layer. An engine reaches them through
one kernels.backend.AttentionBackend, chosen once when its config resolves.

Layouts:
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping:     int64 [num_tokens], block_id * block_size + offset, -1 skips the token
  block_tables:     int32 [num_seqs, max_blocks_per_seq]
  seq_lens:         int32 [num_seqs], whole length including cached prefix and new tokens
  query_start_loc:  int32 [num_seqs + 1], cumulative query lengths
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing the package loads no torch; each module loads it where it runs
    import torch

__all__ = ["copy_blocks"]


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] (copy-on-write of shared partial blocks).

    A single indexed copy is already bandwidth-bound on every device; no kernel needed.
    """
    from kernels import reference

    reference.copy_blocks(k_cache, v_cache, src, dst)
