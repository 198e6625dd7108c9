"""Which layers share a block table: the KV cache of a hybrid model (Gemma 2 and 3: local
layers with a sliding window beside global ones) split into groups of equal size.

Every group has its own block table per sequence over the one block pool, and a block
holds `layers_per_block` layers' K and V: the j-th layer of every group reads cache
tensor j through its own group's table. A windowed group gives back what lies before its
window (engine/kv_cache_manager.py), so a local layer's KV stops growing at the window
while a global layer's keeps the whole sequence. Equal group sizes keep one pool and one
block size for all (vLLM v1's hybrid allocator works the same way); the size is the
greatest common divisor of the layer counts of each window, so Gemma 3's 5 local : 1
global makes groups of a sixth of its layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window, None where they see everything
    group_of: tuple[int, ...]  # per layer of the model (or of this pipeline stage)
    slot_of: tuple[int, ...]  # per layer: which of the layers_per_block cache tensors it uses
    layers_per_block: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def single(num_layers: int, window: int | None = None) -> KVGroups:
    """One table for every layer: all layers alike, or a layout that cannot be split."""
    return KVGroups((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def plan(layer_windows: tuple[int, ...], split: bool = True) -> KVGroups:
    """Groups for layers with these windows (0: full attention). `split` False (pipeline
    stages, a draft model reading the tables) keeps one table: windowed only where every
    layer is, with the largest window, so no layer loses a key it reads."""
    n = len(layer_windows)
    kinds = sorted(set(layer_windows))
    if len(kinds) == 1 or not split:
        return single(n, max(layer_windows) if n and all(layer_windows) else None)
    by_kind = {k: [i for i, w in enumerate(layer_windows) if w == k] for k in kinds}
    size = math.gcd(*(len(v) for v in by_kind.values()))
    windows: list[int | None] = []
    group_of, slot_of = [0] * n, [0] * n
    for kind, layers in by_kind.items():
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start:start + size]):
                group_of[layer], slot_of[layer] = len(windows), j
            windows.append(kind or None)
    return KVGroups(tuple(windows), tuple(group_of), tuple(slot_of), size)
