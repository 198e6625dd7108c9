"""The GGUF tensor directory the loader reads (engine/models/gguf_index.py) against gguf's
own reader: every tensor's name, type, shape and bytes, on the embedded file and on one
written with every element type beside blocks, big metadata arrays and an alignment of
its own; a damaged file is a ValueError naming it, never a misread tensor."""

from __future__ import annotations

import numpy as np
import pytest

from engine.models import gguf_index
from engine.models.loader import default_model_path


def same_as_gguf_reader(path) -> int:
    import gguf

    ours = gguf_index.read(path).tensors
    theirs = gguf.GGUFReader(path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for a, b in zip(ours, theirs):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data, equal_nan=True), a.name
    return len(ours)


def test_the_embedded_files_directory_is_gguf_readers():
    assert same_as_gguf_reader(default_model_path()) == 272


def write(path, alignment: int | None = None) -> None:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 5) for i in range(3000)])  # strings, some empty
    w.add_array("tokenizer.ggml.scores", rng.standard_normal(3000).astype(np.float32).tolist())
    w.add_array("nested.lists", [[1, 2], [3]])
    w.add_bool("a.flag", True)
    w.add_string("general.name", "d\u00e9j\u00e0 vu")
    x = rng.standard_normal((6, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("bf16", gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_tensor("i32", np.arange(10, dtype=np.int32))
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("q8", gguf.quants.quantize(x, q8), raw_dtype=q8)
    w.add_tensor("three_d", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_a_file_of_every_element_type_is_read_as_gguf_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "mixed.gguf"
    write(path, alignment)
    assert same_as_gguf_reader(path) == 6


def test_a_damaged_file_is_a_value_error_naming_it(tmp_path):
    path = tmp_path / "mixed.gguf"
    write(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor runs past the end
    with pytest.raises(ValueError, match="cut.gguf.*'three_d' runs past the end"):
        gguf_index.read(cut)
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:2000])  # inside the metadata
    with pytest.raises(ValueError, match="header.gguf"):
        gguf_index.read(header)
    # the first tensor's dimension count (after its name in the directory) made 5, then its
    # first size made huge: refused, never a loop over billions of dims nor an overflowed size
    dims_at = data.index((3).to_bytes(8, "little") + b"f32") + 8 + 3
    wide = tmp_path / "wide.gguf"
    wide.write_bytes(data[:dims_at] + (5).to_bytes(4, "little") + data[dims_at + 4:])
    with pytest.raises(ValueError, match="'f32' claims 5 dimensions"):
        gguf_index.read(wide)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:dims_at + 4] + (1 << 62).to_bytes(8, "little") + data[dims_at + 12:])
    with pytest.raises(ValueError, match="'f32' runs past the end"):
        gguf_index.read(huge)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="other.gguf is not a GGUF file"):
        gguf_index.read(other)
