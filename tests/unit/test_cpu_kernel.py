"""The native CPU paged-attention kernel against float64 dense attention and the torch
reference: decode and chunked prefill in one call, shuffled block tables, partial blocks,
GQA, head_dim 64/128, every cache dtype, and the split path for long lone contexts.

Cache rows no sequence owns are NaN, so a read past a sequence's length fails."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu, reference
from kernels.backend import NativeBackend
from tests.support.kernel_checks import BF16, F16, F32, Paged, check, check_store_kv, dense_attention


def run_case(seq_lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
             block_size: int, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    paged = Paged(seq_lens, kv_heads, head_dim, block_size, dtype, gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = cpu.paged_attention(q, paged.k_nan, paged.v_nan, paged.block_tables, qsl, paged.seq_lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    for s, (lo, hi) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist())):
        want = dense_attention(q[lo:hi], paged.keys[s], paged.values[s], scale)
        check(out[lo:hi], want, dtype, f"seq {s} (len {seq_lens[s]}, q {hi - lo})")
    ref = reference.paged_attention_prefill(q, paged.k_cache, paged.v_cache, paged.block_tables, qsl,
                                            paged.seq_lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2 if dtype != F32 else 1e-4, rtol=2e-2)


@pytest.mark.parametrize("dtype", [F32, BF16, F16])
# group sizes 3, 1, 8 and 5 (the SIMD path takes query heads four at a time); head_dim 40
# is not a multiple of 16, so it takes the portable loops
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 8, 128), (8, 1, 64), (10, 2, 64), (4, 2, 40)])
def test_decode_and_prefill_in_one_call(dtype, heads, kv_heads, head_dim):
    # decodes (q 1), a whole prompt (q == len), chunks continuing a cached prefix, partial blocks
    seq_lens = [1, 17, 33, 100, 40, 250, 16]
    q_lens = [1, 1, 33, 37, 40, 1, 5]
    run_case(seq_lens, q_lens, heads, kv_heads, head_dim, 16, dtype)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, dtype):
    # bf16 prefill takes sixteen keys a group: across two blocks of 8, half a block of 32
    run_case([5, 70, 129, 200], [5, 1, 64, 83], 4, 2, 64, block_size, dtype, seed=block_size)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_long_lone_context_takes_the_split_path(dtype):
    """One sequence, 3,000 tokens: the context is split across threads and merged."""
    run_case([3000], [1], 9, 3, 64, 16, dtype, seed=1)
    run_case([2100], [40], 9, 3, 64, 16, dtype, seed=2)  # a prefill chunk over a long prefix


def test_an_empty_batch_and_the_op_is_registered():
    q = torch.empty(0, 4, 64)
    cache = torch.zeros(2, 16, 2, 64)
    z = torch.zeros(1, 1, dtype=torch.int32)
    out = torch.ops.pagedserve.paged_attention(q, cache, cache, z, torch.zeros(1, dtype=torch.int32),
                                               torch.zeros(0, dtype=torch.int32), 0.125)
    assert out.shape == (0, 4, 64)


def test_the_ops_compose_with_torch_compile():
    """With their shape functions registered, the native ops trace into one torch.compile
    graph (no graph break, dynamic token count) and give the eager result."""
    gen = torch.Generator().manual_seed(3)
    paged = Paged([40, 7], 2, 64, 16, F32, gen)
    qsl = torch.tensor([0, 40, 41], dtype=torch.int32)
    n, heads, kv_heads, d = 41, 4, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
    cos, sin = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    x, residual = torch.randn(n, 96, generator=gen), torch.randn(n, 96, generator=gen)
    weight, gate_up = torch.randn(96, generator=gen), torch.randn(n, 2 * 96, generator=gen)

    def layer(qkv, cos, sin, x, residual, gate_up, k_cache, v_cache, tables, qsl, lens):
        q, _ = cpu.rope_qk(qkv, cos, sin, heads, kv_heads, d)
        attn = cpu.paged_attention(q, k_cache, v_cache, tables, qsl, lens, d ** -0.5)
        normed = cpu.add_rms_norm(x, residual, weight, 1e-5)
        return attn, normed, cpu.silu_mul(gate_up) + 1

    args = (qkv, cos, sin, x, residual, gate_up, paged.k_cache, paged.v_cache, paged.block_tables, qsl,
            paged.seq_lens)
    res_eager, res_compiled = residual.clone(), residual.clone()
    want = layer(*args[:4], res_eager, *args[5:])
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    got = compiled(*args[:4], res_compiled, *args[5:])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(res_compiled, res_eager, atol=0, rtol=0)  # the in-place residual update


@pytest.mark.parametrize("heads_outer", [False, True], ids=["token-rows", "head-major"])
@pytest.mark.parametrize("cache_dtype,src_dtype", [(F32, F32), (BF16, BF16), (BF16, F32)])
def test_store_kv(cache_dtype, src_dtype, heads_outer):
    check_store_kv(NativeBackend(required=True).load(), cache_dtype, src_dtype, heads_outer)


def test_store_kv_refuses_a_slot_outside_the_cache():
    k_cache, v_cache = torch.zeros(2, 16, 3, 64), torch.zeros(2, 16, 3, 64)
    key = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.store_kv(key, key, k_cache, v_cache, torch.tensor([32]))


@pytest.mark.parametrize("field,value,match", [
    ("tables", [[0, 7]], "outside the pool"),  # block 7 of a pool of 4
    ("tables", [[0, -1]], "outside the pool"),
    ("lens", [40], "blocks of 16"),  # longer than its table holds
    ("qsl", [0, 3], "query_start_loc"),  # more queries than the query has
    ("lens", [0], "new tokens"),  # fewer keys than the new tokens themselves
])
def test_paged_attention_refuses_a_layout_that_would_read_outside_its_blocks(field, value, match):
    """The offsets come from Python: a bad one is an error naming it, never a read of
    another sequence's cache or past the pool."""
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    given = {"tables": [[0, 1]], "lens": [20], "qsl": [0, 2]}
    given[field] = value
    q = torch.randn(2, 4, 64)
    with pytest.raises(RuntimeError, match=match):
        cpu.paged_attention(q, k_cache, v_cache, torch.tensor(given["tables"], dtype=torch.int32),
                            torch.tensor(given["qsl"], dtype=torch.int32),
                            torch.tensor(given["lens"], dtype=torch.int32), 0.125)
    ok = cpu.paged_attention(q, k_cache, v_cache, torch.tensor([[0, 1]], dtype=torch.int32),
                             torch.tensor([0, 2], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), 0.125)
    assert ok.shape == q.shape


