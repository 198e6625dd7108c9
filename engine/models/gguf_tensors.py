"""A GGUF file's tensors under a checkpoint's HF names, for the architectures whose files
transformers' GGUF reader does not convert: gpt-oss (experts in MXFP4, biases, attention
sinks), Mixtral (which llama.cpp files as `llama` with each layer's experts merged), and
those whose tensors llama.cpp's converter only renames (gguf_llama_keyed.renamed: Gemma,
Nemotron, OLMoE, StableLM, OLMo 2 and 3, EXAONE 4, ERNIE 4.5 and its MoE, GLM-4, GLM-4.5,
dots.llm1, Command R and R7B, StarCoder2, Apertus, HunYuan), but for Gemma's and Nemotron's
norms, stored as 1 + w, the MoE families' experts, merged per layer, and GLM-4.5's
multi-token-prediction layer, left out (`convert_named`).

Each tensor is dequantized by the gguf package (MXFP4 included) and renamed as
llama.cpp's converter named it; the experts come out stacked per layer in the layout the
loader reads for that architecture (engine/models/weights.py): gpt-oss's [E, hidden,
2 I] with gate and up interleaved, Mixtral's Linear-shaped [E, 2 I, hidden]."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models import mxfp4

# Per-layer tensors renamed one for one: GGUF name -> HF name under model.layers.<i>.
GPT_OSS_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
MIXTRAL_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
GGUF_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}
# Granite MoE's: Mixtral's tensors, and a shared expert where GraniteMoeShared has one.
GRANITEMOE_LAYER = {**MIXTRAL_LAYER, "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
LAYER_NAMES = {"gpt_oss": GPT_OSS_LAYER, "mixtral": MIXTRAL_LAYER, "granitemoe": GRANITEMOE_LAYER,
               "granitemoeshared": GRANITEMOE_LAYER}
OWN = tuple(LAYER_NAMES)  # the model types this module converts by its own tables
# The model types whose q and k rows llama.cpp's converter interleaves (its Llama family,
# Mixtral filed as `llama` among them): unpermuted here and on the blocks (gguf_blocks).
PERMUTED = frozenset({"llama", "mistral", "granite", "mixtral", "smollm3", "arcee", "ministral3", "granitemoe",
                      "granitemoeshared"})
# What the converter added to a norm's weight: Gemma's and Nemotron's (1 + w) are stored whole.
NORM_ADDED = {"gemma": 1.0, "nemotron": 1.0}


def handles(config: Any) -> bool:
    return config.model_type in OWN


def convert_named(path: Path, arch: str, config: Any, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Every tensor of a file llama.cpp converted by renaming alone, under the HF name its
    converter took it from: the checkpoint's names come from transformers' model for the
    config, and gguf's name map for `arch` (the one the converter used) names each in the
    file. A tensor of the file that no parameter maps to is a ValueError naming it."""
    import gguf
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], config.num_hidden_layers)
    theirs: dict[str, str] = {}
    for hf_name in skeleton.state_dict():
        gguf_name = names.get_name(_as_converted(hf_name), try_suffixes=(".weight", ".bias"))  # the suffix kept
        if gguf_name is not None:
            theirs.setdefault(gguf_name, hf_name)
        if hf_name.endswith(".linear_attn.in_proj_qkvz.weight"):  # Qwen3-Next's, split by its converter
            blk, stem = gguf_name.removesuffix("ssm_in.weight"), hf_name.removesuffix("qkvz.weight")
            theirs[f"{blk}attn_qkv.weight"], theirs[f"{blk}attn_gate.weight"] = f"{stem}qkv.weight", f"{stem}z.weight"
    reader = gguf.GGUFReader(path)
    out: dict[str, torch.Tensor] = _xielu(reader, config) if config.model_type == "apertus" else {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    mtp = range(config.num_hidden_layers, config.num_hidden_layers + (int(nextn.contents()) if nextn else 0))
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" or not keep(t.name):  # the divisors are in the config's rope scaling
            continue
        block = re.match(r"blk\.(\d+)\.", t.name)
        if block is not None and int(block[1]) in mtp:
            continue  # a multi-token-prediction layer after the decoder's own (GLM-4.5's; gguf_llama_keyed.main_layers)
        merged = re.fullmatch(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps\.weight)", t.name)
        if t.name not in theirs and merged is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} for {config.model_type}")
        data = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if merged is not None:  # a layer's experts, merged as Qwen's and Mixtral's (OLMoE)
            experts[int(merged[1]), merged[2]] = data
            continue
        if theirs[t.name].endswith("shared_expert_gate.weight") and data.dim() == 1:
            data = data[None]  # llama.cpp keeps a shared expert's gate as [hidden]; its Linear is [1, hidden]
        if config.model_type in LINEAR_ATTENTION:
            data = _linear_attention(config, theirs[t.name], data)
        elif theirs[t.name].endswith(".conv.conv.weight"):
            data = data[:, None, :]  # LFM2's taps: the converter dropped the channel dim
        elif theirs[t.name].endswith("norm.weight") and config.model_type in NORM_ADDED:
            data -= NORM_ADDED[config.model_type]
        out[theirs[t.name]] = data
    for i in sorted({i for i, _ in experts}):
        out.update(_experts(config, i, experts, True))
    return out


