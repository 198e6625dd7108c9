"""The native CPU kernels (csrc/): paged attention, the fused RMSNorm-with-residual and
SiLU-and-multiply the dense layers use, and GEMMs on quantized weights (kernels/quant.py).
Build, load, call.

Built with torch.utils.cpp_extension on first use (or ahead of time by `make setup`,
which runs `python -m kernels.cpu`) and cached under torch's extension directory. The
build targets this machine's CPU (-march=native), so the cache key includes the CPU's
flags, and the sources' content: a cache directory shared by different machines never
hands one a binary built for another, nor two checkouts each other's. Without a compiler, `available()` is False after a one-line warning and
the engine keeps the torch path.

PAGEDSERVE_CPU_MARCH names another target (`x86-64-v3`: AVX2 and FMA, no AVX-512), so
that the AVX2 paths can be run and timed on an AVX-512 machine (scripts/bench_latency.py
--isa avx2); it is part of the build's name.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp", CSRC / "fused.cpp", CSRC / "quant.cpp", CSRC / "quant_k.cpp",
           CSRC / "quant_a8.cpp", CSRC / "qgemm.cpp", CSRC / "gemm.cpp", CSRC / "sample.cpp",
           CSRC / "linear_attention.cpp"]
HEADERS = sorted(CSRC.glob("*.h"))  # every header: a list by hand missed prefill512.h
_state: dict[str, object] = {}
_ops: dict[str, object] = {}  # name -> op, once loaded (a decode step makes ~300 calls)
_path_lock = threading.Lock()
_unpinned: dict[int, set[int]] = {}  # thread id -> its CPU set before bind_threads pinned it


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = os.uname().machine
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def _sources_key() -> str:
    """The sources' and headers' content. In the build's name, with the CPU's key: two
    checkouts or installs of different code on one machine then build into two
    directories, where with one name each rebuilt the other's kernels (about 2.5 minutes
    on 2 cores) every time it loaded them. cpp_extension alone rebuilds on a source or
    flag change but not on a header's, which this covers too."""
    digest = hashlib.sha256()
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:10]


def march() -> str:
    """The compiler's target: this machine's CPU unless PAGEDSERVE_CPU_MARCH names one."""
    name = os.environ.get("PAGEDSERVE_CPU_MARCH", "") or "native"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"PAGEDSERVE_CPU_MARCH={name!r} is not a compiler target name (e.g. x86-64-v3)")
    return name


def build_name() -> str:
    target = march()
    suffix = "" if target == "native" else "_" + re.sub(r"[^A-Za-z0-9]", "_", target)  # a C identifier
    return f"pagedserve_cpu_{_cpu_key()}_{_sources_key()}{suffix}"


