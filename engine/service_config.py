"""The serving preset: the engine section is an EngineConfig, the service section is ours.

One YAML file picks everything a deployment tunes, so `PAGEDSERVE_CONFIG=config/gpu.yaml`
is the only switch between a laptop and a GPU box. EngineConfig forbids unknown keys,
so the service section is validated here by its own strict model.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.config import PRESET_DIR, EngineConfig

CONFIG_ENV = "PAGEDSERVE_CONFIG"
DEFAULT_PRESET = PRESET_DIR / "default.yaml"
DEFAULT_MODEL_TAG = "smollm2-135m-instruct"
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"


class TrafficConfig(BaseModel):
    """BentoML traffic settings for the one service (per replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: float = Field(600.0, gt=0, description="seconds until the first response byte")
    concurrency: int | None = Field(64, ge=1, description="requests a replica is meant to hold at once")
    max_concurrency: int | None = Field(None, ge=1, description="beyond this, requests get 429")


class ServiceConfig(BaseModel):
    """What the HTTP layer needs that the engine does not."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str | None = Field(
        None, description="the `model` clients send; None = the stored model's name, else the engine's"
    )
    model_tag: str = Field(DEFAULT_MODEL_TAG, description="BentoML model store tag to serve when present")
    traffic: TrafficConfig = TrafficConfig()


class ServingPreset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig
    service: ServiceConfig = ServiceConfig()


def preset_path(name_or_path: str | os.PathLike | None = None) -> Path:
    """Resolve the preset: an explicit path, $PAGEDSERVE_CONFIG, else config/default.yaml.

    A bare name (no suffix) means config/<name>.yaml; a relative path is tried against the
    working directory, then against the project root, so a Bento finds its own config/.
    """
    raw = name_or_path or os.environ.get(CONFIG_ENV) or DEFAULT_PRESET
    path = Path(raw).expanduser()
    if not path.suffix:
        path = PRESET_DIR / f"{raw}.yaml"
    if not path.is_absolute() and not path.is_file():
        path = PRESET_DIR.parent / path
    if not path.is_file():
        raise ValueError(f"serving preset {str(raw)!r} not found (looked for {path})")
    return path


def load_preset(name_or_path: str | os.PathLike | None = None) -> ServingPreset:
    """Read and validate a preset; a bad key or value raises ValueError naming it."""
    path = preset_path(name_or_path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset is a mapping with `engine:` and `service:` sections")
    engine = EngineConfig.create(**(data.get("engine") or {}))
    try:
        return ServingPreset(engine=engine, service=data.get("service") or {},
                             **{k: v for k, v in data.items() if k not in ("engine", "service")})
    except ValidationError as e:
        msgs = [f"{'.'.join(str(p) for p in err['loc']) or 'preset'}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"invalid serving preset {path}: " + "; ".join(msgs)) from None