# The model types with Qwen3.5's linear-attention layers, whose tensors the converter
# transforms beyond renaming (`_linear_attention` undoes it); Qwen3.5's files also tile the
# value heads, Qwen3-Next's keep the checkpoint's order.
LINEAR_ATTENTION = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
TILED = ("qwen3_5_text", "qwen3_5_moe_text")


def _linear_attention(config: Any, name: str, data: torch.Tensor) -> torch.Tensor:
    """A Qwen3.5 tensor as its checkpoint holds it, from what llama.cpp's converter wrote:
    the norms less the 1 it added (all but the linear layers' gated norm, whose weight is
    plain), A_log from the -exp(A_log) it stored, the convolution's kernel with its channel
    dim back, and the value heads back in the checkpoint's order, grouped by the key head
    they share, where the converter tiled them (value head j after key head j mod the key
    head count) for ggml's broadcast."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data - 1.0
    if ".linear_attn." not in name:
        return data
    if name.endswith(".A_log"):
        data = torch.log(-data)
    if config.model_type not in TILED:
        return data.unsqueeze(1) if name.endswith("conv1d.weight") else data
    qk, dv = 2 * config.linear_num_key_heads * config.linear_key_head_dim, config.linear_value_head_dim
    heads = config.linear_num_key_heads, config.linear_num_value_heads
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q and k rows as they were; v's grouped
        data = torch.cat([data[:qk], data[qk:][grouped_order(*heads, dv)]])
    elif name.endswith("in_proj_z.weight"):
        data = data[grouped_order(*heads, dv)]
    elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
        data = data[grouped_order(*heads, 1)]
    elif name.endswith("out_proj.weight"):
        data = data[:, grouped_order(*heads, dv)]
    return data.unsqueeze(1) if name.endswith("conv1d.weight") else data


def grouped_order(key_heads: int, value_heads: int, size: int) -> torch.Tensor:
    """Where each of the checkpoint's value-head rows (grouped: the heads that share key
    head h together) sits in llama.cpp's tiled order (value head j after key head j mod
    the key heads), `size` rows a head: the checkpoint's rows are file[order]."""
    per = value_heads // key_heads
    return torch.arange(value_heads * size).view(per, key_heads, size).transpose(0, 1).reshape(-1)


# transformers' module tree against the checkpoint names llama.cpp's converter read: ERNIE 4.5
# MoE's correction bias sits beside its router in a checkpoint, every DeepSeek-style
# `e_score_correction_bias` goes to the converter's name map as `e_score_correction.bias`,
# and LFM2-MoE's `expert_bias` as `expert_bias.bias`.
CONVERTED_AS = ((".mlp.gate.moe_statics.", ".mlp.moe_statics."), ("e_score_correction_bias", "e_score_correction.bias"),
                (".linear_attn.dt_bias", ".linear_attn.dt_proj.bias"),
                (".feed_forward.expert_bias", ".feed_forward.expert_bias.bias"))


def _as_converted(hf_name: str) -> str:
    for ours, theirs in CONVERTED_AS:
        hf_name = hf_name.replace(ours, theirs)
    return hf_name


