"""A GGUF file's tensor directory (name, type, shape and bytes of each tensor), read
without building its metadata.

gguf's reader turns every metadata value into numpy parts; a vocabulary of 262k tokens
(Gemma 3) is about 790k of them, 9 s on 2 cores, and 1-2 s for a 49k one, paid at each
load of a model that computes on or dequantizes its blocks. Those loads need only the
directory, which follows the metadata: here the metadata is stepped over (each string's
length read, its bytes skipped) and the directory parsed: 21 ms for a 49k vocabulary
and 55 ms for Gemma 3's on the same machine. Tensor data are views of one read-only
mapping of the file, shaped as gguf's reader shapes them, so they read the same bytes
(tests/unit/test_gguf_index.py).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML's tensors have at most four
# GGUF's metadata value types with a fixed size: bytes per value.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
# Types gguf's reader gives as elements rather than bytes.
ELEMENTS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
            "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the row length first
    data: np.ndarray  # a view of the mapping: elements for F32/F16/..., else [..., row bytes]


@dataclass(frozen=True)
class Index:
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.at = buf, 0

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.at)
        self.at += 4
        return v

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.at)
        self.at += 8
        return v

    def string(self) -> str:
        n = self.u64()
        s = bytes(self.buf[self.at:self.at + n]).decode("utf-8")
        self.at += n
        return s

    def skip_value(self, kind: int) -> None:
        if kind in FIXED:
            self.at += FIXED[kind]
        elif kind == STRING:
            n = self.u64()  # read before the sum: `at += u64()` would load `at` first
            self.at += n
        elif kind == ARRAY:
            inner, count = self.u32(), self.u64()
            if inner in FIXED:
                self.at += FIXED[inner] * count
            else:
                for _ in range(count):
                    self.skip_value(inner)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.at}")


def read(path: str | Path) -> Index:
    """The file's tensor directory; a ValueError naming the file for one that is not a
    little-endian GGUF of version 2 or 3 (what llama.cpp writes), or is cut short."""
    path = Path(path)
    try:
        return _read(path)
    except (struct.error, UnicodeDecodeError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _read(path: Path) -> Index:
    import gguf

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    array = np.asarray(mapped)  # slicing a plain view skips memmap's bookkeeping
    cur = _Cursor(memoryview(array))
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cur.at = 4
    version = cur.u32()
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or one newer than 3)")
    count, kv_count = cur.u64(), cur.u64()
    alignment = DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key, kind = cur.string(), cur.u32()
        if key == "general.alignment" and kind == 4:
            alignment = cur.u32()
            if alignment == 0 or alignment & (alignment - 1):
                raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        else:
            cur.skip_value(kind)
    entries, names = [], set()
    for _ in range(count):
        name = cur.string()
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            raise ValueError(f"{path}: tensor {name!r} claims {n_dims} dimensions; GGUF tensors have at most {MAX_DIMS}")
        dims = tuple(cur.u64() for _ in range(n_dims))
        kind, offset = cur.u32(), cur.u64()
        entries.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
    start = -(-cur.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in entries:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes, at, shape = math.prod(dims) * size // block, start + offset, tuple(reversed(dims))
        if at + nbytes > array.size:
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        raw = array[at:at + nbytes]
        if kind.name in ELEMENTS:
            data = raw.view(ELEMENTS[kind.name]).reshape(shape)
        else:
            data = raw.reshape(gguf.quant_shape_to_byte_shape(shape, kind))
        tensors.append(Tensor(name, kind, dims, data))
    return Index(tensors)
