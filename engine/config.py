"""Engine configuration: a strict pydantic model, loadable from the YAML presets in config/,
and its resolution against the machine and the model into the numbers the engine runs with."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine import kv_groups as kv_plan
from engine.errors import ParamError
from engine.kv_groups import KVGroups
from engine.pooling import PoolerConfig
from engine.scoring import ScorerConfig

if TYPE_CHECKING:  # torch loads where an engine is built, not where a config is only read
    import torch

    from kernels.backend import AttentionBackend

logger = logging.getLogger(__name__)

PRESET_DIR = Path(__file__).resolve().parent.parent / "config"
CPU_KV_DEFAULT_BYTES = 2 << 30


class SpeculativeConfig(BaseModel):
    """Speculative decoding (engine/spec/): a proposer guesses up to num_speculative_tokens
    tokens a step and the target verifies them in the same forward pass. Keys of another
    method than the one chosen are errors, not ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "suffix", "draft"]
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    # ngram: the longest suffix of the request's tokens, from max down to min tokens, that
    # occurred before in its prompt or output proposes what followed it there.
    prompt_lookup_min: int = Field(2, ge=1, le=64)
    prompt_lookup_max: int = Field(4, ge=1, le=64)
    # draft: another model (None = the target's own checkpoint) made cheap by quantization
    # or by keeping its first num_layers layers; it must share the target's tokenizer.
    model: str | None = None
    quantization: Literal["gguf", "int8"] | None = None
    num_layers: int | None = Field(None, ge=1)
    # suffix: contexts of up to this many tokens, over the request's own tokens and the
    # outputs of the last max_cached_requests requests; a draft stops once its estimated
    # probability falls under min_token_prob.
    suffix_max_tree_depth: int = Field(24, ge=1, le=64)
    suffix_max_cached_requests: int = Field(1000, ge=0, le=100_000)
    suffix_min_token_prob: float = Field(0.1, ge=0.0, le=1.0)
    # More running sequences than this and a step does not speculate: verification rows
    # then cost more than the few decode steps they save (vLLM's disable_by_batch_size).
    disable_by_batch_size: int | None = Field(None, ge=1)
    # Fewer drafts as more sequences run: each gets at most max_batch_rows // running - 1,
    # so a step's rows, drafts included, stay about this many. On a CPU a step of up to a
    # few dozen rows costs about what a one-row step does (reading the weights decides);
    # past that every verification row is paid for in arithmetic, accepted or not.
    max_batch_rows: int | None = Field(None, ge=2)

    @model_validator(mode="after")
    def _method_keys(self) -> "SpeculativeConfig":
        if self.prompt_lookup_max < self.prompt_lookup_min:
            key = "prompt_lookup_max" if "prompt_lookup_max" in self.model_fields_set else "prompt_lookup_min"
            raise ParamError(f"speculative_config.{key}", f"prompt_lookup_max ({self.prompt_lookup_max}) is below "
                             f"prompt_lookup_min ({self.prompt_lookup_min})")
        own = {"ngram": {"prompt_lookup_min", "prompt_lookup_max"},
               "draft": {"model", "quantization", "num_layers"},
               "suffix": {"suffix_max_tree_depth", "suffix_max_cached_requests", "suffix_min_token_prob"}}
        for method, keys in own.items():
            # a key of another method set to anything but its default (a dump of this config,
            # which lists every key, round-trips)
            stray = [] if method == self.method else sorted(
                k for k in keys if getattr(self, k) != type(self).model_fields[k].default)
            if stray:
                raise ParamError(f"speculative_config.{stray[0]}",
                                 f"speculative_config.{stray[0]} applies to method {method!r}, not {self.method!r}")
        return self


