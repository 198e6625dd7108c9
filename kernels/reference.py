"""Pure-torch paged-attention ops: the CPU path and the oracle for the Triton kernels.

Written for speed on the CPU, where the embedded model runs by default: each call
copies the sequences' blocks into one dense tensor with a single indexed copy, then
runs torch's fused attention per sequence. Python loops run over sequences, never
over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def _blocks_of(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's first seq_len tokens, dense [seq_len, kv_heads, head_dim].

    Whole blocks move as contiguous rows, several times faster on the CPU than
    gathering token slots; per-sequence copies stay small enough to be reused by the
    allocator, where one copy for the whole batch would fault in fresh pages each call.
    """
    n = -(-seq_len // cache.shape[1])
    return cache.index_select(0, table[:n]).flatten(0, 1)[:seq_len]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int,
          window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None):
    """q: [Q, H, D]; k, v: [L, Hkv, D] -> [Q, H, D]. causal_from: position of q[0]. With a
    window, query p sees keys (p - window, p]; softcap > 0 caps the scaled scores; sinks
    [H] are one more logit per head in each softmax, with no value (gpt-oss)."""
    if softcap > 0 or sinks is not None:
        return _explicit(q, k, v, scale, causal_from, window, softcap, sinks)
    if window > 0:
        # Only the keys some query can see: the first query's window onwards (the blocks
        # before it may have gone back to the pool, engine/kv_cache_manager.py).
        lo = max(0, causal_from - window + 1)
        k, v, causal_from = k[lo:], v[lo:], causal_from - lo
    q_len, seq_len = q.shape[0], k.shape[0]
    mask = None
    causal = False
    if q_len > 1:  # a single query token sees every key: no mask
        if q_len == seq_len:
            causal = True
        else:
            q_pos = torch.arange(causal_from, causal_from + q_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    if window > 0 and seq_len > window and q_len > 1:
        q_pos = torch.arange(causal_from, causal_from + q_len, device=q.device)[:, None]
        keys = torch.arange(seq_len, device=q.device)[None, :]
        mask = (keys <= q_pos) & (keys > q_pos - window)
        causal = False
    dtype = q.dtype
    if dtype != torch.float32 and q.device.type == "cpu":
        # CPU SDPA is several times slower in bf16/fp16 than in fp32 on these sizes;
        # upcasting the (already copied) K/V costs less and accumulates more exactly.
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(dtype)


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int,
              window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Soft-capped attention (Gemma 2) or attention with sinks (gpt-oss), written out: SDPA
    has no hook between the scores and the softmax. Scores and softmax in fp32, as
    transformers computes them; a sink joins each row's softmax and is dropped after."""
    if window > 0:  # keys before the first query's window are never read (they may be gone)
        lo = max(0, causal_from - window + 1)
        k, v, causal_from = k[lo:], v[lo:], causal_from - lo
    q_len, seq_len, heads = q.shape[0], k.shape[0], q.shape[1]
    group = heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(causal_from, causal_from + q_len, device=q.device)[:, None]
    keys = torch.arange(seq_len, device=q.device)[None, :]
    visible = keys <= q_pos
    if window > 0:
        visible &= keys > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        column = sinks.float()[:, None, None].expand(heads, q_len, 1)
        probs = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # Decode is prefill with one query token per sequence.
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_attention_prefill(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                   window, softcap, sinks)


def paged_attention_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    qsl = query_start_loc.tolist()
    tables = block_tables.long()
    # One fused attention call per sequence: on the CPU this beats a padded batch,
    # which would do and move work for the longest sequence in every row.
    for i, n in enumerate(seq_lens.tolist()):
        lo, hi = qsl[i], qsl[i + 1]
        if hi == lo:
            continue
        k, v = _blocks_of(k_cache, tables[i], n), _blocks_of(v_cache, tables[i], n)
        out[lo:hi] = _sdpa(query[lo:hi], k, v, scale, n - (hi - lo), window, softcap, sinks)
    return out


def gated_delta_rule(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor,
                     x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, key_heads: int, eps: float) -> torch.Tensor:
    """A linear-attention layer after its convolution (Qwen3.5's Gated DeltaNet), as
    transformers computes it: from the convolved q, k, v of every new token (x [n, C], C =
    2 Hk dk + H dv), q and k L2-normed in fp32 and shared by the value heads of their key
    head, q scaled by dk^-1/2; beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias);
    `delta_rule` on the state slots; each head's output through the gated RMSNorm, weight *
    o / rms(o) times silu(z). Returns [n, H dv] in x's dtype. The native kernel's oracle."""
    n, heads, dv = x.shape[0], A_log.shape[0], norm_weight.shape[0]
    dk = (x.shape[1] - heads * dv) // (2 * key_heads)
    q, k, v = x.float().split([key_heads * dk, key_heads * dk, heads * dv], dim=-1)
    q, k = (t.reshape(n, key_heads, dk).repeat_interleave(heads // key_heads, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    o = delta_rule(state, slots, fresh, starts, q.contiguous(), k.contiguous(), v.reshape(n, heads, dv), g,
                   b.sigmoid().float())
    o = o.to(x.dtype).view(n * heads, dv)
    of = o.float()
    normed = norm_weight * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(z.reshape(n * heads, dv).float())).to(x.dtype).view(n, heads * dv)


def delta_rule(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule (Qwen3.5's linear attention) over every sequence's new tokens,
    on their state slots in place: for each token in order, S <- exp(g) S;
    u = beta (v - S^T k); S <- S + k u^T; o = S^T q, in fp32. state [slots, H, dk, dv];
    slots [b] (distinct); fresh [b] bool: start from zeros; sequence i's tokens are rows
    starts[i] .. starts[i + 1] of q, k [n, H, dk], v [n, H, dv], g and beta [n, H]. Returns
    o [n, H, dv]. One-token sequences (decode) go together a token at a time, longer ones
    in chunks (`chunked`). The native kernel's oracle."""
    out = v.new_empty(v.shape)
    bounds = starts.tolist()
    single = [i for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] == 1]
    if single:
        rows = torch.tensor([bounds[i] for i in single], device=q.device)
        out[rows] = _step(state, slots[single], fresh[single], q[rows], k[rows], v[rows], g[rows], beta[rows])
    for i in range(len(bounds) - 1):
        lo, hi, slot = bounds[i], bounds[i + 1], int(slots[i])
        if hi - lo > 1:
            s = state.new_zeros(state.shape[1:]) if fresh[i] else state[slot]
            out[lo:hi], state[slot] = chunked(s, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi])
    return out


def _step(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token for each of a batch of sequences; q, k [b, H, dk], v [b, H, dv], g, beta [b, H]."""
    b, h = q.shape[:2]
    dk, dv = state.shape[-2:]
    s = state[slots].masked_fill(fresh[:, None, None, None], 0)
    flat = s.view(b * h, dk, dv)  # batched products: no temporary the size of the state
    s.mul_(g.exp()[..., None, None])
    predicted = torch.bmm(k.reshape(b * h, 1, dk), flat).view(b, h, dv)
    flat.baddbmm_(k.reshape(b * h, dk, 1), ((v - predicted) * beta[..., None]).reshape(b * h, 1, dv))
    state[slots] = s
    return torch.bmm(q.reshape(b * h, 1, dk), flat).view(b, h, dv)


def chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens from `state` [H, dk, dv]: q, k [n, H, dk], v [n, H, dv], g
    and beta [n, H]. Returns (o [n, H, dv], the state after the last token).

    In a chunk with decay sums c_t = g_1 + ... + g_t, the state after token t is
    exp(c_t) S0 + sum_{s<=t} exp(c_t - c_s) k_s u_s^T, so u solves (I + L) u =
    beta v - W S0 with L_ts = beta_t exp(c_t - c_s) k_t.k_s below the diagonal and
    W_t = beta_t exp(c_t) k_t. Everything but S0's part is computed for all chunks at
    once; only the state is carried from chunk to chunk. Padding tokens (zero k, v, g and
    beta) change nothing."""
    n, heads = k.shape[:2]
    pad = -n % chunk

    def blocks(t: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, chunks, chunk, ...]
        t = t.transpose(0, 1)
        t = F.pad(t, (0, 0, 0, pad) if t.dim() == 3 else (0, pad)) if pad else t
        return t.reshape(heads, -1, chunk, *t.shape[2:])

    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    dv = v.shape[-1]
    c = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # its diagonal is taken as ones
    rhs = torch.cat([v * beta[..., None], kb * c.exp()[..., None]], dim=-1)
    u, w = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split([dv, k.shape[-1]], -1)
    attn = (q @ k.transpose(-1, -2)) * decay
    q = q * c.exp()[..., None]
    last = c[..., -1:]
    k = k * (last - c).exp()[..., None]
    fade = last.exp()[..., None]  # [H, chunks, 1, 1]
    out = v.new_empty(v.shape)
    for i in range(q.shape[1]):
        corrected = u[:, i] - w[:, i] @ state
        out[:, i] = q[:, i] @ state + attn[:, i] @ corrected
        state = state * fade[:, i] + k[:, i].transpose(-1, -2) @ corrected
    return out.reshape(heads, -1, dv)[:, :n].transpose(0, 1), state


def conv(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor, x: torch.Tensor,
         weight: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """A state-keeping layer's causal depthwise convolution, with SiLU (Qwen3.5's) or
    without (LFM2's, `silu` False), over every sequence's new inputs: state
    [slots, k - 1, C] holds each sequence's last k - 1 inputs
    (zeros where `fresh`); sequence i's new ones are rows starts[i] .. starts[i + 1] of
    x [n, C]; weight [k, C] (the checkpoint's [C, 1, k] transposed). The state then holds
    each sequence's last k - 1 inputs, in place. Returns [n, C]. The native kernel's oracle."""
    out = torch.empty_like(x)
    bounds = starts.tolist()
    taps = weight.t()[:, None, :]
    for i in range(len(bounds) - 1):
        lo, hi, slot = bounds[i], bounds[i + 1], int(slots[i])
        prev = state.new_zeros(state.shape[1:]) if fresh[i] else state[slot]
        window = torch.cat([prev, x[lo:hi].to(state.dtype)])
        state[slot] = window[window.shape[0] - prev.shape[0]:]
        y = F.conv1d(window.t()[None].to(weight.dtype), taps, groups=weight.shape[1])[0].t()
        out[lo:hi] = F.silu(y) if silu else y
    return out