def load() -> bool:
    """Build (once per machine and source) and load the kernel; False if that is impossible."""
    if "ok" in _state:
        return bool(_state["ok"])
    try:
        from torch.utils import cpp_extension

        name = build_name()
        with _own_ninja(), _sole_builder(name):
            cpp_extension.load(
                name=name,
                sources=[str(p) for p in SOURCES],
                extra_cflags=["-O3", f"-march={march()}", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math"],
                extra_include_paths=[str(CSRC)],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
        _register_fakes()
        _state["ok"] = True
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("native CPU attention unavailable, using the torch path: %s", str(exc).splitlines()[0])
        _state["ok"] = False
    return bool(_state["ok"])


@contextlib.contextmanager
def _sole_builder(name: str) -> Iterator[None]:
    """cpp_extension guards a build with a `lock` file in its directory and, while one
    exists, waits for it to go: forever, silently. A build killed midway (Ctrl-C during
    the first `make serve`, a cancelled CI job) leaves that file behind, and every later
    start then hung, loading an up-to-date build included. Here each builder first takes
    an flock, which the kernel drops when its holder dies: the holder is the only builder
    of this name, so a `lock` file it finds is a dead one's and is removed."""
    from torch.utils import cpp_extension

    try:
        build_dir = Path(cpp_extension._get_build_directory(name, False))  # torch's own layout
    except Exception:  # noqa: BLE001 - its private helper moved: build as before
        yield
        return
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


@contextlib.contextmanager
def _own_ninja() -> Iterator[None]:
    """cpp_extension runs whichever `ninja` comes first on PATH. Two versions (a system one
    and the PyPI one in this environment) read each other's build log as foreign and rebuild
    everything: a `bentoml serve` (venv bin first on PATH) and a plain `python` then
    recompiled the kernels (~25 s) each time the other had loaded them. The environment's
    own ninja, when it has one, is always the one run."""
    try:
        import ninja
    except ImportError:
        yield
        return
    with _path_lock:
        saved = os.environ.get("PATH", "")
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + saved
        try:
            yield
        finally:
            os.environ["PATH"] = saved


def _register_fakes() -> None:
    """Shape-only versions of the ops, so torch.compile can trace through them."""
    lib = "pagedserve::"

    @torch.library.register_fake(lib + "paged_attention")
    def _(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, window=0, softcap=0.0,
          sinks=None):
        return torch.empty_like(query)

    @torch.library.register_fake(lib + "store_kv")
    def _(key, value, k_cache, v_cache, slot_mapping):
        return None

    @torch.library.register_fake(lib + "rope_qk")
    def _(qkv, cos, sin, H, Hkv, d, norm=None, eps=0.0):
        n = qkv.shape[0]
        return qkv.new_empty(n, H, d), qkv.new_empty(n, Hkv, d)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, residual, weight, eps):
        return torch.empty_like(residual)

    @torch.library.register_fake(lib + "silu_mul")
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake(lib + "gemm")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "gemm_glu")
    def _(x, panels, n, bias):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "moe_glu")
    def _(x, offsets, gate_up, down, n):
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(lib + "conv")
    def _(state, slots, fresh, starts, x, weight, silu=True):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "gated_delta_rule")
    def _(state, slots, fresh, starts, x, a, b, z, A_log, dt_bias, norm_weight, key_heads, eps):
        return x.new_empty(x.shape[0], z.shape[1])

    @torch.library.register_fake(lib + "argmax_rows")
    def _(logits):
        return logits.new_empty(logits.shape[0], dtype=torch.long)


def available() -> bool:
    return load()


def op(name: str):
    """One of the native ops, building them first if need be."""
    fn = _ops.get(name)
    if fn is None:
        if not load():
            raise RuntimeError("the native CPU kernels could not be built")
        fn = _ops[name] = getattr(torch.ops.pagedserve, name)
    return fn


