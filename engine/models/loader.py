"""Find a model, its config, tokenizer and weights, offline.

A model is an HF-format directory, a GGUF file, or an HF id that must already be in
the local HF cache: nothing here downloads. A GGUF becomes an HF directory once, in a
local cache (engine/models/gguf_convert.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ParamError
from engine.models import DEFAULT_GGUF_FILE, DEFAULT_HF_ID, DEFAULT_MODEL_NAME, default_model_path, packaged

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from engine import parallel
    from engine.models.decoder import DecoderForCausalLM

# torch, transformers' model code and the model registry load in the functions that build
# or convert a model: finding a model and its tokenizer (what the HTTP process does) needs
# none of them, and importing them cost that process and the CLI seconds each.

__all__ = ["DEFAULT_MODEL_NAME", "ModelFiles", "resolve", "load_config", "load_tokenizer", "build_model"]


@dataclass
class ModelFiles:
    """An HF-format directory on local disk, plus where it came from. `blocks_only`: a
    GGUF's directory without the GEMM weights and the embedding, which the loader reads
    from the file `source` names (engine/models/gguf_blocks.py)."""

    path: Path
    source: str
    blocks_only: bool = False


def cache_root() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(root)


def named_file(model: str | os.PathLike | None) -> str:
    """The path the user's model names before any conversion: the default model's GGUF,
    a packaged tag's assembled file, else the name itself (what quantization 'gguf' reads
    its blocks from)."""
    if model is None:
        return str(default_model_path())
    if str(model) in packaged.PACKAGES:
        return str(packaged.path(str(model)))
    return str(model)


def reads_blocks(quantization: str | None, tensor_parallel_size: int) -> bool:
    """Whether the engine reads a GGUF's GEMM weights from the file itself: computing on
    its blocks (`quantization: gguf`), or dequantizing them into the dense model at load
    (engine/models/gguf_dense.py) wherever a rank holds whole tensors. Tensor-parallel
    ranks each hold a slice and read the fp32 conversion instead."""
    return quantization == "gguf" or tensor_parallel_size == 1


def resolve(model: str | os.PathLike | None, blocks: bool = False) -> ModelFiles:
    """Turn what the user named into a local HF-format directory. `blocks` (reads_blocks):
    the GEMM weights will be read from a GGUF's own blocks, so its directory holds only
    the tensors that stay dense (engine/models/gguf_convert.py)."""
    if model is None:
        return _from_gguf(default_model_path(), blocks)
    if str(model) in packaged.PACKAGES:
        return _from_gguf(packaged.path(str(model)), blocks)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, blocks)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _from_directory(path, blocks)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], blocks)
        raise ValueError(f"model directory {path} has no config.json (or exactly one .gguf file)")
    if path.suffix == ".gguf" or str(model).startswith((".", "/")):
        raise ValueError(f"model path {model} does not exist")
    return _from_hub_cache(str(model))


def _from_directory(path: Path, blocks: bool) -> ModelFiles:
    """An HF-format directory; one a GGUF's conversion made without the GEMM weights
    (its source.json says so; scripts/import_model.py stores it with the file beside it)
    reads them from that file, or where a rank needs them dense (tensor parallelism),
    from the file's full conversion."""
    try:
        made = json.loads((path / "source.json").read_text()) if (path / "source.json").is_file() else {}
    except ValueError:
        made = {}
    if not made.get("blocks"):
        return ModelFiles(path, str(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ValueError(f"model directory {path} holds a GGUF's conversion without its GEMM weights, and "
                         f"{len(ggufs)} .gguf files beside it where it needs the one they come from")
    return ModelFiles(path, str(ggufs[0]), True) if blocks else _from_gguf(ggufs[0], False)


def _from_hub_cache(repo_id: str) -> ModelFiles:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError) as e:
        raise ValueError(
            f"model {repo_id!r} is not a local path and is not in the local Hugging Face cache; "
            "this engine never downloads weights at run time"
        ) from e
    return ModelFiles(Path(path), repo_id)


def _from_gguf(gguf: Path, blocks: bool) -> ModelFiles:
    from engine.models import gguf_convert

    return ModelFiles(gguf_convert.converted(gguf, cache_root(), blocks), str(gguf), blocks)


def load_config(files: ModelFiles) -> PretrainedConfig:
    """The decoder's config: a multimodal checkpoint's text part; a ParamError naming an
    architecture that is not served."""
    from transformers import AutoConfig

    from engine.models import registry

    config = AutoConfig.from_pretrained(files.path)
    _check_quantization(config)
    return registry.text_config(config)


# Checkpoint quantization formats read here (dequantized at load, or computed on with
# `quantization: mxfp4`): gpt-oss's MXFP4 experts.
CHECKPOINT_QUANTIZATION = ("mxfp4",)


def _check_quantization(config: PretrainedConfig) -> None:
    """A checkpoint stored in a quantized format we do not read (GPTQ, AWQ, FP8, ...) is
    refused by its format's name, before its packed tensors fail to load one by one."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)
    if method not in CHECKPOINT_QUANTIZATION:
        raise ParamError("model", f"checkpoints quantized with {method!r} are not read; supported: "
                         f"{', '.join(CHECKPOINT_QUANTIZATION)} (or a GGUF file, or a full-precision checkpoint "
                         "with the `quantization` setting)")


# What vLLM's `--generation-config auto` takes from a model's generation_config.json.
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_generation_config(files: ModelFiles) -> dict[str, Any]:
    """The model's generation_config.json, or nothing; a file that is not a JSON object is
    the model's error, named, not a silent default."""
    path = files.path / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ParamError("model", f"{path} holds {type(data).__name__}, not a JSON object")
    return data


def sampling_defaults(generation: dict[str, Any]) -> dict[str, int | float]:
    """The sampling settings the model's authors recommend, for requests that leave them
    unset: top_k as an int (some files write 20.0), the others as floats."""
    found = {k: generation[k] for k in SAMPLING_DEFAULT_KEYS
             if isinstance(generation.get(k), (int, float)) and not isinstance(generation[k], bool)}
    return {k: int(v) if k == "top_k" else float(v) for k, v in found.items()}


def eos_token_ids(config: PretrainedConfig, generation: dict[str, Any], tokenizer: Any) -> list[int]:
    """Every token that ends a generation: the config's, generation_config's and the
    tokenizer's. Chat models end a turn on a token the base config does not name (Phi-3's
    <|end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>); transformers' generate stops on
    generation_config's list, and so must we."""
    ids: list[int] = []
    for found in (config.eos_token_id, generation.get("eos_token_id"), tokenizer.eos_token_id):
        for t in [found] if isinstance(found, int) else list(found or []):
            if isinstance(t, int) and not isinstance(t, bool) and t not in ids:
                ids.append(t)
    return ids


def hf_id(files: ModelFiles) -> str | None:
    """The Hugging Face id the model is known by, when we can tell: a model found in the HF
    cache by id, or a directory made from the embedded GGUF (its source.json says so)."""
    if not Path(files.source).exists():
        return files.source  # resolved by repo id
    src = files.path / "source.json"
    if src.is_file():
        data = json.loads(src.read_text())
        if data.get("hf_id"):
            return str(data["hf_id"])
        if Path(data.get("gguf", "")).name == DEFAULT_GGUF_FILE:
            return DEFAULT_HF_ID
    return None


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(files.path)


def iter_weights(files: ModelFiles) -> Iterator[tuple[str, object]]:
    """Every checkpoint tensor as a lazy safetensors slice: each rank reads only its part."""
    from safetensors import safe_open

    shards = sorted(files.path.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"no *.safetensors files in {files.path}")
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def build_model(
    files: ModelFiles | None,
    config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    dummy: bool = False,
    seed: int = 0,
    fused: Any = None,
    dist: parallel.Dist | None = None,
    quantization: str | None = None,
    int8_activations: bool = False,
) -> DecoderForCausalLM:
    """Instantiate our model and fill it: from the checkpoint, or randomly for `dummy`.

    `fused` (the attention backend's fused_kernels(): the native CPU ops or the Triton ones)
    swaps eager elementwise chains for fused ops.
    `quantization` (engine/models/quantize.py) then swaps every GEMM weight and the
    embedding for quantized ones, releasing the fp32 tensors; `int8_activations` has their
    decode GEMMs round activations to int8."""
    import torch

    from engine import scoring
    from engine.models import gguf_blocks, gguf_dense, packed_linear, quantize, registry

    torch.manual_seed(seed)
    with torch.device(device), _no_init():
        model = registry.model_class(config)(config, max_positions, dist)
    model.keep_mxfp4 = quantization == "mxfp4"
    if dummy:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, getattr(config, "initializer_range", 0.02))
    else:
        assert files is not None
        if files.blocks_only and model.dist.layout.tp > 1:
            raise ValueError(f"{files.path} holds no GEMM weights: a tensor-parallel rank reads the full conversion")
        weights = iter_weights(files)
        if scoring.is_classifier(config):  # its head is engine/scoring.py's; it has no LM head to load
            model.headless = True
            weights = ((name, src) for name, src in weights if not name.startswith("score."))
        try:  # a blocks-only directory's GEMM weights stay unwritten (and so never paged in) until read
            model.load_weights(weights, gguf_blocks.replaced if files.blocks_only else None)
        except ValueError as exc:  # a tensor missing, extra or misshapen: the checkpoint's fault
            raise ParamError("model", f"{files.source}: {exc}") from None
        if files.blocks_only and quantization != "gguf":  # dense weights, dequantized from the file's blocks
            gguf_dense.fill(model, files.source, config, dtype)
        if model.headless and model.last and not model.tie:
            model.lm_head.weight.data.zero_()  # never read; not left as uninitialized memory
    model = model.to(dtype=dtype).eval()
    if quantization is not None:
        quantize.apply(model, quantization, files.source if files is not None else "", config, int8_activations)
        if files is not None and files.blocks_only:
            unfilled = [name for name, _ in model.named_parameters() if gguf_blocks.replaced(name)]
            if unfilled:  # would compute on uninitialized memory
                raise ParamError("model", f"{files.source}: no GGUF blocks replaced {unfilled[:3]}")
    if quantization in (None, "mxfp4") and packed_linear.supported(device, dtype):
        model.pack_linears()  # `mxfp4` keeps every GEMM but the experts dense
    if fused is not None:
        model.use_fused_ops(fused)
    return model


