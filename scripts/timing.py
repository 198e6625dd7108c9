"""The benchmarks' timer, with no imports beyond the standard library: scripts/peers/
runs it in vLLM's venv too."""

from __future__ import annotations

import time
from collections.abc import Callable


def best(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Seconds of the fastest of `repeats` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)
