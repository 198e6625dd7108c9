"""Paged KV data and float64 oracles the kernel tests share.

Importing this module first sets TRITON_INTERPRET=1 (unless KERNELS_NATIVE=1 asks for a
CUDA device), which must happen before triton is imported anywhere in the process."""

from __future__ import annotations

import os

NATIVE = os.environ.get("KERNELS_NATIVE") == "1"
if not NATIVE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

DEVICE = "cuda" if NATIVE else "cpu"
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (atol, rtol) against float64 attention over the same (rounded) q, K and V.
TOL = {F32: (1e-4, 1e-4), F16: (4e-3, 4e-3), BF16: (3e-2, 3e-2)}


class Paged:
    """Contiguous per-sequence K/V and the same data in a paged cache."""

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, gen: torch.Generator) -> None:
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(need) + 3  # spare blocks nobody owns
        width = max(need) + 2  # padding columns hold garbage (but valid) block ids
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)  # garbage everywhere
        self.v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
        owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.keys, self.values = [], []
        for s, n in enumerate(seq_lens):
            blocks = torch.tensor(perm[: need[s]])
            perm = perm[need[s]:]
            tables[s, : need[s]] = blocks
            pos = torch.arange(n)
            k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            self.k_cache[blocks[pos // block_size], pos % block_size] = k
            self.v_cache[blocks[pos // block_size], pos % block_size] = v
            owned[blocks[pos // block_size], pos % block_size] = True
            self.keys.append(k)
            self.values.append(v)
        self.block_tables = tables.to(torch.int32)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.k_nan, self.v_nan = self.k_cache.clone(), self.v_cache.clone()
        self.k_nan[~owned] = float("nan")
        self.v_nan[~owned] = float("nan")

    def to(self, device: str) -> Paged:
        for name in ("k_cache", "v_cache", "k_nan", "v_nan", "block_tables", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """float64 causal attention of the last q.shape[0] positions; q [Q,H,D], k/v [L,Hkv,D]."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    n_q, n = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    q_pos = torch.arange(n - n_q, n)[:, None]
    scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


def check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or leaked)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def check_store_kv(backend, cache_dtype: torch.dtype, src_dtype: torch.dtype, heads_outer: bool = False) -> None:
    """Rows land in their slots, padding slots (-1) write nothing. `heads_outer` lays the
    source out head-major, so a token's row is not contiguous."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim, n = 7, 16, 3, 64, 50
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    # key and value as strided views of one fused qkv projection, as a model produces them.
    qkv = torch.randn(n, 3, num_kv_heads, head_dim, generator=gen).to(src_dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    if heads_outer:
        key, value = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (key, value))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.randperm(n, generator=gen)[:12]] = -1
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_exp[slot // block_size, slot % block_size] = key[t].to(cache_dtype)
            v_exp[slot // block_size, slot % block_size] = value[t].to(cache_dtype)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    backend.store_kv(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    written = written.view(num_blocks, block_size)
    for got, exp in ((k_cache.cpu(), k_exp), (v_cache.cpu(), v_exp)):
        assert torch.equal(got[~written], exp[~written]), "a row that was not stored changed"
        if src_dtype == cache_dtype:
            assert torch.equal(got[written], exp[written])
        else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even
            torch.testing.assert_close(got[written], exp[written], atol=0, rtol=2**-7)
