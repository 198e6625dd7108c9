"""Every Triton kernel, at every configuration the engine launches, compiled for sm_80 and
sm_90 on this GPU-less machine (kernels/triton_compile.py): a spill or more shared memory
than the part has fails here, where the interpreter would have run the kernel happily."""

from __future__ import annotations

import json
import os
import subprocess
import sys


from tests.support.server import ROOT


def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path, capsys):
    from kernels import triton_compile as tc

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # test_kernels sets it
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud (it warns otherwise)
    out = tmp_path / "reports.json"
    run = subprocess.run([sys.executable, "-m", "kernels.triton_compile", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    with capsys.disabled():  # the registers, stack and shared memory of each, in the suite's log
        print("\n" + run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    reports = json.loads(out.read_text())
    assert not [r for r in reports if r["problems"]]
    seen = {(r["kernel"], r["arch"]) for r in reports}
    kernels = {"_store_kv_kernel", "_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel",
               "_add_rms_norm_kernel", "_rope_qk_kernel", "_silu_mul_kernel"}  # the last three: the fused layer's
    assert seen == {(k, a) for k in kernels for a in tc.ARCHS}
    for field, values in (("dtype", tc.DTYPES), ("head_dim", tc.HEAD_DIMS), ("group", tc.GROUPS),
                          ("block_size", tc.BLOCK_SIZES)):
        for kernel in ("_decode_kernel", "_prefill_kernel"):
            assert {r["config"][field] for r in reports if r["kernel"] == kernel} == set(values), (field, kernel)
    for field, values in (("dtype", tc.DTYPES), ("head_dim", tc.HEAD_DIMS)):  # the fused layer's, every head size
        assert {r["config"][field] for r in reports if r["kernel"] == "_rope_qk_kernel"} == set(values), field
    assert all(r["registers"] > 0 for r in reports)
    split = [r for r in reports if r["kernel"] == "_decode_kernel" and r["config"]["path"] == "decode_split"]
    assert {r["config"]["head_dim"] for r in split} == set(tc.HEAD_DIMS)


SPILLING = """
import torch
from kernels import triton_attention as ta, triton_compile as tc
cache = torch.empty(64, 16, 8, 256, dtype=torch.float32, device="meta")
q = torch.empty(128, 8, 256, dtype=torch.float32, device="meta")
i32 = dict(dtype=torch.int32, device="meta")
with tc._recording() as calls:
    ta.paged_attention_prefill(q, cache, cache, torch.empty(4, 64, **i32), torch.empty(5, **i32),
                               torch.empty(4, **i32), 0.1, block_m=16, block_n=64)
[(fn, args, kwargs)] = calls
print(tc.compile_launch(fn, args, {**kwargs, "num_warps": 4}, 90)[1]["stack"])
"""


def test_the_check_sees_a_tile_that_spills():
    """A 16 x 64 fp32 tile at head size 256 on four warps spills on sm_90: the resource
    reading must say so, or the sweep above proves nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-c", SPILLING], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) > 0
