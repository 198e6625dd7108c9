"""The tensors a CPU step streams through (packed weights, quantized blocks, stacked
expert panels) on 2 MiB pages.

A decode step reads every weight once, and at 4 KiB a page the 3.4 GB of a 1.7B model in
bf16 are 850 thousand pages, each a TLB miss and a boundary the hardware prefetchers stop
at. Linux backs an anonymous mapping with transparent huge pages where it is asked to
(`madvise`, the common setting) or always; torch's allocator asks only under
THP_MEM_ALLOC_ENABLE, read once at its first allocation, so the engine places these
tensors itself: a private anonymous mapping, the tensor started on a 2 MiB boundary, its
whole huge pages advised. `scripts/bench_pages.py` (one process, the placements taking
turns): 1.01-1.04x the tokens/s on the Qwen3-1.7B shape in bf16 at 16 sequences, 1.00-1.04x
at batch 1 on its Q4_K_M blocks (benchmarks/LOG.md, session 35).

The KV cache stays on small pages: its pages are first touched while serving, where a
huge page's fault zeroes 2 MiB and, under the usual `defrag` setting, may stall on
compaction; with the cache moved as well the same comparison ran 0.89-0.96x.
"""

from __future__ import annotations

import functools
import math
import mmap
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes a transparent huge page covers on x86-64 and most arm64 kernels
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def available() -> bool:
    """Whether this kernel gives huge pages to an anonymous mapping that asks for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose whole 2 MiB spans are huge pages where the kernel has them;
    below one page's size, or without them, a plain torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE or not available():
        return torch.zeros(shape, dtype=dtype)
    # Fresh anonymous pages read as zeros; the mapping lives as long as a tensor views it.
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    # Only the whole huge pages: a partial last one would fault in all 2 MiB.
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE * HUGE)
    return whole[start:start + nbytes].view(dtype).view(shape)


def move(t: torch.Tensor) -> torch.Tensor:
    """t, or where it is a CPU tensor of at least one huge page, a copy on huge pages."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < HUGE or not available():
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out
