"""Gemma 3 (text): Gemma 2's layer with per-head q/k norms and no attention soft-cap, five
local layers to every global one, the local ones on their own rope base. The multimodal
checkpoints' language model is served as this; their vision tower is not loaded."""

from __future__ import annotations

from engine.models.arch import ArchSpec
from engine.models.decoder import DecoderForCausalLM
from engine.models.gemma2 import gemma_spec
from engine.models.text_part import text_name

# Where a multimodal Gemma 3 checkpoint keeps its language model's tensors.
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return gemma_spec(config, qk_norm="head", attn_softcap=getattr(config, "attn_logit_softcapping", None) or 0.0,
                          final_softcap=getattr(config, "final_logit_softcapping", None) or 0.0)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return text_name(name, VISION_PREFIXES)