def paged_attention(
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
    """Causal attention of every sequence's new tokens over its cached ones, in one call;
    with a `window`, query p sees keys (p - window, p]; `softcap` > 0 caps each scaled
    score s at softcap * tanh(s / softcap); `sinks` (fp32 [H]) join each softmax as a
    logit with no value."""
    return op("paged_attention")(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                 window, softcap, sinks)


def conv(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor, x: torch.Tensor,
         weight: torch.Tensor, silu: bool = True) -> torch.Tensor:
    """reference.conv in one pass over the inputs, the state updated in place."""
    return op("conv")(state, slots, fresh, starts, x.contiguous(), weight.contiguous(), silu)


def gated_delta_rule(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, starts: torch.Tensor,
                     x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, key_heads: int, eps: float) -> torch.Tensor:
    """reference.gated_delta_rule in one call: a token at a time per sequence and head, the
    state kept in L2, read from its slot once and written once."""
    return op("gated_delta_rule")(state, slots, fresh, starts, x.contiguous(), a, b, z, A_log, dt_bias, norm_weight,
                                  key_heads, eps)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The step's key and value rows into their slots (negative slots skipped), in one call."""
    op("store_kv")(key, value, k_cache, v_cache, slot_mapping)


def bind_threads(cores: list[int] | None = None) -> int:
    """Pin torch's intra-op threads one per core of `cores` (default: this process's CPU
    set); returns how many were pinned. Skipped (0) when there are fewer cores than
    threads, or with PAGEDSERVE_BIND_THREADS=0. Parallel ranks pass disjoint core sets.
    The calling thread is one of them: its CPU set from before is kept for `unpinned`."""
    if os.environ.get("PAGEDSERVE_BIND_THREADS", "1") == "0" or not load():
        return 0
    before = _unpinned.setdefault(threading.get_ident(), os.sched_getaffinity(0))
    cores = sorted(before) if cores is None else cores
    if len(cores) < torch.get_num_threads():
        return 0
    return int(op("bind_threads")(torch.tensor(cores[: torch.get_num_threads()])))


def keep_freed_memory() -> bool:
    """Have glibc keep freed blocks of up to 32 MB mapped, as tcmalloc (which vLLM's CPU
    docs preload) does. By default it hands large freed blocks back to the OS and maps
    them afresh on the next step: a warm run of the offline workload took 66-149
    thousand page faults on a step's activations and logits (up to 12.6 MB each),
    0.25-0.48 s of kernel time; with this, 9-15. Whole-process; False where libc is
    not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """This thread's CPU set as it was before bind_threads pinned it, for the duration. A
    child process inherits the affinity of the thread that starts it: started from a
    thread that steps an engine, it would otherwise be confined to that thread's one core."""
    cpus = _unpinned.get(threading.get_ident())
    if cpus is None:
        yield
        return
    pinned = os.sched_getaffinity(0)  # pid 0: this thread, on Linux
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, pinned)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place, when x is given); returns weight * rmsnorm(residual)."""
    return op("add_rms_norm")(x, residual, weight, eps)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int, norm: torch.Tensor | None = None, eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary q [n, H, D] and k [n, Hkv, D] from a fused qkv projection; cos/sin [n, rot],
    rot <= D: a partial rotary turns the first rot dims of each head and keeps the rest.
    `norm` (fp32 [H + Hkv, D]): each head RMS-normed (fp32, times its weight, rounded
    once) before it turns."""
    return op("rope_qk")(qkv, cos, sin, num_heads, num_kv_heads, head_dim, norm, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, with gate_up = [gate | up] along the last dimension."""
    return op("silu_mul")(gate_up)


def gemm_available(dtype: torch.dtype) -> bool:
    """Whether this build has the panel GEMM for dtype (kernels/csrc/gemm.cpp: fp32 on
    AVX-512 CPUs, bf16 on those with AVX512_BF16)."""
    return load() and bool(op("gemm_available")(dtype))


def gemm_tiles(dtype: torch.dtype, k: int) -> bool:
    """Whether gemm runs a weight of this dtype and in_features on AMX tiles (bf16 with k a
    multiple of 32, on a CPU and build with AMX): at every row count, so a row's values
    never depend on its batch."""
    return load() and bool(op("gemm_tiles")(dtype, k))


def gemm_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 (K even) or fp32 [N, K] weight as gemm's panels."""
    return op("gemm_pack")(weight)


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] . W^T (+ bias) in x's dtype with fp32 accumulation, W as gemm_pack made it."""
    return op("gemm")(x, panels, n, bias)


def gemm_pack_glu(weight: torch.Tensor) -> torch.Tensor:
    """A gate/up weight [2 I, K] (gate rows first) as gemm_glu's panels."""
    return op("gemm_pack_glu")(weight)


def gemm_glu(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up [M, n] of x . W^T (+ bias), W as gemm_pack_glu made it: the GEMM and
    silu_mul in one pass, with the same bits as the two."""
    return op("gemm_glu")(x, panels, n, bias)


def moe_glu(x: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, n: int
            ) -> torch.Tensor:
    """A mixture-of-experts layer's experts in one call: x [T, K] with rows grouped by expert
    (int64 offsets [E + 1]), each group through its expert's silu GLU MLP: gate_up the
    experts' gemm_pack_glu panels stacked, down their gemm_pack panels stacked; [T, n]."""
    return op("moe_glu")(x, offsets, gate_up, down, n)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for fp32 [rows, vocab] logits, the same indices (the
    first of equal values, a NaN as the largest), with the rows split over the threads."""
    return op("argmax_rows")(logits)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    ok = load()
    print("native CPU attention:", "built" if ok else "unavailable (the torch path will be used)")
