"""Paged-attention kernels against the torch reference and an independent float64 oracle.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set before triton is
imported); KERNELS_NATIVE=1 runs them natively on a CUDA device instead.

Every case builds each sequence's K/V as a contiguous tensor first, scatters it into a
paged cache through a shuffled block table (partial last blocks, spare blocks, garbage
padding columns), and compares against dense float64 attention over the contiguous K/V.
For the Triton path every cache row no sequence owns is NaN and outputs and scratch
buffers are NaN-filled (torch.empty is patched), so a read past the sequence or an
unwritten output element fails the test.
"""

from __future__ import annotations

from tests.support.kernel_checks import (  # first: sets TRITON_INTERPRET before triton loads
    BF16, DEVICE, F16, F32, NATIVE, Paged, check, check_store_kv, dense_attention, nan_like,
)

import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.backend import TorchBackend, TritonBackend  # noqa: E402

BACKENDS = {"torch": TorchBackend(), "triton": TritonBackend()}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch.empty / empty_like return NaN-filled floating tensors."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_fill(empty_like(*a, **k)))


# ---------------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("cache_dtype,src_dtype",
                         [(F32, F32), (BF16, BF16), (F16, F16), (BF16, F32)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_store_kv(backend: str, cache_dtype: torch.dtype, src_dtype: torch.dtype) -> None:
    check_store_kv(BACKENDS[backend], cache_dtype, src_dtype)


# ------------------------------------------------------------------------------------ decode

DECODE_CASES = {
    # name: (seq_lens, num_kv_heads, group, head_dim, block_size, dtype, forced num_splits)
    "mixed-g3-d64-bs8": ([1, 2, 17, 100, 333], 2, 3, 64, 8, F32, 4),
    "g8-d128-bs16": ([5, 64, 513], 1, 8, 128, 16, F32, 3),
    "g1-d128-bs32": ([7, 130, 32], 2, 1, 128, 32, F32, 2),
    "long2048-g8-bs32": ([2048, 700], 1, 8, 128, 32, F32, 8),
    "bf16-g3-d64-bs16": ([1, 50, 300], 2, 3, 64, 16, BF16, 3),
    "fp16-g8-d128-bs8": ([9, 200], 1, 8, 128, 8, F16, 2),
    "long2048-bf16-g8-bs16": ([2048], 1, 8, 128, 16, BF16, 6),
    "batch16-g3-d80-bs16": ([1, 3, 16, 17, 31, 64, 90, 128, 129, 200, 255, 256, 300, 333, 399, 400],
                            2, 3, 80, 16, F32, 5),  # head_dim 80: padded to 128 with masks
}


def run_decode(seq_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
               block_size: int, dtype: torch.dtype, splits: int, seed: int) -> None:
    from kernels import triton_attention

    gen = torch.Generator().manual_seed(seed)
    paged = Paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen).to(DEVICE)
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    query = query.to(DEVICE)
    scale = 1 / math.sqrt(head_dim)
    args = (paged.block_tables, paged.seq_lens, scale)
    expected = torch.cat([dense_attention(query[s : s + 1], paged.keys[s], paged.values[s], scale)
                          for s in range(len(seq_lens))])
    ref = reference.paged_attention_decode(query, paged.k_cache, paged.v_cache, *args)
    check(ref, expected, dtype, "reference")
    check(TorchBackend().decode(query, paged.k_cache, paged.v_cache, *args), expected, dtype, "torch backend")
    outs = {"backend": TritonBackend().decode(query, paged.k_nan, paged.v_nan, *args)}
    for n in (1, splits):
        outs[f"num_splits={n}"] = triton_attention.paged_attention_decode(
            query, paged.k_nan, paged.v_nan, *args, out=nan_like(query), num_splits=n)
    for name, out in outs.items():
        check(out, expected, dtype, f"triton {name} vs float64")
        check(out, ref, dtype, f"triton {name} vs reference")


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode(case: tuple, poison_empty: None) -> None:
    run_decode(*case, seed=2)


def test_decode_fresh_random(poison_empty: None) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    lens = [rng.randint(1, 600) for _ in range(rng.randint(1, 4))]
    case = (lens, rng.choice([1, 2]), rng.choice([1, 3, 8]), rng.choice([64, 128]),
            rng.choice([8, 16, 32]), F32, rng.randint(2, 5))
    try:
        run_decode(*case, seed=seed)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} case={case}: {e}") from e


def test_split_heuristic() -> None:
    from kernels.triton_attention import choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 512, cpu) == 1  # short context: single pass
    assert choose_num_splits(256, 8, 32768, cpu) == 1  # grid already full
    assert choose_num_splits(1, 1, 32768, cpu) > 1  # one program would idle the GPU


# ----------------------------------------------------------------------------------- prefill

PREFILL_CASES = {
    # name: ([(seq_len, q_len), ...], num_kv_heads, group, head_dim, block_size, dtype)
    "mixed-g3-d64-bs8": ([(1, 1), (17, 17), (40, 5), (100, 1), (129, 64)], 2, 3, 64, 8, F32),
    "g8-d128-bs16": ([(300, 300), (513, 77), (64, 1), (33, 20)], 1, 8, 128, 16, F32),
    "chunked-g1-d64-bs32": ([(1000, 1), (700, 200), (31, 31)], 2, 1, 64, 32, F32),
    "long2048-g1-d128-bs16": ([(2048, 2048)], 1, 1, 128, 16, F32),
    "bf16-g3-d64-bs16": ([(50, 50), (300, 100), (1, 1)], 2, 3, 64, 16, BF16),
    "fp16-g8-d128-bs32": ([(70, 70), (129, 3)], 1, 8, 128, 32, F16),
    "long2048-chunk-bf16-g8-bs8": ([(2048, 24), (1500, 1)], 1, 8, 128, 8, BF16),
    "d80-g3-bs8": ([(90, 90), (200, 37)], 1, 3, 80, 8, F32),
}


