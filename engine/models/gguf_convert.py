"""A GGUF file as an HF-format directory (config, tokenizer, safetensors), made once per
file's bytes and kept in a local cache: dequantizing takes far longer than reading
safetensors.

Two kinds. Wherever one process holds whole tensors, the engine reads the GEMM weights
and the embedding from the file itself (loader.reads_blocks): computing on its blocks
under `quantization: gguf` (engine/models/quantize.py), or dequantizing them into the
dense model at load (engine/models/gguf_dense.py). That directory holds only the tensors
that stay dense: norms, biases, routers, sinks. The whole model dequantized to fp32 is
left to tensor-parallel ranks and to transformers as the oracle: it costs four times the
file on disk and held the whole fp32 model in memory while converting (a Qwen3-30B-A3B
Q4_K_M file, 18 GB, needed over 120 GB of each).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

# 2: configs restored by gguf_config; 3: a generation_config.json of its stop tokens;
# 4: the split the vocabulary was trained with (gguf_tokenizer)
CONVERSION = 4
REST = "-rest"  # the suffix of a directory holding only the tensors that stay dense
TMP_PREFIX = ".converting-"  # no converted directory's name starts with a dot
STALE_TMP_S = 3600.0  # a conversion takes seconds to minutes; an hour-old one was killed


def converted(gguf: Path, root: Path, blocks: bool) -> Path:
    """The directory made from `gguf` under `root`, converting the file if it is not there
    yet; with `blocks`, the one without the tensors the engine reads from the file itself."""
    # Keyed by the file's bytes, not its path: a reinstalled venv, a moved Bento or a fresh
    # clone holds the same GGUF at a new path, and a path key converted it again each time,
    # leaving the old fp32 copy (four times the file) behind until the disk filled.
    # CONVERSION names how the directory was made: a newer reader of the same file gets its own.
    key = hashlib.sha256(f"{CONVERSION}:{_digest(gguf)}".encode()).hexdigest()[:16]
    # Named after the file a symlink points to (an HF cache snapshot is links to blobs), so
    # a link and its target share one conversion; the source stays the path the user gave.
    out = root / "gguf" / f"{gguf.resolve().stem}-{key}{REST if blocks else ''}"
    if not (out / "model.safetensors").is_file():
        convert_gguf(gguf, out, blocks)
    return out


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _digest(path: Path) -> str:
    """The file's sha256, once per process for an unchanged file (0.14 s per 100 MB)."""
    stat = path.stat()
    memo = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo not in _DIGESTS:
        with path.open("rb") as f:
            _DIGESTS[memo] = hashlib.file_digest(f, "sha256").hexdigest()
    return _DIGESTS[memo]


def _remove_stale_tmp(root: Path) -> None:
    """A conversion killed part way leaves its directory (fp32 weights, hundreds of MB);
    the next conversion removes those old enough that no live one can own them."""
    now = time.time()
    for tmp in root.glob(f"{TMP_PREFIX}*"):
        with contextlib.suppress(OSError):
            if now - tmp.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path, blocks: bool = False) -> None:
    """Dequantize a GGUF file into an HF directory (config, tokenizer, fp32 safetensors);
    with `blocks`, every tensor but those gguf_blocks.on_blocks names."""
    import gguf as gguf_package
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from engine.models import gguf_blocks, gguf_config, gguf_llama_keyed, gguf_tensors, gguf_tokenizer, registry

    keep = (lambda name: not gguf_blocks.on_blocks(name)) if blocks else (lambda name: True)
    with gguf_config.parsed_once():
        config = gguf_config.restore(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
        registry.text_config(config)  # refuses an architecture we cannot serve, before any work
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        fields = gguf_package.GGUFReader(gguf).fields
        gguf_tokenizer.set_pre_tokenizer(tokenizer, *(fields[k].contents() if k in fields else None
                                                      for k in ("tokenizer.ggml.pre", "tokenizer.ggml.model")))
        arch = gguf_config.file_arch(gguf)
        if gguf_llama_keyed.renamed(arch):  # renamed alone: by llama.cpp's own name map
            tensors = gguf_tensors.convert_named(gguf, arch, config, keep)
        elif gguf_tensors.handles(config):  # files transformers' reader does not convert
            tensors = gguf_tensors.convert(gguf, config, keep)
        else:
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(gguf_llama_keyed.tensor_config(arch, config))
            # transformers dequantizes every tensor the reader lists; parsed_once hands it the
            # reader parsed above, so the list is cut here for this one call. The config it
            # would infer from the cut list (a tied head) is not the one written.
            reader = gguf_package.GGUFReader(gguf)
            every = reader.tensors
            reader.tensors = [t for t in every if keep(t.name)]
            try:
                tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
            finally:
                reader.tensors = every
        stops = gguf_config.stop_token_ids(gguf, tokenizer)
    # A directory of its own: a name from the pid collided across containers sharing the
    # cache, where every process may be pid 1.
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{out.name}-", dir=out.parent))
    tmp.chmod(0o755)  # as a plain mkdir would make it; mkdtemp makes 0700
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights we write are plain fp32
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if stops:
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
    source = {"gguf": str(gguf.resolve())}  # what the bytes are, for loader.hf_id
    if blocks:
        source["blocks"] = True  # the GEMM weights are the file's, read at load (gguf_blocks)
    (tmp / "source.json").write_text(json.dumps(source))
    shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:
        # Another process converted the same bytes and renamed first: its copy is the same.
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").is_file():
            raise
