"""Random-weight GGUF files of the benchmark shapes (scripts/model_shapes.py), for batch-1
decode against llama.cpp's llama-server on the same file: written with the gguf package
as llama.cpp's converter names and lays out a Qwen3, Qwen3-MoE (experts merged per
layer), Qwen3.5 or LFM2 checkpoint, in F16, then quantized by llama.cpp's own
llama-quantize (Q4_K_M, a mix of Q4_K and Q6_K), or written as BF16 or Q8_0 directly.
Nothing is downloaded.

    python scripts/shape_gguf.py qwen3-moe-1.2b Q4_K_M /tmp/moe-q4km.gguf
    python scripts/shape_gguf.py qwen3-0.6b Q8_0 /tmp/q06-q8.gguf

The tokenizer is the tests' byte-level BPE (tests/support/gguf_files.py) padded with
user-defined tokens to the shape's vocabulary; benchmarks feed token ids. Weights are
N(0, 0.02) and norms 1, so routers spread tokens over the experts about evenly.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model_shapes import SHAPES  # noqa: E402
from tests.support.gguf_files import byte_tokenizer  # noqa: E402  (the tests' GGUF tokenizer, padded)

ROOT = Path(__file__).resolve().parent.parent
QUANTIZE = ROOT / ".peers/llama.cpp/build/bin/llama-quantize"


def write(shape: str, out: Path, qtype: str = "F16") -> Path:
    """The shape as a GGUF of qtype F16, BF16, F32 or Q8_0 (the ones the gguf package writes)."""
    import gguf

    s = dict(SHAPES[shape])
    moe = s.get("model_type") == "qwen3_moe"
    hybrid = s.get("model_type") == "qwen3_5_text"
    if s.get("model_type") == "lfm2":
        return _write_lfm2(s, out, qtype)
    arch = gguf.MODEL_ARCH.QWEN3MOE if moe else gguf.MODEL_ARCH.QWEN35 if hybrid else gguf.MODEL_ARCH.QWEN3
    h, layers, heads, kv, d = (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"],
                               s["num_key_value_heads"], s["head_dim"])
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(40960)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(s["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(s["rope_parameters"]["rope_theta"] if hybrid else 1000000.0)
    writer.add_vocab_size(s["vocab_size"])
    if hybrid:  # Qwen3.5's keys as its converter writes them (the linear layers' under Mamba's ssm.* names)
        writer.add_rope_dimension_count(int(d * s["rope_parameters"]["partial_rotary_factor"]))
        writer.add_rope_dimension_sections([11, 11, 10, 0])
        writer.add_ssm_conv_kernel(s["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(s["linear_key_head_dim"])
        writer.add_ssm_group_count(s["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(s["linear_num_value_heads"])
        writer.add_ssm_inner_size(s["linear_value_head_dim"] * s["linear_num_value_heads"])
        writer.add_full_attention_interval(len(s["layer_types"]))
    if moe:
        writer.add_expert_count(s["num_experts"])
        writer.add_expert_used_count(s["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(s["moe_intermediate_size"])
    byte_tokenizer(writer, vocab=s["vocab_size"])
    rng = np.random.default_rng(0)
    add = _adder(writer, qtype, rng)

    v = s["vocab_size"]
    add("token_embd.weight", (v, h))
    add("output_norm.weight", (h,), norm=True)
    if not s.get("tie_word_embeddings", False):
        add("output.weight", (v, h))
    for i in range(layers):
        p = f"blk.{i}."
        if hybrid and s["layer_types"][i % len(s["layer_types"])] == "linear_attention":
            _linear_layer(s, p, add, writer, rng)
            continue
        for name, shape in (("attn_norm", (h,)), ("ffn_norm", (h,)), ("attn_q_norm", (d,)), ("attn_k_norm", (d,))):
            add(p + ("post_attention_norm" if hybrid and name == "ffn_norm" else name) + ".weight", shape, norm=True)
        add(p + "attn_q.weight", (heads * d * (2 if hybrid else 1), h))  # Qwen3.5's: each head's query and gate
        add(p + "attn_k.weight", (kv * d, h))
        add(p + "attn_v.weight", (kv * d, h))
        add(p + "attn_output.weight", (h, heads * d))
        if moe:
            e, inter = s["num_experts"], s["moe_intermediate_size"]
            add(p + "ffn_gate_inp.weight", (e, h))
            add(p + "ffn_gate_exps.weight", (e, inter, h))
            add(p + "ffn_up_exps.weight", (e, inter, h))
            add(p + "ffn_down_exps.weight", (e, h, inter))
        else:
            inter = s["intermediate_size"]
            add(p + "ffn_gate.weight", (inter, h))
            add(p + "ffn_up.weight", (inter, h))
            add(p + "ffn_down.weight", (h, inter))
    return _close(writer, out)


def _adder(writer, qtype: str, rng: np.random.Generator):
    """add(name, shape): a tensor of N(0, 0.02) in `qtype` (ones with `norm`; fp32 when
    `dense` or 1-D, as the converter keeps norms, biases and convolution taps)."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, qtype)

    def add(name: str, shape: tuple[int, ...], norm: bool = False, dense: bool = False) -> None:
        if norm:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        data = rng.standard_normal(shape, dtype=np.float32) * 0.02
        if dense or len(shape) == 1:
            writer.add_tensor(name, data)
        elif qtype in ("Q8_0", "BF16"):
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, data.astype(np.float16 if qtype == "F16" else np.float32))

    return add