def test_loading_runs_the_environments_own_ninja_and_rebuilds_nothing(tmp_path):
    """A server (venv bin first on PATH) and a plain `python` found different ninjas, which
    read each other's build log as foreign and recompiled the kernels (~25 s) at every
    start. A process whose PATH offers a broken ninja first still loads the built kernels
    with the environment's own, and the library on disk is untouched."""
    import os
    import subprocess
    import sys

    from torch.utils import cpp_extension

    assert cpu.load()
    name = cpu.build_name()
    so = os.path.join(cpp_extension._get_build_directory(name, verbose=False), f"{name}.so")
    before = os.stat(so).st_mtime_ns
    fake = tmp_path / "ninja"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"}
    code = "from kernels import cpu; assert cpu.load(); print(cpu.op('silu_mul'))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "unavailable" not in res.stderr
    assert os.stat(so).st_mtime_ns == before


def test_the_build_is_named_by_the_sources_content(tmp_path, monkeypatch):
    """Two checkouts of different code on one machine build into two directories instead of
    rebuilding each other's kernels at every load; the same code shares one."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC, copy)
    monkeypatch.setattr(cpu, "SOURCES", [copy / p.name for p in cpu.SOURCES])
    monkeypatch.setattr(cpu, "HEADERS", [copy / p.name for p in cpu.HEADERS])
    same = cpu.build_name()
    (copy / "vec.h").write_text((copy / "vec.h").read_text() + "\n// another checkout\n")
    assert cpu.build_name() != same
    monkeypatch.undo()
    assert cpu.build_name() == same


def test_another_compiler_target_builds_apart(monkeypatch):
    """PAGEDSERVE_CPU_MARCH builds for another target (x86-64-v3 runs the AVX2 paths on an
    AVX-512 machine) into a directory of its own, never over this machine's build."""
    native = cpu.build_name()
    monkeypatch.setenv("PAGEDSERVE_CPU_MARCH", "x86-64-v3")
    assert cpu.march() == "x86-64-v3"
    other = cpu.build_name()
    assert other != native and other.isidentifier()
    monkeypatch.setenv("PAGEDSERVE_CPU_MARCH", "native; rm -rf /")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_MARCH"):
        cpu.march()
    monkeypatch.delenv("PAGEDSERVE_CPU_MARCH")
    assert cpu.build_name() == native
