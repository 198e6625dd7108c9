"""Triton kernels for the paged KV cache: store_kv, decode (single pass or split-K), prefill.

Why the design is what it is:

* KV tiles are gathered position by position through the block table: context position
  n lives in block ``block_tables[seq, n // block_size]`` at row ``n % block_size``. The
  tile length (BLOCK_N) is therefore independent of the cache block size, so one kernel
  serves block sizes 8, 16 and 32, and a tile spans several pages: a long inner loop on the
  GPU, few iterations under the (slow) interpreter. Each token row is head_dim contiguous
  elements, so the gather still reads whole cache lines.
* GQA: a program owns one KV head and packs every query head that shares it into the rows of
  its Q tile (padded to >= 16 rows for tl.dot). Each K/V tile is read once per group instead
  of once per query head, which is what matters for memory-bound decode.
* Decode: one program per (sequence, KV head) cannot fill the GPU when batch x kv heads is
  small, so long contexts are split into partitions (flash-decoding). Each partition writes
  its running max, sum and normalised output; a reduce kernel merges them. The split count
  comes from ``block_tables.shape[1] * block_size`` (an upper bound on the context known
  without a device-to-host sync), batch, KV heads and the SM count.
* Prefill: one launch for every sequence. The grid is a flat list of query tiles whose size
  has a sync-free upper bound (total_tokens // BLOCK_Q + num_seqs, since sequence s owns the
  tile ids from query_start_loc[s] // BLOCK_Q + s on); each program finds its sequence by
  binary search over query_start_loc. Q-tile rows are (token, head-in-group) pairs and the
  KV loop stops at the tile's last causal position, so chunked prefill and prefix-cache hits
  (q_len < seq_len) cost only what they read.
* Softmax is online, in fp32, base 2 with log2(e) folded into the scale. The running max
  starts at a finite -1e30 so fully masked rows and empty partitions give zeros, not NaN.
  Cache offsets are int64: a large cache has more than 2**31 elements. fp32 caches use
  "ieee" dots (no silent TF32). P is rounded to the cache dtype before P @ V, as is usual.
* Attention sinks (gpt-oss: a learned logit per head that joins the softmax with no value)
  are the online softmax's starting state: running max the sink, sum 1, output 0 (in
  split-K, the first partition's).
* Sliding windows (query p sees keys (p - window, p]) start each KV loop at the window's
  first key, so a windowed layer reads at most window keys a query; soft-capping applies
  cap * tanh(s / cap) to the natural-log scores, written in base 2 as C * tanh(s2 / C)
  with C = cap * log2(e).
* Under TRITON_INTERPRET (CPU tensors) bf16 dots are done in fp32 (UPCAST): the
  interpreter's bf16 tl.dot multiplies raw bit patterns. It also rounds fp32 -> bf16
  toward zero where the GPU rounds to nearest even.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_PARTITION = 512  # fewest context tokens worth a split of their own
_MAX_SPLITS = 64


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ct, stride_ch,
                     HEAD_DIM: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_C)  # flattened (kv head, dim)
    head = col // HEAD_DIM
    dim = col % HEAD_DIM
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    mask = (slot >= 0)[:, None] & (col < NUM_KV_HEADS * HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    k = tl.load(key_ptr + tok64 * stride_kt + head[None, :] * stride_kh + dim[None, :], mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + head[None, :] * stride_vh + dim[None, :], mask=mask)
    dst = (slot // BLOCK_SIZE * stride_cb + slot % BLOCK_SIZE * stride_ct)[:, None] \
        + head[None, :] * stride_ch + dim[None, :]
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_head_off, pos, valid,
                 visible, dim, dim_mask, qk_scale, cap2, stride_cb, stride_ct,
                 BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                 CAPPED: tl.constexpr):
    """One online-softmax step over the KV positions ``pos`` (``valid`` ones exist)."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head_off
    kv_mask = valid[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + dim[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + dim[None, :], mask=kv_mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot multiplies raw bits; do it in fp32 there
        q = q.to(tl.float32)
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if CAPPED:  # tanh(x) = 2 sigmoid(2x) - 1
        s = cap2 * (2.0 * tl.sigmoid(2.0 * s / cap2) - 1.0)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
                   m_part_ptr, l_part_ptr, o_part_ptr, qk_scale, cap2, window, partition, num_splits,
                   stride_qs, stride_qh, stride_os, stride_oh, stride_bt,
                   stride_cb, stride_ct, stride_ch,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, NUM_HEADS: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
                   UPCAST: tl.constexpr, CAPPED: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    dim = tl.arange(0, BLOCK_D)
    dim_mask = dim < HEAD_DIM
    head = kvh * GROUP + g
    row_mask = (g < GROUP)[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qs + head[:, None] * stride_qh + dim[None, :],
                mask=row_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    end = tl.minimum(seq_len, start + partition)
    if window > 0:  # the one query sees keys (seq_len - 1 - window, seq_len - 1]
        start = tl.maximum(start, seq_len - window)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if SINKS:  # the first partition starts from the head's sink: a key seen, with no value
        sink = tl.load(sinks_ptr + head, mask=g < GROUP, other=-1.0e30).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row,
                                     kvh * stride_ch, pos, valid, valid[None, :], dim, dim_mask,
                                     qk_scale, cap2, stride_cb, stride_ct, BLOCK_SIZE, DOT_PREC, UPCAST,
                                     CAPPED)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        part = (seq * NUM_HEADS + head) * num_splits + split
        tl.store(m_part_ptr + part, m_i, mask=g < GROUP)
        tl.store(l_part_ptr + part, l_i, mask=g < GROUP)
        tl.store(o_part_ptr + part[:, None] * HEAD_DIM + dim[None, :], out, mask=row_mask)
    else:
        tl.store(out_ptr + seq * stride_os + head[:, None] * stride_oh + dim[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _decode_reduce_kernel(m_part_ptr, l_part_ptr, o_part_ptr, out_ptr, num_splits,
                          stride_os, stride_oh,
                          HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dim = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    part = (seq * NUM_HEADS + head) * num_splits + s
    m = tl.load(m_part_ptr + part, mask=s_mask, other=float("-inf"))
    l = tl.load(l_part_ptr + part, mask=s_mask, other=0.0)
    o = tl.load(o_part_ptr + part[:, None] * HEAD_DIM + dim[None, :],
                mask=s_mask[:, None] & (dim < HEAD_DIM)[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0)) * l
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dim,
             out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_DIM)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr, sinks_ptr,
                    qk_scale, cap2, window, num_seqs,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_cb, stride_ct, stride_ch,
                    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                    CAPPED: tl.constexpr, SINKS: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence s owns tile ids [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1).
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    seq = lo
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    q_start = (tile - q_begin // BLOCK_Q - seq) * BLOCK_Q
    if q_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    tok = q_start + r // GROUP
    head = kvh * GROUP + r % GROUP
    dim = tl.arange(0, BLOCK_D)
    dim_mask = dim < HEAD_DIM
    row_mask = ((r < BLOCK_Q * GROUP) & (tok < q_len))[:, None] & dim_mask[None, :]
    tok_off = (q_begin + tok).to(tl.int64)[:, None]
    q = tl.load(q_ptr + tok_off * stride_qt + head[:, None] * stride_qh + dim[None, :],
                mask=row_mask, other=0.0).to(k_cache_ptr.dtype.element_ty)
    q_pos = seq_len - q_len + tok
    kv_end = tl.minimum(seq_len, seq_len - q_len + q_start + BLOCK_Q)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # each row starts from its head's sink: a key seen, with no value
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    kv_lo = 0
    if window > 0:  # the tile's first query sees nothing earlier, and no later one does
        kv_lo = tl.maximum(0, seq_len - q_len + q_start - window + 1)
    for n0 in range(kv_lo, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row,
                                     kvh * stride_ch, pos, valid, visible, dim, dim_mask,
                                     qk_scale, cap2, stride_cb, stride_ct, BLOCK_SIZE, DOT_PREC, UPCAST,
                                     CAPPED)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok_off * stride_ot + head[:, None] * stride_oh + dim[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask)


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    if k_cache.stride(-1) != 1:
        raise ValueError("the cache's head_dim must be contiguous")


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32 caches: no silent TF32 rounding


def _sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (fp32, one per query head), or any tensor where
    there are none: SINKS=False compiles the load away."""
    if sinks is None:
        return query
    if sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must be [{query.shape[1]}] (one per query head), not {tuple(sinks.shape)}")
    return sinks.float().contiguous()


def _upcast(cache: torch.Tensor) -> bool:
    """True where the kernel will run under the interpreter with a bf16 cache."""
    return cache.dtype == torch.bfloat16 and cache.device.type == "cpu"


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                      device: torch.device) -> int:
    """Split-K only when the (seq, kv head) grid leaves SMs idle and contexts are long."""
    if max_context < 2 * _MIN_PARTITION:
        return 1
    if device.type == "cuda":
        sms = _sm_count(torch.cuda.current_device() if device.index is None else device.index)
    else:
        sms = 8  # nominal: the interpreter has no SMs; keeps the heuristic testable
    programs = num_seqs * num_kv_heads
    target = 2 * sms  # about two waves of programs keep every SM busy
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_context // _MIN_PARTITION, _MAX_SPLITS))


def decode_tiles(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for decode. fp32 caches take "ieee" dots, which are FMA loops
    whose tiles live in registers: past head size 64 they take a narrower KV tile over more
    warps (head size 256: narrower still, 8 warps spilled there on sm_90).
    kernels/triton_compile.py compiles every choice for sm_80 and sm_90 and fails on any spill.
    The interpreter (CPU tensors) has no registers, and its time goes by loop trips: the
    widest tile there."""
    if device.type == "cpu":
        return 64, 4
    if dtype == torch.float32 and head_dim > 64:
        return (32, 8) if head_dim <= 128 else (16, 4)
    return 64, 4


def prefill_tiles(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for prefill, under the same rules: 8 warps from head
    size 128 on, a narrower KV tile for head size 256 and for fp32 caches on a GPU."""
    if device.type == "cpu":
        return 64, 64, 4
    if dtype == torch.float32:
        return (32, 32, 8) if head_dim <= 64 else (64, 16, 8)
    if head_dim <= 64:
        return 64, 64, 4
    return (64, 64, 8) if head_dim <= 128 else (64, 32, 8)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        key, value = key.contiguous(), value.contiguous()
    block_c = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(1, min(64, 4096 // block_c))
    _store_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping, num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=block_t, BLOCK_C=block_c)


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           block_n: int | None = None) -> torch.Tensor:
    """``num_splits`` forces the path (1: single pass, > 1: split-K); None lets the heuristic
    pick. ``block_n`` overrides the KV tile decode_tiles picks.

    ``out``, if given, receives the result (tests pass a NaN-filled one to catch unwritten rows).
    """
    _check_cache(k_cache, v_cache)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tile_n, num_warps = decode_tiles(k_cache.dtype, head_dim, k_cache.device)
    block_n = block_n or tile_n
    if out is None:
        out = torch.empty_like(query)
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must have the query's shape and a contiguous head_dim")
    if num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, query.device)
    partition = triton.cdiv(triton.cdiv(max_context, max(1, num_splits)), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_context, partition))
    split = num_splits > 1
    block_d = triton.next_power_of_2(head_dim)
    if split:
        m_part = torch.empty(num_seqs, num_heads, num_splits, device=query.device,
                             dtype=torch.float32)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty(num_seqs, num_heads, num_splits, head_dim, device=query.device,
                             dtype=torch.float32)
    else:
        m_part = l_part = o_part = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, _sinks(sinks, query), m_part, l_part, o_part,
        scale * _LOG2E, softcap * _LOG2E, window, partition, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, GROUP=group, NUM_HEADS=num_heads,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, SPLIT=split, DOT_PREC=_dot_precision(k_cache.dtype),
        UPCAST=_upcast(k_cache), CAPPED=softcap > 0, SINKS=sinks is not None, num_warps=num_warps)
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            m_part, l_part, o_part, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_HEADS=num_heads,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4)
    return out


def paged_attention_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """``block_m`` and ``block_n`` override the tiles prefill_tiles picks."""
    _check_cache(k_cache, v_cache)
    total_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    tile_m, tile_n, num_warps = prefill_tiles(k_cache.dtype, head_dim, k_cache.device)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must have the query's shape and a contiguous head_dim")
    if total_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (total_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, _sinks(sinks, query),
        scale * _LOG2E, softcap * _LOG2E, window, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n, BLOCK_SIZE=block_size,
        DOT_PREC=_dot_precision(k_cache.dtype), UPCAST=_upcast(k_cache), CAPPED=softcap > 0,
        SINKS=sinks is not None, num_warps=num_warps)
    return out