def run_prefill(seqs: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int,
                block_size: int, dtype: torch.dtype, seed: int) -> None:
    from kernels import triton_attention

    gen = torch.Generator().manual_seed(seed)
    paged = Paged([n for n, _ in seqs], num_kv_heads, head_dim, block_size, dtype, gen).to(DEVICE)
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    query = query.to(DEVICE)
    scale = 1 / math.sqrt(head_dim)
    args = (paged.block_tables, qsl, paged.seq_lens, scale)
    starts = qsl.tolist()
    expected = torch.cat([dense_attention(query[starts[s] : starts[s + 1]], paged.keys[s],
                                          paged.values[s], scale) for s in range(len(seqs))])
    ref = reference.paged_attention_prefill(query, paged.k_cache, paged.v_cache, *args)
    check(ref, expected, dtype, "reference")
    check(TorchBackend().prefill(query, paged.k_cache, paged.v_cache, *args), expected, dtype, "torch backend")
    outs = {"backend": TritonBackend().prefill(query, paged.k_nan, paged.v_nan, *args)}
    if len(seqs) > 1:  # a second tiling: other tile/sequence boundaries, same answer
        outs["block_m=32,block_n=32"] = triton_attention.paged_attention_prefill(
            query, paged.k_nan, paged.v_nan, *args, out=nan_like(query), block_m=32, block_n=32)
    for name, out in outs.items():
        check(out, expected, dtype, f"triton {name} vs float64")
        check(out, ref, dtype, f"triton {name} vs reference")


def _sweep() -> list:
    from kernels import triton_compile

    # the fused layer's launches run on the device in tests/unit/test_fused_ops.py
    return [c for c in triton_compile.configs() if c.path not in ("store_kv", "fused")]


@pytest.mark.skipif(not NATIVE, reason="device tiles: scripts/gpu_check.sh runs this file with KERNELS_NATIVE=1")
@pytest.mark.parametrize("cfg", _sweep(), ids=lambda c: f"{c.path}-{c.dtype}-d{c.head_dim}-g{c.group}-bs{c.block_size}")
def test_every_compiled_configuration_runs_right_on_the_device(cfg, poison_empty: None) -> None:
    """The launches kernels/triton_compile.py compiles for sm_80 and sm_90, with the tiles
    the wrappers pick on a GPU, run there against float64 attention and the reference.
    (In the interpreter the wrappers pick its own tiles, which the cases above cover.)"""
    from kernels import triton_compile

    dtype = triton_compile.DTYPES[cfg.dtype]
    if cfg.path == "prefill":
        run_prefill([(40, 40), (90, 9), (1, 1)], 2, cfg.group, cfg.head_dim, cfg.block_size, dtype, seed=cfg.head_dim)
    else:
        run_decode([1, 37, 90], 2, cfg.group, cfg.head_dim, cfg.block_size, dtype,
                   splits=3 if cfg.path == "decode_split" else 1, seed=cfg.head_dim)


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill(case: tuple, poison_empty: None) -> None:
    run_prefill(*case, seed=3)


def test_prefill_fresh_random(poison_empty: None) -> None:
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randint(1, 4)):
        n = rng.randint(1, 300)
        seqs.append((n, rng.choice([1, n, rng.randint(1, n)])))
    case = (seqs, rng.choice([1, 2]), rng.choice([1, 3, 8]), rng.choice([64, 128]),
            rng.choice([8, 16, 32]), F32)
    try:
        run_prefill(*case, seed=seed)
    except AssertionError as e:
        raise AssertionError(f"seed={seed} case={case}: {e}") from e


# ------------------------------------------------------ the torch reference on its own (fast)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.integers(1, 200).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))),
                  min_size=1, max_size=5),
    group=st.sampled_from([1, 3, 8]),
    block_size=st.sampled_from([8, 16, 32]),
    head_dim=st.sampled_from([64, 128]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_matches_dense(seqs: list[tuple[int, int]], group: int, block_size: int,
                                 head_dim: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    paged = Paged([n for n, _ in seqs], 2, head_dim, block_size, F32, gen)
    q_lens = [q for _, q in seqs]
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    query = torch.randn(sum(q_lens), 2 * group, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    out = reference.paged_attention_prefill(query, paged.k_cache, paged.v_cache,
                                            paged.block_tables, qsl, paged.seq_lens, scale)
    starts = qsl.tolist()
    for s in range(len(seqs)):
        q = query[starts[s] : starts[s + 1]]
        exp = dense_attention(q, paged.keys[s], paged.values[s], scale)
        check(out[starts[s] : starts[s + 1]], exp, F32, f"prefill seq {s}")
    last = query[qsl[1:].long() - 1]  # each sequence's newest token, as a decode step
    out = reference.paged_attention_decode(last, paged.k_cache, paged.v_cache, paged.block_tables,
                                           paged.seq_lens, scale)
    for s in range(len(seqs)):
        exp = dense_attention(last[s : s + 1], paged.keys[s], paged.values[s], scale)
        check(out[s : s + 1], exp, F32, f"decode seq {s}")
