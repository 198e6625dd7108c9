"""GLM-4.5 and GLM-4.6 (`glm4_moe`): Llama's pre-norm layer with q/k/v biases, per-head q/k
norms where use_qk_norm says so, and a partial rotary on rotate-half's pairs (unlike the
dense GLMs); DeepSeek-V3's experts after the first dense layers. Checkpoints carry a
multi-token-prediction layer past the last one, which the loader skips as a layer it does
not hold."""

from __future__ import annotations

from engine.models.arch import ArchSpec, deepseek_moe
from engine.models.decoder import DecoderForCausalLM

# DeepSeek-V3-style checkpoint names -> the expert layer's (engine/models/layers/moe.py).
DEEPSEEK_NAMES = ((".mlp.gate.e_score_correction_bias", ".mlp.gate.choice_bias"),
                  (".mlp.shared_experts.", ".mlp.shared_expert."))


def deepseek_name(name: str) -> str:
    for old, new in DEEPSEEK_NAMES:
        name = name.replace(old, new)
    return name


class Glm4MoeForCausalLM(DecoderForCausalLM):
    @classmethod
    def spec(cls, config) -> ArchSpec:
        return ArchSpec(qkv_bias=bool(getattr(config, "attention_bias", False)),
                        qk_norm="head" if getattr(config, "use_qk_norm", False) else "",
                        windows=(0,) * config.num_hidden_layers, moe=deepseek_moe(config))

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return deepseek_name(name)
