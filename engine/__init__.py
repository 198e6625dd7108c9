"""A paged-KV LLM inference engine."""

__version__ = "0.1.0"  # pyproject.toml reads it; /version serves it

from engine.config import EngineConfig
from engine.errors import EngineDeadError, ParamError
from engine.llm import LLM
from engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from engine.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "EngineConfig", "RequestOutput", "CompletionOutput",
           "BeamSearchOutput", "BeamSearchSequence", "ParamError", "EngineDeadError"]