_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "constant_", "zeros_", "ones_")


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn's layers draw random initial weights as they are built, and every one is
    then overwritten: by the checkpoint (weights.load refuses one that leaves a parameter
    unwritten) or by the dummy fill. Skipping the draws took a SmolLM2-135M engine's build from
    2.0 to 1.2 s; they grow with the model (a 1.7B one draws 1.7 billion numbers)."""
    import torch

    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def weight_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """The bytes a model's weights take in `dtype`, from its config alone: what a rank
    still to load will take of its device, before any of it exists. An expert layer holds
    every expert (and its router and shared expert) in place of the dense MLP."""
    import torch

    from engine.models import registry

    # (a config whose every layer holds experts may have no dense intermediate size: Qwen3.5 MoE)
    h, v, inter = config.hidden_size, config.vocab_size, getattr(config, "intermediate_size", None) or 0
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    spec = registry.model_class(config).spec(config)
    attn = h * q * (2 if spec.attn_gate else 1) + 2 * h * kv + q * h + 2 * h
    moe = spec.moe
    layers = config.num_hidden_layers * (attn + 3 * h * inter)
    if spec.linear is not None:  # a linear-attention layer's projections, kernel and per-head parameters
        lin = spec.linear
        value = lin.value_heads * lin.value_dim
        mixer = h * (lin.conv_channels + value + 2 * lin.value_heads) + lin.conv_channels * lin.conv_kernel \
            + value * h + 2 * lin.value_heads + lin.value_dim
        layers += len(lin.layers) * (mixer - attn)
    if moe is not None:
        sparse = moe.experts * (3 * h * moe.inter + h)  # the experts and the router
        sparse += moe.experts if moe.choice_bias else 0  # the router's choice bias
        if moe.shared_inter:
            sparse += 3 * h * moe.shared_inter + (h if moe.shared_gated else 0)  # the shared expert and its gate
        layers += len(moe.layers) * (sparse - 3 * h * inter)
    embeds = v * h * (1 if getattr(config, "tie_word_embeddings", False) else 2) + (v if spec.head_bias else 0)
    return (embeds + layers + h) * torch.empty((), dtype=dtype).element_size()
