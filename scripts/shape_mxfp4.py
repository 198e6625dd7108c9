"""A random-weight gpt-oss checkpoint laid out as OpenAI ships gpt-oss (experts as MXFP4
`*_blocks` / `*_scales` pairs, quantization_config `mxfp4`), for what `quantization:
mxfp4` changes against the dequantized experts: resident memory
(`bench_quant.py --rss --model DIR --modes ,mxfp4`) and batch-1 decode
(`bench_latency.py --model DIR --quantization mxfp4,mxfp4-a8 --no-hf --dtype float32`).
Nothing is downloaded.

    python scripts/shape_mxfp4.py /tmp/gpt-oss-shape

The shape is gpt-oss-20b's layer (32 experts, top 4, 64-dim heads, 8 KV heads, a 128-token
window on every other layer) narrowed to hidden 1,024 and 8 layers: 0.9B parameters,
0.8B of them in experts. Weights N(0, 0.02), norms 1; expert quants uniform over the 16
values, scales 2^-7 to 2^-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import save_tokenizer  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=32000,
             sliding_window=128, max_position_embeddings=4096)


def write(out: Path) -> Path:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    layers = SHAPE["num_hidden_layers"]
    config = AutoConfig.for_model("gpt_oss", **SHAPE, bos_token_id=1, eos_token_id=2,
                                  layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    config.architectures = ["GptOssForCausalLM"]
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith(("gate_up_proj", "down_proj")):  # [E, in, out]; MXFP4 holds [E, out, in / 32, 16]
            e, k, n = shape
            weights[f"{name}_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
            weights[f"{name}_scales"] = torch.randint(120, 123, (e, n, k // 32), generator=gen, dtype=torch.uint8)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(("bias", "sinks")):
            weights[name] = torch.zeros(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * 0.02
    save_file(weights, out / "model.safetensors")
    config.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    saved["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(saved, indent=2))
    save_tokenizer(out, SHAPE["vocab_size"])
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