def _close(writer, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_lfm2(s: dict, out: Path, qtype: str) -> Path:
    """The LFM2 shape as llama.cpp's converter writes it: a KV head count per layer (0 for a
    convolution), the taps, the MLP size it derives; each convolution's in_proj (B, C, x),
    taps (2-D, fp32) and out_proj; the final norm as token_embd_norm."""
    import gguf

    h, layers, heads, kv = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"]
    d = h // heads
    inter = int(2 * s["intermediate_size"] / 3)
    inter = s["block_multiple_of"] * -(-int(s["block_ffn_dim_multiplier"] * inter) // s["block_multiple_of"])
    writer = gguf.GGUFWriter(out, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LFM2])
    writer.add_context_length(40960)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv([0 if t == "conv" else kv for t in s["layer_types"]])
    writer.add_shortconv_l_cache(s["conv_L_cache"])
    writer.add_layer_norm_rms_eps(s["norm_eps"])
    writer.add_rope_freq_base(1000000.0)
    writer.add_vocab_size(s["vocab_size"])
    byte_tokenizer(writer, vocab=s["vocab_size"])
    add = _adder(writer, qtype, np.random.default_rng(0))

    add("token_embd.weight", (s["vocab_size"], h))
    add("token_embd_norm.weight", (h,), norm=True)
    for i, kind_of in enumerate(s["layer_types"]):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (h,), norm=True)
        add(p + "ffn_norm.weight", (h,), norm=True)
        if kind_of == "conv":
            add(p + "shortconv.in_proj.weight", (3 * h, h))
            add(p + "shortconv.conv.weight", (h, s["conv_L_cache"]), dense=True)
            add(p + "shortconv.out_proj.weight", (h, h))
        else:
            add(p + "attn_q.weight", (heads * d, h))
            add(p + "attn_k.weight", (kv * d, h))
            add(p + "attn_v.weight", (kv * d, h))
            add(p + "attn_output.weight", (h, heads * d))
            add(p + "attn_q_norm.weight", (d,), norm=True)
            add(p + "attn_k_norm.weight", (d,), norm=True)
        add(p + "ffn_gate.weight", (inter, h))
        add(p + "ffn_up.weight", (inter, h))
        add(p + "ffn_down.weight", (h, inter))
    return _close(writer, out)


def _linear_layer(s: dict, p: str, add, writer, rng: np.random.Generator) -> None:
    """A Qwen3.5 linear-attention layer's tensors (value heads as many as key heads at the
    benchmark shape, so the converter's tiling is the identity): norms 1 (its (1 + w) of w
    = 0; the gated norm's plain 1), each head's decay -exp(A_log) with A in [0.01, 16] as
    transformers initialises it, the convolution's kernel without its channel dim, in fp32."""
    h = s["hidden_size"]
    nk, nv, dk, dv = (s["linear_num_key_heads"], s["linear_num_value_heads"], s["linear_key_head_dim"],
                      s["linear_value_head_dim"])
    conv = 2 * nk * dk + nv * dv
    add(p + "attn_norm.weight", (h,), norm=True)
    add(p + "post_attention_norm.weight", (h,), norm=True)
    add(p + "ssm_norm.weight", (dv,), norm=True)
    add(p + "ssm_dt.bias", (nv,), norm=True)
    writer.add_tensor(p + "ssm_a", -rng.uniform(0.01, 16, nv).astype(np.float32))
    add(p + "ssm_conv1d.weight", (conv, s["linear_conv_kernel_dim"]), dense=True)  # ggml's ssm_conv reads fp32 only
    add(p + "attn_qkv.weight", (conv, h))
    add(p + "attn_gate.weight", (nv * dv, h))
    add(p + "ssm_beta.weight", (nv, h))
    add(p + "ssm_alpha.weight", (nv, h))
    add(p + "ssm_out.weight", (h, nv * dv))
    inter = s["intermediate_size"]
    add(p + "ffn_gate.weight", (inter, h))
    add(p + "ffn_up.weight", (inter, h))
    add(p + "ffn_down.weight", (h, inter))


def main(shape: str, qtype: str, out: Path) -> Path:
    if qtype in ("F16", "BF16", "F32", "Q8_0"):
        return write(shape, out, qtype)
    if not QUANTIZE.is_file():
        raise SystemExit("llama-quantize missing: cmake --build .peers/llama.cpp/build --target llama-quantize "
                         "(after scripts/peers/setup_llama_server.sh)")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        f16 = write(shape, Path(tmp) / "f16.gguf", "F16")
        subprocess.run([str(QUANTIZE), str(f16), str(out), qtype], check=True, stdout=subprocess.DEVNULL)
    return out


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2], Path(sys.argv[3])))