class EngineConfig(BaseModel):
    """Everything that shapes an engine. Unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="HF directory, .gguf file or HF id; None = embedded default")
    load_format: Literal["auto", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: Literal[8, 16, 32] = 16
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enable_prefix_caching: bool = True
    # fcfs: by arrival. priority: by each request's `priority` (lower first, as vLLM), then
    # arrival; the lowest priority running sequence is the one preempted.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton", "native"] = "auto"
    # CUDA graphs for decode steps (engine/cuda_graphs.py): captured at start for these batch
    # sizes (None: 1, 2, 4, then multiples of 8 up to max_num_seqs, at most 256); a step of
    # more sequences runs eagerly. enforce_eager turns them off.
    enforce_eager: bool = False
    cuda_graph_sizes: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(None, min_length=1, max_length=256)
    # Megatron-style tensor parallelism and layer-wise pipeline parallelism over
    # torch.distributed (gloo on the CPU, NCCL on CUDA); tp x pp processes in all.
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    # Compute on quantized weights (CPU, engine/models/quantize.py): "gguf" keeps a GGUF
    # file's blocks, "mxfp4" a checkpoint's MXFP4 experts (gpt-oss as OpenAI ships it; every
    # other GEMM dense), "int8" quantizes any checkpoint per output channel at load, "auto"
    # is "gguf" or "mxfp4" where that loses nothing (quantize.auto), the dense weights elsewhere.
    # Activations in fp32 (exact against the dequantized weights) or, with dtype bfloat16,
    # in bf16 (many rows then on the AMX tiles where the CPU has them).
    quantization: Literal["auto", "gguf", "mxfp4", "int8"] | None = None
    # With quantized weights, decode steps round each GEMM's activations to int8 per 32
    # values (as llama.cpp's and vLLM's GGUF kernels do) and take the products on integers:
    # faster batch-1 decode, each output off the exact one by at most half an int8 step of
    # its activations (kernels/csrc/quant_a8.cpp). Steps of more rows than its few-rows
    # kernel takes (32 with AVX-512, 4 to 16 by type with AVX2) stay exact.
    int8_activations: bool = False
    speculative_config: SpeculativeConfig | None = None
    # Structured outputs compile on a thread beside the core; a constraint that has not
    # compiled in this many seconds fails its request (400) and is refused at once after.
    grammar_compile_timeout_s: float = Field(10.0, gt=0, le=600)
    # Embeddings (engine/pooling.py): how the last hidden states are pooled. None: a
    # sentence-transformers checkpoint's own Pooling module, or no embeddings at all.
    pooler: PoolerConfig | None = None
    # Relevance scores (engine/scoring.py): a yes/no head over a causal LM's two tokens, and
    # how query and document join. A sequence-classification checkpoint scores without it.
    scorer: ScorerConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.int8_activations and self.quantization is None:
            raise ParamError("int8_activations", "int8_activations rounds the activations of quantized GEMMs: "
                             "it needs quantization 'gguf', 'mxfp4', 'int8' or 'auto'")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs one token a step"
            )
        for key in ("pooler", "scorer"):
            if getattr(self, key) is not None and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
                raise ParamError(key, f"embeddings and scores are served by a single-rank engine: {key} needs "
                                 "tensor_parallel_size and pipeline_parallel_size 1")
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype float16 is not supported on device cpu; use float32 or bfloat16")
        return self

    @classmethod
    def from_preset(cls, name_or_path: str | Path, **overrides: Any) -> "EngineConfig":
        """A preset's `engine:` section with keyword overrides on top."""
        engine = read_preset(name_or_path).get("engine") or {}
        return cls.create(**{**engine, **overrides})

    @classmethod
    def create(cls, **kwargs: Any) -> "EngineConfig":
        """Like the constructor, but a bad key or value raises ParamError naming the field."""
        try:
            return cls(**kwargs)
        except ParamError:
            raise
        except ValidationError as e:
            params, msgs = [], []
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "config"
                inner = (err.get("ctx") or {}).get("error")
                if isinstance(inner, ParamError):  # a validator that knows which key it is about
                    where, err = inner.param, {**err, "msg": str(inner)}
                params.append(where)
                msgs.append(f"{where}: {err['msg']}")
            raise ParamError(params[0], "invalid engine config: " + "; ".join(msgs)) from None


def read_preset(name_or_path: str | os.PathLike) -> dict[str, Any]:
    """A YAML preset as a mapping: a bare name means config/<name>.yaml; a relative path is
    tried against the working directory, then the project root, so a Bento finds its own."""
    path = Path(name_or_path).expanduser()
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_absolute() and not path.is_file():
        path = PRESET_DIR.parent / path
    if not path.is_file():
        raise ParamError("preset", f"config preset {str(name_or_path)!r} not found (looked for {path})")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or "engine" not in data:
        raise ParamError("preset", f"{path}: a preset is a mapping with an `engine:` section")
    return data


