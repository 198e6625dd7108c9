"""What each CPU gets: the engine asks the same availability checks the tests ask (bf16
packing needs AVX-512 or AVX-NE-CONVERT; an AVX2 CPU keeps plain nn.Linear), and the
allocator setting every CPU engine process applies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.packed_linear import PackedLinear, supported


ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_cpu_that_cannot_pack_bf16_keeps_plain_linears(dtype, tiny_model_factory):
    """The loader's side of PackedLinear's refusal: every projection packed where this CPU
    can pack dtype, plain nn.Linear where it cannot (bf16 on AVX2), and the model generates
    either way."""
    model = str(tiny_model_factory("pack-or-keep", tie_word_embeddings=False))
    kw = dict(dtype=str(dtype).split(".")[1], max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model, **kw) as llm:
        net = llm.engine.executor.runner.model
        linears = [m for m in net.layers.modules() if isinstance(m, (PackedLinear, torch.nn.Linear))]
        assert linears and all(isinstance(m, PackedLinear) == supported(torch.device("cpu"), dtype) for m in linears)
        got = llm.generate([[3, 14, 15, 92, 65]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 12 and all(0 <= t < 49152 for t in got)


ALLOCATOR = """
import ctypes, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 30 << 20  # a step's logits at 160 rows of a 49,152-token vocabulary; under the 32 MB bound

def probe():
    before = libc.mallinfo2()
    first = libc.malloc(size)
    mapped = libc.mallinfo2().hblks - before.hblks
    libc.free(first)
    kept = libc.mallinfo2().fordblks
    second = libc.malloc(size)
    libc.free(second)
    return [mapped, int(kept >= size), int(second == first)]

default = probe()  # glibc as it comes, before anything is imported
from engine import LLM
LLM(sys.argv[1], dtype="float32", max_num_seqs=4, max_model_len=128)
print(*default, *probe())
"""


def test_an_engine_process_keeps_freed_step_buffers_mapped(tiny_model_factory):
    """glibc's default serves a block of over 128 KB (a step's activations and logits) with
    its own mmap and unmaps it on free, so every step faults its buffers in afresh.
    Building a CPU engine applies kernels.cpu.keep_freed_memory: a 30 MB block then comes
    from the heap, stays there once freed, and the next one reuses its address. Checked
    through glibc's own accounting, which the host cannot change; the page faults this
    saves are scripts/bench_page_faults.py's to count."""
    model = str(tiny_model_factory("allocator", num_hidden_layers=1, hidden_size=64))
    res = subprocess.run([sys.executable, "-c", ALLOCATOR, model], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = [int(v) for v in res.stdout.split()[-6:]]
    assert seen[0] == 1, seen  # glibc's default: its own mapping, unmapped on free
    assert seen[3:] == [0, 1, 1], seen  # in an engine process: from the heap, kept when freed, reused


def test_a_build_killed_midway_does_not_hang_the_next_start():
    """cpp_extension waits, forever, while its `lock` file exists; a killed build leaves one.
    The next process must load the kernels anyway (kernels/cpu.py `_sole_builder`)."""
    from torch.utils import cpp_extension

    from kernels import cpu

    assert cpu.load()  # built, as `make setup` leaves it
    lock = Path(cpp_extension._get_build_directory(cpu.build_name(), False)) / "lock"
    lock.touch()  # what a build killed midway leaves
    out = subprocess.run([sys.executable, "-c", "from kernels import cpu; print(cpu.load())"], cwd=ROOT,
                         capture_output=True, text=True, timeout=240)
    assert out.stdout.split() == ["True"], out.stderr[-2000:]
    assert not lock.exists()
