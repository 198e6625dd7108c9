"""Where an engine step's time goes: attention, GEMMs, other model ops, sampler, input
preparation, and Python around them. Used by bench_throughput.py --profile.

It times by wrapping the functions each share lives in, for the duration of a `with`
block, so it needs no profiler and adds only a clock read per call.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch.nn.functional as F

import engine.engine as engine_module
from engine.llm import LLM
from engine.models import packed_linear
from kernels import cpu, quant


class StepProfile:
    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.spent: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._undo: list[Callable[[], None]] = []

    def _wrap(self, owner: Any, name: str, share: str) -> None:
        original = getattr(owner, name)
        spent = self.spent

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[share] += time.perf_counter() - t

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> StepProfile:
        eng = self.engine
        for fn in ("attention", "store_kv"):  # the one backend object the model calls
            self._wrap(eng.executor.runner.backend, fn, "attention")
        self._wrap(F, "linear", "gemm")
        self._wrap(packed_linear, "linear", "gemm")
        self._wrap(packed_linear, "panel_linear", "gemm")
        self._wrap(quant, "qlinear", "gemm")  # quantized weights (engine/models/quantize.py)
        self._wrap(cpu, "moe_glu", "gemm")  # an expert layer's experts in one native call
        self._wrap(engine_module, "prepare", "input preparation")
        self._wrap(eng.executor.runner, "model", "model forward")  # rank 0's part under parallelism
        self._wrap(eng.sampler, "verify", "sampler")  # every step samples through verify
        self._wrap(eng, "step", "step")
        return self

    def __exit__(self, *exc: Any) -> None:
        for undo in reversed(self._undo):
            undo()

    def report(self) -> str:
        s = self.spent
        total = s["step"] or 1e-9
        other_model = s["model forward"] - s["attention"] - s["gemm"]
        python = total - s["model forward"] - s["sampler"] - s["input preparation"]
        rows = [("attention (incl. KV store)", s["attention"]), ("GEMMs", s["gemm"]),
                ("other model ops", other_model), ("sampler", s["sampler"]),
                ("input preparation", s["input preparation"]), ("Python (scheduler, outputs, rest)", python)]
        lines = [f"step time {total:.2f}s; outside the forward pass {1 - s['model forward'] / total:.1%}"]
        lines += [f"  {name:36s} {secs:7.2f}s  {secs / total:6.1%}" for name, secs in rows]
        return "\n".join(lines)