def cpu_has_bf16() -> bool:
    """Native bf16 math (avx512_bf16 or AMX): there bf16 GEMMs beat fp32 several times over."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


@dataclass(frozen=True)
class Placement:
    """Where and in what the model runs, known before anything is built. The attention
    backend is chosen here, once, and built (`load`) where the engine builds its model."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: AttentionBackend
    max_positions: int  # rotary table length

    @classmethod
    def resolve(cls, config: EngineConfig, hf_config: Any) -> "Placement":
        import torch

        from engine.models import quantize, registry
        from kernels.backend import select as select_backend

        spec = registry.model_class(hf_config).spec(hf_config)
        if spec.stateful is not None:
            _check_state_layers(config, hf_config)
        if config.tensor_parallel_size > 1 and not spec.tp_ok:
            raise ParamError("tensor_parallel_size", f"{hf_config.model_type} is not served under tensor "
                             "parallelism: one of its layers spans every attention head")
        device = _device(config.device)
        # Quantized GEMMs are exact against the dequantized file in fp32: "auto" means that there.
        dtype = torch.float32 if config.quantization and config.dtype == "auto" else _dtype(config.dtype, device)
        quantize.check(config.quantization, device, config.tensor_parallel_size, config.pipeline_parallel_size)
        backend = select_backend(config.attention_backend, device)
        positions = int(getattr(hf_config, "max_position_embeddings", 2048))
        if config.max_model_len is not None and config.max_model_len > positions:
            raise ParamError("max_model_len", f"max_model_len ({config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({positions})")
        return cls(device, dtype, backend, positions)


