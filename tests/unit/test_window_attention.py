"""Sliding-window, soft-capped and sink paged attention, in every backend, against float64.

Windowed layers (Mistral, Qwen2's upper layers, Gemma's local layers) let query p see
keys (p - window, p] only; Gemma 2 caps each scaled score s at cap * tanh(s / cap);
gpt-oss adds a learned logit per head (a sink) to each softmax, a key with no value. All
are checked on batches mixing decodes, whole prompts and chunks whose queries start past
the window, with every cache row no sequence owns NaN for the kernels that read the cache
in place, so a read outside a window's sequence shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.kernel_checks import DEVICE, Paged, check, nan_like  # sets TRITON_INTERPRET before triton loads
from kernels import cpu, reference, triton_attention


# (seq_lens, q_lens): decodes, a whole prompt, and chunks that start inside and past the window.
# Short contexts (the longest under 64) are not split across threads, long ones are. "prompts":
# a chunk after a long prefix and a whole prompt, whose rows and keys span several of a tiled
# path's query chunks and key chunks (the AMX tiles pack 512 keys at a time).
BATCHES = {"long": ([70, 9, 41, 128], [1, 9, 17, 40]), "short": ([31, 20, 40], [1, 20, 3]),
           "prompts": ([1100, 600], [150, 600])}


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int, softcap: float,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64 attention of the last q.shape[0] positions, windowed, capped and sunk."""
    q, k, v = q.double(), k.double(), v.double()
    n_q, n = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos, keys = torch.arange(n - n_q, n)[:, None], torch.arange(n)[None, :]
    hidden = keys > q_pos
    if window:
        hidden |= keys <= q_pos - window
    scores = scores.masked_fill(hidden, -math.inf)
    if sinks is not None:  # one more column per head, dropped after the softmax
        column = sinks.double()[:, None, None].expand(-1, n_q, 1)
        return torch.einsum("hql,lhd->qhd", torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1], v)
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, -1), v)


def setup(dtype: torch.dtype, window: int, softcap: float, batch: str, block_size: int = 16, seed: int = 0,
          sinks: bool = False):
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = BATCHES[batch]
    heads, kv_heads, head_dim = 4, 2, 64
    paged = Paged(seq_lens, kv_heads, head_dim, block_size, dtype, gen)
    query = (torch.randn(sum(q_lens), heads, head_dim, generator=gen) * 2).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim ** -0.5
    # Sinks around the scores' own size, one far above them (that head's rows near zero), one far below.
    sink = torch.tensor([0.5, -1.5, 6.0, -30.0]) if sinks else None
    expected = torch.cat([dense(query[qsl[s]:qsl[s + 1]], paged.keys[s], paged.values[s], scale, window, softcap,
                                sink) for s in range(len(seq_lens))])
    return paged, query, qsl, scale, expected, sink


# (window, softcap, sinks)
CASES = {"window5": (5, 0.0, False), "window16": (16, 0.0, False), "window33_capped": (33, 5.0, False),
         "capped": (0, 5.0, False), "sinks": (0, 0.0, True), "window5_sinks": (5, 0.0, True)}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_and_native_kernels_honour_window_and_cap(case, dtype, batch) -> None:
    window, softcap, sinks = case
    paged, query, qsl, scale, expected, sink = setup(dtype, window, softcap, batch,
                                                     block_size=8 if batch == "short" else 16, sinks=sinks)
    ref = reference.paged_attention_prefill(query, paged.k_cache, paged.v_cache, paged.block_tables, qsl,
                                            paged.seq_lens, scale, window, softcap, sink)
    check(ref, expected, dtype, "reference")
    if not cpu.available():
        pytest.fail("the native CPU kernels did not build")
    out = cpu.paged_attention(query, paged.k_nan, paged.v_nan, paged.block_tables, qsl, paged.seq_lens, scale,
                              window, softcap, sink)
    check(out, expected, dtype, "native")


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_kernels_honour_window_and_cap(case) -> None:
    window, softcap, sinks = case
    dtype = torch.float32
    paged, query, qsl, scale, expected, sink = setup(dtype, window, softcap, "long", block_size=8, seed=1,
                                                     sinks=sinks)
    # On the device with KERNELS_NATIVE=1 (scripts/gpu_check.sh), in the interpreter otherwise.
    paged, query, qsl = paged.to(DEVICE), query.to(DEVICE), qsl.to(DEVICE)
    sink = None if sink is None else sink.to(DEVICE)
    out = triton_attention.paged_attention_prefill(query, paged.k_nan, paged.v_nan, paged.block_tables, qsl,
                                                   paged.seq_lens, scale, window, softcap, sink, out=nan_like(query),
                                                   block_m=32, block_n=16)
    check(out, expected, dtype, "triton prefill")
    # Decode: each sequence's last token alone, single pass and split-K.
    last = qsl[1:].long() - 1
    for splits in (1, 3):
        dec = triton_attention.paged_attention_decode(query[last], paged.k_nan, paged.v_nan, paged.block_tables,
                                                      paged.seq_lens, scale, window, softcap, sink,
                                                      out=nan_like(query[last]), num_splits=splits, block_n=16)
        check(dec, expected[last.cpu()], dtype, f"triton decode, {splits} splits")
