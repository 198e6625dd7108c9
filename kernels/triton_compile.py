"""Compile every Triton kernel for real NVIDIA targets on a machine with no GPU.

Triton's interpreter runs programs that a GPU build rejects or runs badly (a tile that
spills registers, shared memory past what the part has), so the CPU tests alone say
nothing about sm_80 or sm_90. Here each kernel is compiled, with Triton's own compiler
and the ptxas it ships, exactly as the engine would launch it: the launch wrappers in
triton_attention and triton_fused run on meta tensors with the kernels swapped for
recorders, and each recorded launch goes through Triton's own argument binder (types,
the constant 1, 16-byte alignment) before `triton.compile` for the target. The cubin's resource usage
(cuobjdump) gives registers, stack (where spills go) and local memory; Triton's metadata
gives the shared memory the launch asks for.

Run it in a process without TRITON_INTERPRET=1 (the interpreter replaces the kernels):
`python -m kernels.triton_compile [--json PATH]`; it exits 1 when any kernel spills or
asks for more shared memory than the target has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import torch

# What a block may use, opted in: A100 (sm_80) and H100 (sm_90).
SHARED_LIMIT = {80: 166_912, 90: 232_448}
ARCHS = (80, 90)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8)  # query heads per KV head: MHA, Llama-3 / Gemma 3 270M, Qwen3 (up to 16 shares a tile)
BLOCK_SIZES = (8, 16, 32)
PATHS = ("store_kv", "decode", "decode_split", "prefill", "fused")
_KERNELS = {"triton_attention": ("_store_kv_kernel", "_decode_kernel", "_decode_reduce_kernel", "_prefill_kernel"),
            "triton_fused": ("_add_rms_norm_kernel", "_silu_mul_kernel", "_rope_qk_kernel")}


@dataclass(frozen=True)
class Config:
    """One launch the engine makes. Group and block size only enter index arithmetic and
    masks, so the sweep takes every dtype x head size x path and rotates those two through
    it (each value meets every head size and every path), rather than their full product."""

    path: str
    dtype: str
    head_dim: int
    group: int
    block_size: int
    softcap: bool  # Gemma 2's soft-capped scores: more code in the inner loop
    sinks: bool = False  # gpt-oss's attention sinks (head size 64): the softmax's starting state


@dataclass(frozen=True)
class Report:
    kernel: str
    arch: int
    config: Config
    registers: int
    stack: int  # bytes of stack frame: spilled registers live here
    local: int
    shared: int  # bytes of shared memory the launch asks for

    def problems(self) -> list[str]:
        out = []
        if self.stack or self.local:
            out.append(f"spills: {self.stack} B stack, {self.local} B local")
        if self.shared > SHARED_LIMIT[self.arch]:
            out.append(f"shared memory {self.shared} B > {SHARED_LIMIT[self.arch]} B")
        return out


def configs() -> list[Config]:
    out = []
    for i, (dtype, head_dim) in enumerate((d, h) for d in DTYPES for h in HEAD_DIMS):
        for j, path in enumerate(PATHS):
            out.append(Config(path, dtype, head_dim, GROUPS[(i + j) % len(GROUPS)],
                              BLOCK_SIZES[(i // len(GROUPS) + j) % len(BLOCK_SIZES)], softcap=head_dim == 256,
                              sinks=head_dim == 64))
    return out


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` is recorded."""

    def __init__(self, fn: Any, calls: list) -> None:
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


