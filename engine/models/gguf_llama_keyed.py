"""The configs of architectures llama.cpp writes under Llama's keys (each under its own
name, with a few keys of its own): built from the fields transformers' reader gives when
it is shown the file as `llama` (Gemma's as `gemma2`; engine/models/gguf_config.py), and
the keys only these architectures have; the state-keeping models' in gguf_state_keyed.py."""

from __future__ import annotations

from typing import Any

from engine.errors import ParamError
from engine.models import gguf_state_keyed
from engine.models.gguf_fields import llama_fields, main_layers, need
from engine.models.layers import rotary


def _multipliers(fields: dict[str, Any], get) -> dict[str, float]:
    """Granite's four multipliers, which llama.cpp writes as `*_scale` keys, and only where
    they are set: without one, its embeddings, residuals and logits go unscaled and its
    attention scales by 1 / sqrt(head_dim), as llama.cpp then computes."""
    return dict(embedding_multiplier=float(get("embedding_scale") or 1.0),
                residual_multiplier=float(get("residual_scale") or 1.0),
                logits_scaling=float(get("logit_scale") or 1.0),
                attention_multiplier=float(get("attention.scale") or
                                           (fields["hidden_size"] // fields["num_attention_heads"]) ** -0.5))


def _granite(config: Any, get, tensors: dict[str, Any]) -> Any:
    from transformers import GraniteConfig

    fields = llama_fields(config)
    return GraniteConfig(**fields, **_multipliers(fields, get), architectures=["GraniteForCausalLM"])


def _granitemoe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Granite 3 MoE (`granitemoe`, Llama's tensors with the experts merged per layer):
    its multipliers, expert count and size, and the shared expert's size where the file
    has one (GraniteMoeShared)."""
    from transformers import GraniteMoeConfig, GraniteMoeSharedConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "intermediate_size"}
    fields.update(_multipliers(fields, get), num_local_experts=need(get, "expert_count"),
                  num_experts_per_tok=need(get, "expert_used_count"),
                  intermediate_size=int(get("expert_feed_forward_length", config.intermediate_size)))
    shared = get("expert_shared_feed_forward_length")
    if shared:
        return GraniteMoeSharedConfig(**fields, shared_intermediate_size=int(shared),
                                      architectures=["GraniteMoeSharedForCausalLM"])
    return GraniteMoeConfig(**fields, architectures=["GraniteMoeForCausalLM"])


def mixtral(config: Any, get) -> Any:
    """llama.cpp files Mixtral as `llama` with experts: the Mixtral config it was written from."""
    from transformers import MixtralConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "intermediate_size"}
    return MixtralConfig(**fields,
                         intermediate_size=int(get("expert_feed_forward_length", config.intermediate_size)),
                         num_local_experts=need(get, "expert_count"),
                         num_experts_per_tok=need(get, "expert_used_count"),
                         sliding_window=None, architectures=["MixtralForCausalLM"])


def _layer_types(get, layers: int, every: int = 4) -> list[str]:
    """Each layer's attention kind from the window pattern llama.cpp writes (one flag per
    layer, true where windowed); without one, its default: every `every`-th layer global."""
    pattern = get("attention.sliding_window_pattern")
    if pattern is None:
        pattern = [(i + 1) % every != 0 for i in range(layers)]
    if len(pattern) != layers:
        raise ParamError("model", f"the GGUF window pattern has {len(pattern)} flags for {layers} layers")
    return ["sliding_attention" if windowed else "full_attention" for windowed in pattern]


def _smollm3(config: Any, get, tensors: dict[str, Any]) -> Any:
    """llama.cpp turns no rotary on every fourth layer, as the config's default does."""
    from transformers import SmolLM3Config

    return SmolLM3Config(**llama_fields(config), architectures=["SmolLM3ForCausalLM"])


def partial_rotary(config: Any, get) -> None:
    """The rotary width llama.cpp writes (`rope.dimension_count`) as the config's fraction of
    a head, where it is not the whole head (GLM-4 turns half or a quarter of each, Nemotron
    half, StableLM a quarter); read for every architecture here, so that no file's width is
    dropped."""
    turned, head_dim = get("rope.dimension_count"), rotary.head_dim(config)
    if turned and int(turned) != head_dim:
        config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": int(turned) / head_dim}


def _olmo(config: Any, get, tensors: dict[str, Any]) -> Any:
    """llama.cpp files OLMo 2 and OLMo 3 as `olmo2`; OLMo 3 is the one with a window. Its
    windowed layers turn by the plain rotary, its global ones with the file's scaling (as
    transformers' OLMo 3 and llama.cpp both do)."""
    from transformers import Olmo2Config, Olmo3Config

    fields = llama_fields(config)
    window = get("attention.sliding_window")
    if not window:
        return Olmo2Config(**fields, architectures=["Olmo2ForCausalLM"])
    full = dict(fields.pop("rope_parameters"))
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": full["rope_theta"]}, "full_attention": full}
    return Olmo3Config(**fields, rope_parameters=rope, sliding_window=int(window),
                       layer_types=_layer_types(get, fields["num_hidden_layers"]), architectures=["Olmo3ForCausalLM"])


def _exaone4(config: Any, get, tensors: dict[str, Any]) -> Any:
    """EXAONE 4 with its window pattern where the file has a window (its global layers
    then turn no rotary), every layer global without one (EXAONE 4 1.2B)."""
    from transformers import Exaone4Config

    fields = llama_fields(config)
    window = get("attention.sliding_window")
    layers = fields["num_hidden_layers"]
    types = _layer_types(get, layers) if window else ["full_attention"] * layers
    return Exaone4Config(**fields, sliding_window=int(window) if window else None, layer_types=types,
                         architectures=["Exaone4ForCausalLM"])


def _ernie4_5(config: Any, get, tensors: dict[str, Any]) -> Any:
    """ERNIE 4.5: biases on every projection or on none (`use_bias`), as the file holds them."""
    from transformers import Ernie4_5Config

    return Ernie4_5Config(**llama_fields(config), use_bias="blk.0.attn_q.bias" in tensors,
                          architectures=["Ernie4_5ForCausalLM"])


def _glm4(config: Any, get, tensors: dict[str, Any]) -> Any:
    """GLM-4 (0414): q/k/v biases where the file holds them (its partial rotary: `partial_rotary`)."""
    from transformers import Glm4Config

    return Glm4Config(**llama_fields(config), attention_bias="blk.0.attn_q.bias" in tensors,
                      architectures=["Glm4ForCausalLM"])


def _cohere(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Command R and Aya (`command-r`), and Command R7B (`cohere2`, its window on every layer
    but each fourth, as llama.cpp fixes it): LayerNorm's epsilon and the logit scale.
    Command R+'s per-head q/k norms come as attn_q_norm tensors; the registry refuses them."""
    from transformers import Cohere2Config, CohereConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "rms_norm_eps"}
    fields.update(layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
                  logit_scale=float(get("logit_scale", 1.0)), tie_word_embeddings=True)
    if "blk.0.attn_q_norm.weight" in tensors:
        fields["use_qk_norm"] = True
    window = get("attention.sliding_window")
    if not window:
        return CohereConfig(**fields, architectures=["CohereForCausalLM"])
    return Cohere2Config(**fields, sliding_window=int(window),
                         layer_types=_layer_types(get, fields["num_hidden_layers"]),
                         architectures=["Cohere2ForCausalLM"])


def _arcee(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Arcee: Llama's tensors and keys with a plain ReLU² MLP, which llama.cpp always
    computes; biases where the file holds them."""
    from transformers import ArceeConfig

    return ArceeConfig(**llama_fields(config), hidden_act="relu2", attention_bias="blk.0.attn_q.bias" in tensors,
                       mlp_bias="blk.0.ffn_up.bias" in tensors, architectures=["ArceeForCausalLM"])


def _starcoder2(config: Any, get, tensors: dict[str, Any]) -> Any:
    """StarCoder2: LayerNorm's epsilon, biases where the file holds them, GELU (tanh, as
    llama.cpp computes it); its converter writes no window, and llama.cpp attends to the
    whole context."""
    from transformers import Starcoder2Config

    fields = {k: v for k, v in llama_fields(config).items() if k != "rms_norm_eps"}
    return Starcoder2Config(**fields, norm_epsilon=float(get("attention.layer_norm_epsilon", 1e-5)),
                            use_bias="blk.0.attn_q.bias" in tensors, hidden_act="gelu_pytorch_tanh",
                            sliding_window=None, architectures=["Starcoder2ForCausalLM"])


def _gemma(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Gemma (1): the common fields of the Gemma 2 config its keys were read as."""
    from transformers import GemmaConfig

    return GemmaConfig(**llama_fields(config), hidden_act="gelu_pytorch_tanh", architectures=["GemmaForCausalLM"])


def _nemotron(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Nemotron: LayerNorm's epsilon, its partial rotary, ReLU² (which llama.cpp always
    computes), biases where the file holds them."""
    from transformers import NemotronConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "rms_norm_eps"}
    return NemotronConfig(**fields, norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)), hidden_act="relu2",
                          attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias="blk.0.ffn_up.bias" in tensors,
                          architectures=["NemotronForCausalLM"])


def _olmoe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """OLMoE: its experts' count, how many a token takes, and their size (the file's
    feed-forward length); llama.cpp does not renormalise the top-k, as OLMoE's configs do not."""
    from transformers import OlmoeConfig

    return OlmoeConfig(**llama_fields(config), num_experts=need(get, "expert_count"),
                       num_experts_per_tok=need(get, "expert_used_count"), norm_topk_prob=False,
                       attention_bias="blk.0.attn_q.bias" in tensors, architectures=["OlmoeForCausalLM"])


def _stablelm(config: Any, get, tensors: dict[str, Any]) -> Any:
    """StableLM 2: LayerNorm's epsilon, the partial rotary, q/k/v biases where the file holds
    them, and the two flags of the 12B that the engine refuses by name (the parallel
    residual, whose key the converter writes true when a config leaves it out; per-head
    q/k norms, as tensors)."""
    from transformers import StableLmConfig

    fields = {k: v for k, v in llama_fields(config).items() if k != "rms_norm_eps"}
    return StableLmConfig(**fields, layer_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
                          use_qkv_bias="blk.0.attn_q.bias" in tensors,
                          use_parallel_residual=bool(get("use_parallel_residual", True)),
                          qk_layernorm="blk.0.attn_q_norm.weight" in tensors, architectures=["StableLmForCausalLM"])


def _apertus(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Apertus: Llama's keys, its xIELU (whose per-layer parameters the file keeps as keys,
    engine/models/gguf_tensors.py), biases where the file holds them."""
    from transformers import ApertusConfig

    return ApertusConfig(**llama_fields(config), hidden_act="xielu", attention_bias="blk.0.attn_q.bias" in tensors,
                         mlp_bias="blk.0.ffn_up.bias" in tensors, architectures=["ApertusForCausalLM"])


def _hunyuan(config: Any, get, tensors: dict[str, Any]) -> Any:
    """HunYuan dense: llama.cpp's converter stretches the rope base by alpha ** (d / (d - 2))
    and writes the stretched base with no scaling, which is the same rotary as the
    checkpoint's fixed-alpha NTK; q/k/v/o biases where the file holds them."""
    from transformers import HunYuanDenseV1Config

    return HunYuanDenseV1Config(**llama_fields(config), attention_bias="blk.0.attn_q.bias" in tensors,
                                architectures=["HunYuanDenseV1ForCausalLM"])


def _ernie4_5_moe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """ERNIE 4.5 MoE: its experts from the first MoE layer (llama.cpp's leading dense count)
    every interleave step to the last layer, as llama.cpp builds them; biases where the
    file holds them."""
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(**llama_fields(config), use_bias="blk.0.attn_q.bias" in tensors,
                              moe_num_experts=need(get, "expert_count"), moe_k=need(get, "expert_used_count"),
                              moe_intermediate_size=need(get, "expert_feed_forward_length"),
                              moe_num_shared_experts=int(get("expert_shared_count", 0)),
                              moe_layer_start_index=int(get("leading_dense_block_count", 1)),
                              moe_layer_interval=int(get("interleave_moe_layer_step", 1)), moe_layer_end_index=-1,
                              architectures=["Ernie4_5_MoeForCausalLM"])


def _deepseek_moe(get) -> dict[str, Any]:
    """DeepSeek-V3's expert settings as llama.cpp writes them for GLM-4.5 and dots.llm1. Its
    converters write no expert groups (both families route over one), and its sigmoid
    gating is the only one these configs compute: a file that says otherwise is refused."""
    gating = get("expert_gating_func")
    if gating not in (None, 2):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise ParamError("model", f"this GGUF's expert_gating_func is {gating}; its architecture gates by sigmoid (2)")
    return dict(n_routed_experts=need(get, "expert_count"), num_experts_per_tok=need(get, "expert_used_count"),
                moe_intermediate_size=need(get, "expert_feed_forward_length"),
                n_shared_experts=int(get("expert_shared_count", 0)),
                first_k_dense_replace=int(get("leading_dense_block_count", 0)),
                routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(get("expert_weights_norm", False)), n_group=1, topk_group=1)


def _glm4_moe(config: Any, get, tensors: dict[str, Any]) -> Any:
    """GLM-4.5 and 4.6: q/k/v biases and per-head q/k norms where the file holds them (its
    partial rotary: `partial_rotary`), DeepSeek-V3's experts; its MTP layers left out."""
    from transformers import Glm4MoeConfig

    fields = llama_fields(config)
    fields["num_hidden_layers"] = main_layers(get, fields["num_hidden_layers"])
    return Glm4MoeConfig(**fields, attention_bias="blk.0.attn_q.bias" in tensors,
                         use_qk_norm="blk.0.attn_q_norm.weight" in tensors, **_deepseek_moe(get),
                         architectures=["Glm4MoeForCausalLM"])


def _dots1(config: Any, get, tensors: dict[str, Any]) -> Any:
    """dots.llm1: Qwen3's attention (q/k/v/o biases where the file holds them; its converter
    writes no window), DeepSeek-V3's experts."""
    from transformers import Dots1Config

    return Dots1Config(**llama_fields(config), attention_bias="blk.0.attn_q.bias" in tensors, sliding_window=None,
                       **_deepseek_moe(get), architectures=["Dots1ForCausalLM"])


def _mistral3(config: Any, get, tensors: dict[str, Any]) -> Any:
    """Ministral 3 (llama.cpp's `mistral3`, with Llama's tensors): its YaRN, whose attention
    factor llama.cpp takes as mscale 1 over the log multiplier it writes (the checkpoint's
    mscale_all_dim), and Llama 4's attention temperature (`attention.temperature_scale`, over
    the original context)."""
    from transformers import Ministral3Config

    fields = llama_fields(config)
    rope = dict(fields.pop("rope_parameters"))
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if rope.get("rope_type") == "yarn" and log_mul:
        rope.update(mscale=1.0, mscale_all_dim=float(log_mul))
    if get("attention.temperature_scale"):
        rope["llama_4_scaling_beta"] = float(get("attention.temperature_scale"))
    return Ministral3Config(**fields, rope_parameters=rope, sliding_window=None,
                            architectures=["Ministral3ForCausalLM"])


# Each architecture (as llama.cpp names it) and how its config is built from the Llama fields.
BUILDERS = {"smollm3": _smollm3, "granite": _granite, "arcee": _arcee, "gemma": _gemma, "nemotron": _nemotron,
            "olmoe": _olmoe, "stablelm": _stablelm, "olmo2": _olmo, "exaone4": _exaone4, "ernie4_5": _ernie4_5,
            "glm4": _glm4, "command-r": _cohere, "cohere2": _cohere, "starcoder2": _starcoder2, "apertus": _apertus,
            "hunyuan-dense": _hunyuan, "ernie4_5-moe": _ernie4_5_moe, "glm4moe": _glm4_moe, "dots1": _dots1,
            "mistral3": _mistral3, "granitemoe": _granitemoe, **gguf_state_keyed.BUILDERS}
# Those whose tensors are Llama's too (q and k interleaved as Llama's), which transformers'
# reader converts; every other one's are the checkpoint's, only renamed
# (engine/models/gguf_tensors.py convert_named).
LLAMA_TENSORS = ("smollm3", "granite", "arcee", "mistral3", "granitemoe")


def tensor_config(arch: str, config: Any) -> Any:
    """The config whose model transformers' reader names a file's tensors by: the file's
    own, but for Ministral 3, whose llama.cpp name (`mistral3`) is no model type the reader
    knows; its tensors are Llama's, so a Llama config of its shapes names them."""
    if arch != "mistral3":
        return config
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in llama_fields(config).items() if k != "rope_parameters"})


def renamed(arch: str) -> bool:
    """Whether a file of this architecture (as llama.cpp names it) holds the checkpoint's
    tensors under llama.cpp's names, for gguf_tensors.convert_named to name back."""
    return arch in BUILDERS and arch not in LLAMA_TENSORS
