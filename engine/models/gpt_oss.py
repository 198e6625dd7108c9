"""gpt-oss: pre-norm layers alternating sliding-window and full attention, with q/k/v/o
biases and a learned sink logit per head in every softmax; every MLP a mixture of experts
whose router has a bias and softmaxes its top-k logits, and whose experts have biases and
a clamped SwiGLU. Rotary is YaRN.

Its checkpoints stack each layer's experts: `gate_up_proj` [E, hidden, 2 I] with gate and
up interleaved column by column, `down_proj` [E, I, hidden] (both transposed against a
Linear's weight), or, as OpenAI ships them, in MXFP4 (`*_blocks` and `*_scales`,
engine/models/mxfp4.py). engine/models/weights.py reads both into the expert layer."""

from __future__ import annotations

from engine.models.arch import ArchSpec, layer_windows, moe_spec
from engine.models.decoder import DecoderForCausalLM


class GptOssForCausalLM(DecoderForCausalLM):
    interleaved_experts = True

    @classmethod
    def spec(cls, config) -> ArchSpec:
        moe = moe_spec(config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       norm_topk=False, router_bias=True, softmax_topk=True, expert_bias=True,
                       swiglu_limit=float(config.swiglu_limit), swiglu_alpha=float(config.swiglu_alpha))
        bias = bool(getattr(config, "attention_bias", True))
        return ArchSpec(qkv_bias=bias, o_bias=bias, late_cast=True, windows=layer_windows(config), moe=moe,
                        sinks=True)

    @classmethod
    def checkpoint_name(cls, name: str) -> str | None:
        return name.replace(".mlp.router.", ".mlp.gate.")