@contextlib.contextmanager
def _recording() -> Iterator[list]:
    import importlib

    calls: list = []
    saved = []
    for module_name, names in _KERNELS.items():
        mod = importlib.import_module(f"kernels.{module_name}")
        saved += [(mod, name, getattr(mod, name)) for name in names]
    for mod, name, fn in saved:
        setattr(mod, name, _Recorder(fn, calls))
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def launches(cfg: Config) -> list[tuple[Any, tuple, dict]]:
    """The kernel launches the engine's wrappers make for this config, on meta tensors; the
    "fused" path is the decoder's fused layer around an attention of this shape (a hidden
    size of its query heads, an MLP three times that; Gemma's fp32 norm weight with the
    soft-capped config, q/k norms from a group of four up)."""
    from kernels import triton_attention as ta
    from kernels import triton_fused as tf

    dtype, kv_heads, seqs, blocks = DTYPES[cfg.dtype], 8, 4, 512
    heads = kv_heads * cfg.group
    meta = dict(device="meta")
    cache = torch.empty(blocks, cfg.block_size, kv_heads, cfg.head_dim, dtype=dtype, **meta)
    tables = torch.empty(seqs, 4096 // cfg.block_size, dtype=torch.int32, **meta)
    lens = torch.empty(seqs, dtype=torch.int32, **meta)
    cap = 50.0 if cfg.softcap else 0.0
    sinks = torch.empty(kv_heads * cfg.group, dtype=torch.float32, **meta) if cfg.sinks else None
    with _recording() as calls:
        if cfg.path == "fused":
            hidden, rows = heads * cfg.head_dim, 16
            x = torch.empty(rows, hidden, dtype=dtype, **meta)
            tf.add_rms_norm(x, x, torch.empty(hidden, dtype=torch.float32 if cfg.softcap else dtype, **meta), 1e-6)
            qkv = torch.empty(rows, (heads + 2 * kv_heads) * cfg.head_dim, dtype=dtype, **meta)
            rope = torch.empty(rows, cfg.head_dim, dtype=dtype, **meta)
            norm = torch.empty(heads + kv_heads, cfg.head_dim, **meta) if cfg.group >= 4 else None
            tf.rope_qk(qkv, rope, rope, heads, kv_heads, cfg.head_dim, norm, 1e-6)
            tf.silu_mul(torch.empty(rows, 6 * hidden, dtype=dtype, **meta))
        elif cfg.path == "store_kv":
            kv = torch.empty(64, kv_heads, cfg.head_dim, dtype=dtype, **meta)
            ta.store_kv(kv, kv, cache, cache, torch.empty(64, dtype=torch.int64, **meta))
        elif cfg.path.startswith("decode"):
            q = torch.empty(seqs, heads, cfg.head_dim, dtype=dtype, **meta)
            ta.paged_attention_decode(q, cache, cache, tables, lens, 0.1, softcap=cap, sinks=sinks,
                                      num_splits=8 if cfg.path == "decode_split" else 1)
        else:
            q = torch.empty(256, heads, cfg.head_dim, dtype=dtype, **meta)
            starts = torch.empty(seqs + 1, dtype=torch.int32, **meta)
            ta.paged_attention_prefill(q, cache, cache, tables, starts, lens, 0.1, softcap=cap, sinks=sinks)
    return calls


def _resources(cubin: bytes, name: str) -> dict[str, int]:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    line = text[text.index(f"Function {name}"):].splitlines()[1]
    return {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", line)}


def compile_launch(fn: Any, args: tuple, kwargs: dict, arch: int) -> tuple[str, dict[str, int], int]:
    """Compile one recorded launch for sm_<arch> as Triton's launcher would: its binder
    types and specialises the arguments, then `triton.compile` for the target."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, options, bound, specialization, options)
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return fn.__name__, _resources(kernel.asm["cubin"], kernel.metadata.name), kernel.metadata.shared


def _compile_config(job: tuple[Config, int]) -> list[Report]:
    cfg, arch = job
    out = []
    for fn, args, kwargs in launches(cfg):
        name, res, shared = compile_launch(fn, args, kwargs, arch)
        out.append(Report(name, arch, cfg, res["reg"], res["stack"], res["local"], shared))
    return out


def sweep(jobs: int | None = None) -> list[Report]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile the kernels in a process without TRITON_INTERPRET=1")
    work = [(cfg, arch) for cfg in configs() for arch in ARCHS]
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as pool:
        return [r for reports in pool.map(_compile_config, work) for r in reports]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every report here")
    parser.add_argument("--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    reports = sweep(args.jobs)
    print(f"{'kernel':<24}{'arch':>6} {'dtype':>5}{'head':>5}{'group':>6}{'block':>6}{'cap':>4}"
          f"{'regs':>6}{'stack':>6}{'local':>6}{'shared':>8}  problems")
    for r in reports:
        c = r.config
        print(f"{r.kernel:<24}{'sm_' + str(r.arch):>6} {c.dtype:>5}{c.head_dim:>5}{c.group:>6}{c.block_size:>6}"
              f"{'y' if c.softcap else '':>4}{r.registers:>6}{r.stack:>6}{r.local:>6}{r.shared:>8}  "
              + "; ".join(r.problems()))
    bad = [r for r in reports if r.problems()]
    print(f"{len(reports)} kernels compiled, {len(bad)} with problems")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "problems": r.problems()} for r in reports], f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
