"""Pure-torch paged-attention ops: the CPU path and the oracle for the Triton kernels.

Written for speed on the CPU, where the embedded model runs by default: keys and
values are gathered by block table into a dense tensor and attention is a pair of
batched matmuls. Python loops run over sequences at most, never over tokens.
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Dense [num_seqs, num_tokens, kv_heads, head_dim] view of each sequence's first tokens."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [S, nb, bs, Hkv, D]
    s = blocks.shape[0]
    return blocks.reshape(s, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [S, Q, H, D]; k, v: [S, L, Hkv, D]; mask: bool [S, Q, L], True where visible.

    Heads are grouped as [Hkv, group] so GQA needs no copy of K or V.
    """
    s, nq, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.reshape(s, nq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * nq, d)
    kt = k.permute(0, 2, 3, 1)  # [S, Hkv, D, L]
    scores = torch.matmul(qg.float(), kt.float()).mul_(scale)  # [S, Hkv, g*Q, L]
    scores = scores.view(s, hkv, g, nq, -1)
    scores.masked_fill_(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(s, hkv, g * nq, -1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())  # [S, Hkv, g*Q, D]
    out = out.view(s, hkv, g, nq, d).permute(0, 3, 1, 2, 4).reshape(s, nq, h, d)
    return out.to(q.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if query.shape[0] == 0:
        return query.new_empty(query.shape)
    max_len = int(seq_lens.max())
    k = _gather(k_cache, block_tables, max_len)
    v = _gather(v_cache, block_tables, max_len)
    pos = torch.arange(max_len, device=query.device)
    mask = (pos[None, :] < seq_lens[:, None].to(pos.dtype))[:, None, :]  # [S, 1, L]
    return _attend(query[:, None], k, v, mask, scale)[:, 0]


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    # One sequence at a time: prefill batches hold few sequences, and padding them to
    # a common query length would waste far more than the loop costs.
    for i, seq_len in enumerate(lens):
        lo, hi = starts[i], starts[i + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        k = _gather(k_cache, block_tables[i : i + 1], seq_len)
        v = _gather(v_cache, block_tables[i : i + 1], seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = (k_pos[None, :] <= q_pos[:, None])[None]  # causal, [1, Q, L]
        out[lo:hi] = _attend(query[None, lo:hi], k, v, mask, scale)[0]
    return out
