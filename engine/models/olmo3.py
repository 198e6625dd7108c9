"""OLMo 3: OLMo 2's layer, three sliding-window layers to every full one (`layer_types`),
each kind on its own rope parameters (the full layers' scaled where the checkpoint
extends its context)."""

from __future__ import annotations

from engine.models.olmo2 import Olmo2ForCausalLM


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    pass  # OLMo 2's spec reads the windows from layer_types, and rotary the rope per type