def _xielu(reader: Any, config: Any) -> dict[str, torch.Tensor]:
    """Apertus's xIELU parameters, which llama.cpp's converter keeps as keys (one value per
    layer under `xielu.*`), as the checkpoint's per-layer tensors."""
    out = {}
    for key, shape in (("alpha_p", (1,)), ("alpha_n", (1,)), ("beta", ()), ("eps", ())):
        field = reader.fields.get(f"xielu.{key}")
        if field is None:
            raise ValueError(f"the apertus GGUF file has no key 'xielu.{key}'")
        values = [float(v) for v in field.contents()]
        if len(values) != config.num_hidden_layers:
            raise ValueError(f"xielu.{key} has {len(values)} values for {config.num_hidden_layers} layers")
        for i, value in enumerate(values):
            out[f"model.layers.{i}.mlp.act_fn.{key}"] = torch.tensor(value, dtype=torch.float32).reshape(shape)
    return out


def convert(path: Path, config: Any, keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """Every tensor of the file that `keep` takes by its GGUF name, dequantized to fp32
    under its HF name; a ValueError naming a tensor this architecture does not have, or
    MXFP4 blocks out of range."""
    import gguf

    layer_names = LAYER_NAMES[config.model_type]
    reader = gguf.GGUFReader(path)
    out: dict[str, torch.Tensor] = _xielu(reader, config) if config.model_type == "apertus" else {}
    experts: dict[tuple[int, str], torch.Tensor] = {}
    for t in reader.tensors:
        if not keep(t.name):
            continue
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:  # a NaN scale would dequantize silently
            mxfp4.check_gguf_blocks(torch.from_numpy(np.array(t.data, dtype=np.uint8)), t.name)
        data = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        if t.name in GLOBAL:
            out[GLOBAL[t.name]] = data
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m is None:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} for {config.model_type}")
        i, rest = int(m[1]), m[2]
        if rest.startswith(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")) and rest not in layer_names:
            experts[i, rest] = data
        elif rest in layer_names:
            if config.model_type in PERMUTED and rest in ("attn_q.weight", "attn_k.weight"):
                heads = config.num_attention_heads if rest == "attn_q.weight" else config.num_key_value_heads
                data = unpermute(data, heads)
            out[f"model.layers.{i}.{layer_names[rest]}"] = data
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r} for {config.model_type}")
    weights = keep(f"blk.0.{GGUF_EXPERTS[0]}.weight")  # False where the experts stay on their blocks
    for i in range(config.num_hidden_layers):
        out.update(_experts(config, i, experts, weights))
    return out


def _experts(config: Any, i: int, experts: dict[tuple[int, str], torch.Tensor], weights: bool
             ) -> dict[str, torch.Tensor]:
    """Layer i's merged experts ([E, out, in] each, as llama.cpp stores them) in the stacked
    layout the loader reads for the architecture; only gpt-oss's biases without `weights`."""
    def take(name: str) -> torch.Tensor:
        if (i, name) not in experts:
            raise ValueError(f"the GGUF file has no tensor 'blk.{i}.{name}'")
        return experts.pop((i, name))

    prefix = f"model.layers.{i}.mlp.experts."
    out = {}
    if weights:
        gate, up, down = (take(f"{name}.weight") for name in GGUF_EXPERTS)
        if config.model_type != "gpt_oss":  # transformers 5's stacked Linear layout (Mixtral, OLMoE)
            return {prefix + "gate_up_proj": torch.cat((gate, up), dim=1), prefix + "down_proj": down}
        # gpt-oss: x @ W with gate and up interleaved column by column, and their biases likewise
        out = {prefix + "gate_up_proj": torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2).contiguous(),
               prefix + "down_proj": down.transpose(1, 2).contiguous()}
    if config.model_type == "gpt_oss":
        gate_b, up_b = take("ffn_gate_exps.bias"), take("ffn_up_exps.bias")
        out[prefix + "gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=2).flatten(1, 2)
    return out


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves in a Llama-family q and
    k; transformers' reader undoes it. The same row order back (any trailing shape)."""
    return rows[unpermuted_order(rows.shape[0], heads)]


def unpermuted_order(n: int, heads: int) -> torch.Tensor:
    """The row index that undoes the converter's interleaving of `n` rows of `heads` heads."""
    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
