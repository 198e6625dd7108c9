"""Engine configuration: a strict pydantic model, loadable from the YAML presets in config/."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PRESET_DIR = Path(__file__).resolve().parent.parent / "config"


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
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton"] = "auto"

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}): every running sequence needs one token a step"
            )
        if self.dtype == "float16" and self.device == "cpu":
            raise ValueError("dtype float16 is not supported on device cpu; use float32 or bfloat16")
        return self

    @classmethod
    def from_preset(cls, name_or_path: str | Path, **overrides: Any) -> "EngineConfig":
        """Load a YAML preset (a name from config/ or a path) with keyword overrides on top."""
        path = Path(name_or_path)
        if not path.suffix:
            path = PRESET_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ValueError(f"config preset {str(name_or_path)!r} not found (looked for {path})")
        data = yaml.safe_load(path.read_text()) or {}
        engine = data.get("engine", data)
        return cls.create(**{**engine, **overrides})

    @classmethod
    def create(cls, **kwargs: Any) -> "EngineConfig":
        """Like the constructor, but a bad key or value raises ValueError naming the field."""
        try:
            return cls(**kwargs)
        except ValidationError as e:
            msgs = []
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "config"
                msgs.append(f"{where}: {err['msg']}")
            raise ValueError("invalid engine config: " + "; ".join(msgs)) from None
