"""The tensors of a transformers checkpoint as llama.cpp's converter lays them out for each
architecture, beyond renaming (tests/support/gguf_files.py writes them): the Llama
family's interleaved q/k rows, experts merged per layer (Granite MoE's and gpt-oss's split
from their stacked forms), GLM-4.5's multi-token-prediction block after the last layer,
and Qwen3.5's and Qwen3-Next's linear-attention tensors."""

from __future__ import annotations

import re

import torch


def qwen3next_split(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz (each key head's q, k, then its value heads' v and z) as its
    converter writes it: all q, all k, all v as one tensor (attn_qkv), all z as another
    (attn_gate); in_proj_ba is written as the checkpoint holds it (ssm_ba)."""
    nk, per = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    out = {}
    for name, t in tensors.items():
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = t.reshape(nk, -1, t.shape[-1]).split([dk, dk, per * dv, per * dv], dim=1)
            stem = name.removesuffix("qkvz.weight")
            out[f"{stem}qkv.weight"] = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
            out[f"{stem}z.weight"] = z.reshape(-1, t.shape[-1])
        else:
            out[name] = t
    return out


def qwen35(writer, tensors: dict[str, torch.Tensor], config, head_dim: int, rope: dict, tiled: bool = True
            ) -> dict[str, torch.Tensor]:
    """Qwen3.5's keys and tensors as llama.cpp's converter writes them: the linear layers'
    sizes under Mamba's `ssm.*` names, their flags and the attention interval, the rotary
    width and M-RoPE sections; A_log as -exp(A_log), dt_bias as the name map's dt_proj
    bias, the convolution's kernel without its channel dim, and the value heads tiled (value
    head j after key head j mod the key heads) where fewer key heads serve them."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(nk)
    writer.add_ssm_time_step_rank(nv)
    writer.add_ssm_inner_size(dv * nv)
    writer.add_full_attention_interval(4)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor",
                                                            getattr(config, "partial_rotary_factor", 1.0))))
    if tiled:  # Qwen3.5's M-RoPE sections (Qwen3-Next turns text by the plain rotary)
        writer.add_rope_dimension_sections([*rope.get("mrope_section", [11, 11, 10]), 0])
    per, qk = nv // nk, 2 * nk * dk

    def tile(t: torch.Tensor, dim: int, d: int) -> torch.Tensor:  # grouped [nk, per, d] -> [per, nk, d]
        if not tiled:
            return t
        shape = list(t.shape)
        return t.reshape(*shape[:dim], nk, per, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)

    out = {}
    for name, t in tensors.items():
        if ".linear_attn." in name:
            if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
                t = torch.cat([t[:qk], tile(t[qk:], 0, dv)])
            elif name.endswith("in_proj_z.weight"):
                t = tile(t, 0, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A_log", ".dt_bias")):
                t = tile(t, 0, 1)
            elif name.endswith("out_proj.weight"):
                t = tile(t, 1, dv)
            if name.endswith(".A_log"):
                t = -torch.exp(t)
            if name.endswith("conv1d.weight"):
                t = t.squeeze(1)
            name = name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")
        out[name] = t
    return out


def merge_experts(tensors: dict[str, torch.Tensor], layers: int, experts: int, block: str = "mlp",
                   projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                   ) -> dict[str, torch.Tensor]:
    """Each layer's per-expert gate, up and down weights stacked into one [E, out, in]
    tensor apiece: llama.cpp's blk.<i>.ffn_{gate,up,down}_exps."""
    out = {k: v for k, v in tensors.items() if f".{block}.experts." not in k}
    for i in range(layers):
        for proj, merged in zip(projections, ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")):
            names = [f"model.layers.{i}.{block}.experts.{e}.{proj}.weight" for e in range(experts)]
            if names[0] in tensors:
                out[f"blk.{i}.{merged}.weight"] = torch.stack([tensors[n] for n in names])
    return out


def granite_experts(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Granite MoE's stacked experts ([E, 2 I, hidden], gate rows then up) and its shared
    expert's fused gate/up split as its converter splits them: ffn_{gate,up,down}_exps,
    ffn_{gate,up,down}_shexp, the router as ffn_gate_inp."""
    out = {}
    inter, shared = config.intermediate_size, getattr(config, "shared_intermediate_size", 0)
    for name, t in tensors.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(.+)", name)
        if m is None:
            out[name] = t
            continue
        blk, part, rest = f"blk.{m[1]}.", m[2], m[3]
        if part == "shared_mlp":
            if rest.startswith("input_linear"):
                out[blk + "ffn_gate_shexp.weight"], out[blk + "ffn_up_shexp.weight"] = t.split(shared, dim=0)
            else:
                out[blk + "ffn_down_shexp.weight"] = t
        elif rest in ("input_linear.weight", "experts.gate_up_proj"):
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = t.split(inter, dim=1)
        elif rest in ("output_linear.weight", "experts.down_proj"):
            out[blk + "ffn_down_exps.weight"] = t
        else:  # the router
            out[blk + "ffn_gate_inp.weight"] = t
    return out


def mtp_block(tensors: dict[str, torch.Tensor], last: int, block: int, hidden: int) -> dict[str, torch.Tensor]:
    """A multi-token-prediction block as GLM-4.5's converter appends it: a decoder layer
    (here the last one's tensors again) and its nextn projections and norms."""
    out = {}
    for old, new in ((f"model.layers.{last}.", f"model.layers.{block}."), (f"blk.{last}.", f"blk.{block}.")):
        out.update({new + k[len(old):]: v.clone() for k, v in tensors.items() if k.startswith(old)})
    gen = torch.Generator().manual_seed(block)
    out[f"blk.{block}.nextn.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen)
    out[f"blk.{block}.nextn.enorm.weight"] = torch.ones(hidden)
    out[f"blk.{block}.nextn.hnorm.weight"] = torch.ones(hidden)
    return out


def gpt_oss_experts(tensors: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """gpt-oss's stacked x @ W experts, gate and up interleaved, split and transposed into
    llama.cpp's [E, out, in] ffn_{gate,up,down}_exps and their biases."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for i in range(layers):
        p = f"model.layers.{i}.mlp.experts."
        gate_up, bias = tensors[p + "gate_up_proj"].transpose(1, 2), tensors[p + "gate_up_proj_bias"]
        out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = gate_up[:, 0::2], gate_up[:, 1::2]
        out[f"blk.{i}.ffn_gate_exps.bias"], out[f"blk.{i}.ffn_up_exps.bias"] = bias[:, 0::2], bias[:, 1::2]
        out[f"blk.{i}.ffn_down_exps.weight"] = tensors[p + "down_proj"].transpose(1, 2)
        out[f"blk.{i}.ffn_down_exps.bias"] = tensors[p + "down_proj_bias"]
    return out


def llama_permuted(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """q and k (weights and biases) with each head's rotary halves interleaved, as llama.cpp's
    Llama converter stores them."""
    out = dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            n = tensor.shape[0]
            out[name] = (tensor.reshape(heads, 2, n // heads // 2, *tensor.shape[1:]).transpose(1, 2)
                         .reshape(tensor.shape))
    return out
