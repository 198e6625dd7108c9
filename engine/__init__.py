"""A paged-KV LLM inference engine.

The public names below load on first use (PEP 562), so that importing one light module
(`engine.errors`, `engine.messages`, the serving layer's protocol) does not pull in torch,
transformers and every model: the HTTP process and the BentoML CLI start seconds sooner.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # pyproject.toml reads it; /version serves it

_PUBLIC = {
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling_params",
    "BeamSearchParams": "engine.sampling_params",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "BeamSearchOutput": "engine.outputs",
    "BeamSearchSequence": "engine.outputs",
    "EmbeddingOutput": "engine.outputs",
    "ScoreOutput": "engine.outputs",
    "PoolingParams": "engine.pooling",
    "ParamError": "engine.errors",
    "EngineDeadError": "engine.errors",
}
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "EmbeddingOutput", "ScoreOutput", "PoolingParams", "ParamError",
           "EngineDeadError"]

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.errors import EngineDeadError, ParamError
    from engine.llm import LLM
    from engine.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput, EmbeddingOutput,
                                RequestOutput, ScoreOutput)
    from engine.pooling import PoolingParams
    from engine.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