@dataclass(frozen=True)
class ResolvedConfig:
    """The config checked against this machine and this model: what the engine really runs."""

    device: torch.device
    dtype: torch.dtype
    attention_backend: AttentionBackend  # loaded: the one that runs
    max_model_len: int
    max_positions: int  # rotary table length
    num_blocks: int
    kv_groups: KVGroups  # which layers share a block table (engine/kv_groups.py)
    # State-keeping models: the state slots, one per sequence that may run (so also the
    # running cap: `max_num_seqs`), whose bytes come out of the cache's budget before the
    # blocks; 0 for every other model.
    state_slots: int = 0

    def max_num_seqs(self, config: EngineConfig) -> int:
        """The sequences the engine runs at once: max_num_seqs, or as many as have state slots."""
        return self.state_slots or config.max_num_seqs

    @classmethod
    def resolve(cls, config: EngineConfig, hf_config: Any, placement: Placement, attention_backend: AttentionBackend,
                pending_bytes: int = 0, extra_block_bytes: int = 0) -> "ResolvedConfig":
        """Size the KV pool. On CUDA without kv_cache_memory_bytes it takes
        gpu_memory_utilization of the memory free now, less `pending_bytes` that will be
        taken after it (weights still to be loaded on this device, the CUDA graphs' pool):
        call it once the weights are in, as vLLM sizes its pool after the profile run.
        `extra_block_bytes` is what each block also takes elsewhere (a draft model's cache,
        addressed by the same block ids)."""
        from engine.models import registry
        from engine.models.decoder import kv_block_bytes

        device, dtype, positions = placement.device, placement.dtype, placement.max_positions
        budget = _budget(config, device, pending_bytes)
        linear = registry.state_layers(hf_config)
        state_slots = _state_slots(config, linear.state_bytes(dtype), budget) if linear is not None else 0
        state_bytes = linear.state_bytes(dtype) * state_slots if linear is not None else 0
        groups = kv_groups(config, hf_config)
        # Under parallelism every rank holds the same number of blocks, of its heads and layers.
        block_bytes = kv_block_bytes(hf_config, config.block_size, dtype, config.tensor_parallel_size,
                                     config.pipeline_parallel_size,
                                     groups.layers_per_block if groups.num_groups > 1 else None) + extra_block_bytes
        num_blocks = _num_blocks(config, budget, block_bytes, state_slots, state_bytes)
        capacity = num_blocks * config.block_size
        # A windowed group holds at most its window, the step's new tokens and a partial block
        # at each end (engine/kv_cache_manager.py); a full one the whole sequence.
        max_model_len = config.max_model_len or (positions if all(groups.windows) else min(positions, capacity))
        held = sum(-(-(max_model_len if w is None else min(max_model_len, w + config.max_num_batched_tokens
                                                           + 2 * config.block_size)) // config.block_size)
                   for w in groups.windows)
        if held > num_blocks:
            raise ParamError(
                "max_model_len",
                f"max_model_len ({max_model_len}) needs {held} KV blocks but "
                f"kv_cache_memory_bytes only holds {num_blocks}; raise the memory or lower it",
            )
        return cls(device, dtype, attention_backend, max_model_len, positions, num_blocks, groups, state_slots)


def _check_state_layers(config: EngineConfig, hf_config: Any) -> None:
    """What a model with state-keeping layers (linear attention, short convolutions) cannot
    do, refused by name: their state is one per sequence at its last token, so a draft's
    rejected tokens cannot be taken back out of it, and it is neither split across ranks
    nor handed between stages. The prefix cache is off for it (cached blocks cannot restore
    a state); that is said, not refused, as the option is on by default."""
    name = hf_config.model_type
    if config.speculative_config is not None:
        raise ParamError("speculative_config", f"{name} is not served with speculative decoding: its "
                         "state-keeping layers cannot take rejected tokens back out of their state")
    for field in ("tensor_parallel_size", "pipeline_parallel_size"):
        if getattr(config, field) > 1:
            raise ParamError(field, f"{name} is not served under parallelism: its state-keeping layers "
                             "keep their state on one rank")
    if config.enable_prefix_caching:
        logger.info("prefix caching is off for %s: its state-keeping layers keep a state that cached KV "
                    "blocks cannot restore", name)


def kv_groups(config: EngineConfig, hf_config: Any) -> KVGroups:
    """The block tables' layout: a table per group of like layers, except under pipeline
    parallelism (each stage holds its own layers) and with a draft model (it reads the
    target's tables over the whole sequence), where all layers share one."""
    from engine.models import registry

    draft = config.speculative_config is not None and config.speculative_config.method == "draft"
    windows = registry.layer_windows(hf_config)
    if draft:
        return kv_plan.single(len(windows))
    return kv_plan.plan(windows, split=config.pipeline_parallel_size == 1)


def _device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ParamError("device", "device is cuda but torch sees no CUDA GPU")
    return torch.device(name)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        if device.type == "cuda" or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    return getattr(torch, name)


def free_device_memory(device: torch.device) -> int:
    """Bytes free on an accelerator now (tests replace this probe to stand in for a GPU)."""
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def measures_memory(device: torch.device) -> bool:
    """Whether the KV pool is sized from free device memory rather than a fixed budget."""
    return device.type == "cuda"


def _budget(config: EngineConfig, device: torch.device, pending_bytes: int) -> int:
    """The cache's bytes: kv_cache_memory_bytes, else a share of the accelerator's free
    memory, else the CPU default."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if measures_memory(device):
        return int(max(0, free_device_memory(device) - pending_bytes) * config.gpu_memory_utilization)
    return CPU_KV_DEFAULT_BYTES


def _state_slots(config: EngineConfig, per_sequence: int, budget: int) -> int:
    """How many sequences a state-keeping model runs at once: one state slot each, for
    max_num_seqs. Where max_num_seqs is the default, no more than half the budget holds
    (a Qwen3.5-4B's 64 sequences would take 3.3 GB of the CPU's 2 GiB default), and the
    engine runs that many, saying so; one the user set is kept, and refused by
    `_num_blocks` if the budget cannot hold it."""
    slots = config.max_num_seqs
    if "max_num_seqs" in config.model_fields_set or slots * per_sequence <= budget // 2:
        return slots
    fit = max(1, budget // 2 // per_sequence)
    logger.info("max_num_seqs is %d here: each sequence's state takes %d bytes, and the states "
                "get half of the %d-byte cache budget (set max_num_seqs or kv_cache_memory_bytes to choose)",
                fit, per_sequence, budget)
    return fit


def _num_blocks(config: EngineConfig, budget: int, block_bytes: int, state_slots: int = 0,
                state_bytes: int = 0) -> int:
    if state_bytes and budget - state_bytes < block_bytes:
        raise ParamError("kv_cache_memory_bytes",
                         f"the cache budget ({budget} bytes) does not hold the per-sequence states of "
                         f"max_num_seqs ({state_slots}) sequences ({state_bytes} bytes) and a KV block "
                         f"({block_bytes} bytes); raise the budget or lower max_num_seqs")
    budget -= state_bytes
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ParamError("kv_cache_memory_bytes",
                         f"the KV cache budget ({budget} bytes) is smaller than one KV block ({block_bytes} bytes)")
    return num_blocks
