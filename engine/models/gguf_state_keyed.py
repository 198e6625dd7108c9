"""The GGUF configs of the state-keeping models llama.cpp writes under Llama's keys (LFM2's
and LFM2-MoE's short convolutions, Qwen3.5's and Qwen3-Next's linear attention): which
layers keep a state, read from the file's per-layer keys or tensors, and their sizes."""

from __future__ import annotations

from typing import Any

from engine.errors import ParamError
from engine.models.gguf_fields import llama_fields, main_layers, need


def _lfm2(config: Any, get, tensors: dict[str, Any]) -> Any:
    """LFM2: its convolution layers where the per-layer KV head count is 0, their taps
    (`shortconv.l_cache`), and the MLP's size as the converter derived it (so none is
    derived again)."""
    from transformers import Lfm2Config

    return Lfm2Config(**_lfm2_fields(config, get), block_auto_adjust_ff_dim=False, architectures=["Lfm2ForCausalLM"])


def _lfm2moe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """LFM2-MoE (`lfm2moe`): LFM2's layers, dense MLPs on the leading dense blocks, then
    sigmoid-scored experts with their choice bias where the file holds it (`exp_probs_b`);
    its converter writes neither the renormalisation nor a scale, which llama.cpp takes
    as on and 1, as the released models have them."""
    from transformers import Lfm2MoeConfig

    fields = _lfm2_fields(config, get)
    dense = int(get("leading_dense_block_count", 0) or 0)
    return Lfm2MoeConfig(**fields, num_experts=need(get, "expert_count"),
                         num_experts_per_tok=need(get, "expert_used_count"),
                         moe_intermediate_size=need(get, "expert_feed_forward_length"), num_dense_layers=dense,
                         use_expert_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
                         norm_topk_prob=bool(get("expert_weights_norm", True)),
                         routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
                         architectures=["Lfm2MoeForCausalLM"])


def _lfm2_fields(config: Any, get) -> dict[str, Any]:
    """LFM2's layer types from the per-layer KV head counts (0 for a convolution), its taps
    and its norms' epsilon, beside the Llama fields."""
    fields = llama_fields(config)
    counts = get("attention.head_count_kv")
    if not isinstance(counts, list) or len(counts) != fields["num_hidden_layers"] or not any(counts):
        raise ParamError("model", f"the GGUF file's attention.head_count_kv must hold a count per layer, 0 for a "
                                  f"convolution, and one above 0; it is {counts!r}"[:300])
    fields["num_key_value_heads"] = max(counts)
    fields.pop("rms_norm_eps", None)
    fields["norm_eps"] = float(get("attention.layer_norm_rms_eps", 1e-5))
    return {**fields, "layer_types": ["full_attention" if n else "conv" for n in counts],
            "conv_L_cache": need(get, "shortconv.l_cache")}


def _qwen35moe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Qwen3.5's MoE models (`qwen35moe`): Qwen3.5's layers, experts on every one (renormalised,
    as transformers' always are) beside the shared expert, sized by the file's keys."""
    from transformers import Qwen3_5MoeTextConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "intermediate_size"}
    fields.update(_linear_layers(config, get, tensors))
    return Qwen3_5MoeTextConfig(**fields, num_experts=need(get, "expert_count"),
                                num_experts_per_tok=need(get, "expert_used_count"),
                                moe_intermediate_size=need(get, "expert_feed_forward_length"),
                                shared_expert_intermediate_size=need(get, "expert_shared_feed_forward_length"),
                                architectures=["Qwen3_5MoeForCausalLM"])


def _qwen35(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Qwen3.5 (llama.cpp's `qwen35`): its linear-attention layers where the file holds their
    `ssm_a` (the converter's recurrent-layer flags and attention interval say the same),
    their sizes from the `ssm.*` keys (llama.cpp's Mamba names: key heads as groups, value
    heads as the time-step rank, the key dim as the state size); its MTP layers left out.
    Its rotary width is read by `partial_rotary`; the M-RoPE sections turn text as the
    plain rotary does."""
    from transformers import Qwen3_5TextConfig

    fields = llama_fields(config)
    layers = fields["num_hidden_layers"] = main_layers(get, fields["num_hidden_layers"])
    value_heads = need(get, "ssm.time_step_rank")
    types = ["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(layers)]
    return Qwen3_5TextConfig(**fields, layer_types=types, linear_num_key_heads=need(get, "ssm.group_count"),
                             linear_num_value_heads=value_heads, linear_key_head_dim=need(get, "ssm.state_size"),
                             linear_value_head_dim=need(get, "ssm.inner_size") // value_heads,
                             linear_conv_kernel_dim=need(get, "ssm.conv_kernel"),
                             architectures=["Qwen3_5ForCausalLM"])


def _linear_layers(config: Any, get, tensors: dict[str, Any]) -> dict[str, Any]:
    """The layer types and linear-attention sizes `_qwen35` reads, for the architectures
    that share Qwen3.5's layers under other MLPs."""
    linear = _qwen35(config, get, tensors).to_dict()
    keep = {k: linear[k] for k in ("layer_types", "linear_num_key_heads", "linear_num_value_heads",
                                   "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    return {**keep, "num_hidden_layers": len(keep["layer_types"])}


def _qwen3next(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Qwen3-Next (`qwen3next`): Qwen3.5's layers as `_qwen35` reads them, its value heads in
    the checkpoint's order (its converter tiles none), experts on every layer (llama.cpp
    names no dense MLP for it) beside the shared expert, each token's top k renormalised
    as llama.cpp and the released models do."""
    from transformers import Qwen3NextConfig

    fields = llama_fields(config)
    fields.update(_linear_layers(config, get, tensors))
    rope = dict(fields.pop("rope_parameters"))
    return Qwen3NextConfig(**fields, num_experts=need(get, "expert_count"),
                           num_experts_per_tok=need(get, "expert_used_count"),
                           moe_intermediate_size=need(get, "expert_feed_forward_length"),
                           shared_expert_intermediate_size=need(get, "expert_shared_feed_forward_length"),
                           norm_topk_prob=bool(get("expert_weights_norm", True)), decoder_sparse_step=1,
                           mlp_only_layers=[], partial_rotary_factor=rope.get("partial_rotary_factor", 1.0),
                           rope_parameters=rope, architectures=["Qwen3NextForCausalLM"])


BUILDERS = {"qwen35": _qwen35, "qwen35moe": _qwen35moe, "qwen3next": _qwen3next, "lfm2": _lfm2, "lfm2moe": _lfm2moe}
