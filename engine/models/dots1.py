"""dots.llm1 (`dots1`): Qwen3's attention (per-head q/k norms, windows where layer_types
say so) over DeepSeek-V3's experts after the first dense layers."""

from __future__ import annotations

import dataclasses

from engine.models.arch import ArchSpec, deepseek_moe
from engine.models.decoder import DecoderForCausalLM
from engine.models.glm4_moe import deepseek_name
from engine.models.qwen3 import Qwen3ForCausalLM


class Dots1ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return dataclasses.replace(Qwen3ForCausalLM.spec(config), moe=deepseek_moe(config))

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return deepseek_name(name)
