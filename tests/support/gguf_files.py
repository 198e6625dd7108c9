"""Tiny GGUF files of each architecture llama.cpp converts, written with the gguf
package from a transformers checkpoint: tensors named and transformed as llama.cpp's
converter names and transforms them (Gemma's and Nemotron's norms stored as 1 + w; the
Llama family's q/k rows interleaved; experts merged per layer; GLM-4.5's
multi-token-prediction block after the last layer; Phi-3's fused projections kept fused;
LongRoPE factors as tensors; Apertus's xIELU parameters as keys), the
metadata keys it writes, and a small byte-level tokenizer (its `pre` named as the
converter names it). F32 tensors keep the checkpoint's values exactly; Q8_0 (or Q5_0)
ones are what a quantized file holds."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tests.support import gguf_layouts as layouts

GGUF_ARCH = {"llama": "LLAMA", "smollm3": "SMOLLM3", "granite": "GRANITE", "qwen2": "QWEN2", "qwen3": "QWEN3", "gemma": "GEMMA", "gemma2": "GEMMA2", "gemma3_text": "GEMMA3", "phi3": "PHI3",
             "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE", "gpt_oss": "GPT_OSS", "mixtral": "LLAMA",
             "olmo2": "OLMO2", "olmo3": "OLMO2", "exaone4": "EXAONE4", "ernie4_5": "ERNIE4_5", "glm4": "GLM4",
             "cohere": "COMMAND_R", "cohere2": "COHERE2", "arcee": "ARCEE", "starcoder2": "STARCODER2",
             "nemotron": "NEMOTRON", "olmoe": "OLMOE", "stablelm": "STABLELM",
             "apertus": "APERTUS", "hunyuan_v1_dense": "HUNYUAN_DENSE", "ernie4_5_moe": "ERNIE4_5_MOE",
             "glm4_moe": "GLM4_MOE", "dots1": "DOTS1", "ministral3": "MISTRAL3", "granitemoe": "GRANITE_MOE",
             "granitemoeshared": "GRANITE_MOE", "qwen3_5_text": "QWEN35", "qwen3_5_moe_text": "QWEN35MOE",
             "lfm2": "LFM2", "qwen3_next": "QWEN3NEXT", "lfm2_moe": "LFM2MOE"}


VOCAB = 512  # the tiny files' vocabulary: a byte-level BPE of the 256 bytes
# Where each MoE config keeps its expert count and expert size.
EXPERT_KEYS = {"qwen2_moe": ("num_experts", "moe_intermediate_size"),
               "qwen3_moe": ("num_experts", "moe_intermediate_size"),
               "gpt_oss": ("num_local_experts", "intermediate_size"),
               "mixtral": ("num_local_experts", "intermediate_size"),
               "olmoe": ("num_experts", "intermediate_size"),
               "ernie4_5_moe": ("moe_num_experts", "moe_intermediate_size"),
               "glm4_moe": ("n_routed_experts", "moe_intermediate_size"),
               "dots1": ("n_routed_experts", "moe_intermediate_size"),
               "granitemoe": ("num_local_experts", "intermediate_size"),
               "granitemoeshared": ("num_local_experts", "intermediate_size"),
               "qwen3_5_moe_text": ("num_experts", "moe_intermediate_size"),
               "qwen3_next": ("num_experts", "moe_intermediate_size"),
               "lfm2_moe": ("num_experts", "moe_intermediate_size")}


def byte_tokenizer(writer, specials: tuple[str, ...] = (), vocab: int = VOCAB, pre: str = "default",
                   merges: tuple[str, ...] = ("\u0120 \u0120",)) -> None:
    """A small byte-level tokenizer: a GGUF's tokenizer is parsed every time the file is
    read, and a real 49k-token one made each read of these files take five seconds.
    `specials` are control tokens after the bytes (a chat format's tags); user-defined
    tokens fill the rest of `vocab` (scripts/shape_gguf.py pads to a real vocabulary).
    `merges` (the reader needs one at least) add their tokens after the bytes; `pre` names
    the split, as llama.cpp's converter names it."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    words = chars + [m.replace(" ", "") for m in merges]
    extra = vocab - 3 - len(words) - len(specials)
    tokens = ["<unk>", "<s>", "</s>"] + words + list(specials) + [f"<extra_{i}>" for i in range(extra)]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * len(words) \
        + [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.USER_DEFINED] * extra
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(merges))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write(hf_dir: Path, out: Path, qtype: str = "F32", chat_template: str | None = None,
          specials: tuple[str, ...] = (), mxfp4_experts: bool = False, mtp_layers: int = 0,
          keep: dict[str, str] | None = None, **tokenizer) -> Path:
    """`keep` {name suffix: F32, F16 or BF16}: tensors whose GGUF names end so are written
    in that type instead of `qtype`, as some quantizers keep the embedding, the head or
    small projections; `chat_template` and its `specials` (control tokens) go in the
    tokenizer, as a chat model's converter writes them; `mxfp4_experts` writes merged
    experts in GGML's MXFP4; `mtp_layers` appends that many multi-token-prediction blocks
    after the last layer, as GLM-4.5's converter does (a copy of the last layer with its
    `nextn.*` tensors, counted in block_count); `tokenizer` holds byte_tokenizer's `pre`
    and `merges`."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCH[config.model_type])
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(out, name)
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    if config.model_type == "lfm2":  # the size its converter derives
        inter = int(2 * config.intermediate_size / 3)
        inter = config.block_multiple_of * -(-int(config.block_ffn_dim_multiplier * inter) // config.block_multiple_of)
        writer.add_feed_forward_length(inter)
    else:
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    writer.add_head_count(heads)
    if config.model_type in ("lfm2", "lfm2_moe"):  # a KV head count per layer, 0 for a convolution, and the taps
        writer.add_head_count_kv([0 if t == "conv" else config.num_key_value_heads for t in config.layer_types])
        writer.add_shortconv_l_cache(config.conv_L_cache)
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
    if config.model_type in ("cohere", "cohere2"):  # LayerNorm, and a logit scale
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_logit_scale(config.logit_scale)
    elif config.model_type == "starcoder2":
        writer.add_layer_norm_eps(config.norm_epsilon)
    elif config.model_type == "nemotron":  # LayerNorm, and its partial rotary in dims
        writer.add_layer_norm_eps(config.norm_eps)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    elif config.model_type in ("lfm2", "lfm2_moe"):
        writer.add_layer_norm_rms_eps(config.norm_eps)
    elif config.model_type == "stablelm":  # the same, and the parallel-residual flag
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_parallel_residual(config.use_parallel_residual)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    if rope.get("alpha"):  # HunYuan's NTK alpha: its converter writes the stretched base, and no scaling
        writer.add_rope_freq_base(rope["rope_theta"] * rope["alpha"] ** (head_dim / (head_dim - 2)))
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
    if getattr(config, "head_dim", None):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if config.model_type in ("gemma2", "gemma3_text"):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.model_type in ("olmo3", "exaone4") and config.sliding_window:  # one flag per layer
        writer.add_sliding_window(config.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
    if config.model_type == "cohere2":  # no pattern: llama.cpp windows all layers but each fourth
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "glm4":  # its partial rotary, in dims
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    tensors = load_file(hf_dir / "model.safetensors")
    if config.model_type == "olmo3" and rope.get("rope_type") == "yarn":  # its converter's own keys
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_attn_factors(rope["attention_factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif config.model_type != "phi3":  # Phi-3's LongRoPE below
        tensors.update(_rope_scaling(writer, rope, head_dim))
    if config.model_type == "ministral3":  # its converter's keys beside the YaRN ones
        writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if config.model_type in ("llama", "smollm3", "granite", "arcee", "ministral3", "granitemoe", "granitemoeshared"):
        # llama.cpp's Llama family
        tensors = layouts.llama_permuted(tensors, config)
    if config.model_type in ("granite", "granitemoe", "granitemoeshared"):  # its multipliers as llama.cpp names them
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if config.model_type in EXPERT_KEYS:  # the expert count and size under each config's own keys
        count, size = (getattr(config, key) for key in EXPERT_KEYS[config.model_type])
        writer.add_expert_count(count)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(size)
    if config.model_type in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_next"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if config.model_type in ("granitemoe", "granitemoeshared"):
        tensors = layouts.granite_experts(tensors, config)
    if config.model_type == "granitemoeshared":
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    if config.model_type == "ernie4_5_moe":  # the first MoE layer as the leading dense count
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
    if config.model_type in ("glm4_moe", "dots1"):  # DeepSeek-V3's experts; no groups written
        writer.add_leading_dense_block_count(config.first_k_dense_replace)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_expert_weights_norm(config.norm_topk_prob)
    if config.model_type == "glm4_moe":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if config.model_type in ("qwen2_moe", "qwen3_moe", "olmoe", "ernie4_5_moe", "glm4_moe", "dots1",
                             "qwen3_5_moe_text", "qwen3_next"):
        count = getattr(config, EXPERT_KEYS[config.model_type][0])
        tensors = layouts.merge_experts(tensors, config.num_hidden_layers, count)
    if config.model_type in ("ernie4_5_moe", "glm4_moe", "dots1"):  # as its converter renames it for the name map
        tensors = {k.replace("e_score_correction_bias", "e_score_correction.bias"): v for k, v in tensors.items()}
    if config.model_type == "lfm2_moe":  # its dense leading layers, sigmoid gating, experts merged
        writer.add_leading_dense_block_count(config.num_dense_layers)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        tensors = layouts.merge_experts(tensors, config.num_hidden_layers, config.num_experts, "feed_forward",
                                        ("w1", "w3", "w2"))
        tensors = {k.replace(".feed_forward.expert_bias", ".feed_forward.expert_bias.bias"): v
                   for k, v in tensors.items()}
    if config.model_type == "gpt_oss":
        writer.add_sliding_window(config.sliding_window)
        tensors = layouts.gpt_oss_experts(tensors, config.num_hidden_layers)
    if config.model_type == "mixtral":
        tensors = layouts.merge_experts(layouts.llama_permuted(tensors, config), config.num_hidden_layers,
                                        config.num_local_experts, "block_sparse_moe", ("w1", "w3", "w2"))
    if config.model_type == "phi3":
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            tensors["rope_factors_long.weight"] = torch.tensor(rope["long_factor"], dtype=torch.float32)
            tensors["rope_factors_short.weight"] = torch.tensor(rope["short_factor"], dtype=torch.float32)
    if config.model_type == "apertus":  # xIELU's parameters as keys, one value per layer, as its converter keeps them
        for key, add in (("alpha_p", writer.add_xielu_alpha_p), ("alpha_n", writer.add_xielu_alpha_n),
                         ("beta", writer.add_xielu_beta), ("eps", writer.add_xielu_eps)):
            add([tensors.pop(f"model.layers.{i}.mlp.act_fn.{key}").item() for i in range(layers)])
    if config.model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        tensors = layouts.qwen35(writer, tensors, config, head_dim, rope)
    if config.model_type == "qwen3_next":
        tensors = layouts.qwen35(writer, layouts.qwen3next_split(tensors, config), config, head_dim, rope, tiled=False)
    for k in range(mtp_layers):
        tensors.update(layouts.mtp_block(tensors, layers - 1, layers + k, config.hidden_size))
    assert config.vocab_size == VOCAB, "build the checkpoint with vocab_size=gguf_files.VOCAB"
    byte_tokenizer(writer, specials, **tokenizer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(arch, layers + mtp_layers)
    for hf_name, tensor in tensors.items():
        if hf_name.startswith(("rope_factors", "rope_freqs", "blk.")):  # named already (merged experts)
            gguf_name = hf_name
        else:
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, hf_name
        data = tensor.float()
        if config.model_type in ("gemma", "gemma2", "gemma3_text", "nemotron", "qwen3_5_text", "qwen3_5_moe_text",
                                 "qwen3_next") \
                and hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            data = data + 1  # the converter stores Gemma's, Nemotron's and Qwen3.5's (1 + w)
        if hf_name.endswith(".conv.conv.weight") and config.model_type in ("lfm2", "lfm2_moe"):
            data = data.squeeze(1)  # its converter keeps the taps 2-D
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.squeeze(0)  # llama.cpp reads ffn_gate_inp_shexp as [hidden]
        if gguf_name.endswith("attn_sinks"):
            gguf_name += ".weight"  # llama.cpp names the sinks as a weight
        array = data.numpy().astype(np.float32)
        kept = next((t for suffix, t in (keep or {}).items() if gguf_name.endswith(suffix)), None)
        if kept in ("F32", "F16"):
            writer.add_tensor(gguf_name, array.astype(np.float16 if kept == "F16" else np.float32))
        elif kept == "BF16":
            kind = gguf.GGMLQuantizationType.BF16
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        elif mxfp4_experts and "_exps.weight" in gguf_name:
            kind = gguf.GGMLQuantizationType.MXFP4  # as llama.cpp's converter keeps gpt-oss's experts
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        elif qtype != "F32" and array.ndim in (2, 3) and array.shape[-1] % 32 == 0:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope_scaling(writer, rope: dict, head_dim: int) -> dict[str, torch.Tensor]:
    """The rope scaling keys llama.cpp's converter writes for any architecture (linear;
    YaRN with whichever of its settings the checkpoint gives), and for Llama 3's scaling the
    tensor it writes instead: each frequency's divisor, from the checkpoint's parameters."""
    import gguf

    kind = rope.get("rope_type", "default")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "llama3":
        return {"rope_freqs.weight": llama3_divisors(rope, head_dim)}
    return {}


def llama3_divisors(rope: dict, head_dim: int) -> torch.Tensor:
    """Llama 3's rope scaling as one divisor per frequency, as llama.cpp's converter computes it."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return torch.tensor(out, dtype=torch.float32)
