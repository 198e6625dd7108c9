"""Config directories of realistic model shapes, for benchmarks on random weights
(`load_format="dummy"` in our engine and in vLLM): nothing is downloaded, and both engines
build the same architecture at the same size.

The tokenizer is a synthetic word-level one covering the whole vocabulary, so that every
id a random-weight model samples decodes; the benchmarks feed token ids, never text.
"""

from __future__ import annotations

import json
from pathlib import Path

# The published configs' sizes (Qwen3-0.6B and Qwen3-1.7B: tied embeddings, head_dim 128).
SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # A small Qwen3-MoE (Qwen3-30B-A3B's layer, narrower): 1.2B parameters, 0.5B active per token.
    "qwen3-moe-1.2b": dict(model_type="qwen3_moe", hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                           tie_word_embeddings=False, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                           norm_topk_prob=True),
    # Qwen3.5-0.8B's text model as published (24 layers, hidden 1024, 8 query and 2 KV heads
    # of 256, a quarter of each turned; three Gated DeltaNet layers of 16 heads of 128 to
    # every attention layer; 248,320 tokens, tied).
    "qwen3.5-0.8b": dict(model_type="qwen3_5_text", hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, vocab_size=248320,
                         tie_word_embeddings=True, layer_types=["linear_attention"] * 3 + ["full_attention"],
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                          "partial_rotary_factor": 0.25}),
    # LFM2-1.2B's sizes as published (16 layers, hidden 2048, attention at layers 2, 5, 8,
    # 10, 12 and 14 with 32 query and 8 KV heads of 64, short convolutions of 3 taps on the
    # other ten; the MLP 12,288 wide before LFM2 derives its 8,192; 65,536 tokens, tied).
    "lfm2-1.2b": dict(model_type="lfm2", hidden_size=2048, intermediate_size=12288, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=65536, tie_word_embeddings=True,
                      layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
                      conv_L_cache=3, block_auto_adjust_ff_dim=True, block_multiple_of=256,
                      block_ffn_dim_multiplier=1.0, norm_eps=1e-5,
                      block_dim=2048, conv_dim=2048, block_ff_dim=12288),  # the published config's, which vLLM reads
}

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "lfm2": "Lfm2ForCausalLM"}


def write(shape: str, out: Path) -> Path:
    from transformers import AutoConfig

    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(SHAPES[shape])
    model_type = sizes.pop("model_type", "qwen3")
    if "layer_types" in sizes:  # a pattern, repeated over the layers
        pattern = sizes["layer_types"]
        sizes["layer_types"] = [pattern[i % len(pattern)] for i in range(sizes["num_hidden_layers"])]
    if "rope_parameters" not in sizes:
        sizes["rope_theta"] = 1000000.0
    if model_type != "lfm2":  # LFM2 names its epsilon norm_eps
        sizes["rms_norm_eps"] = 1e-6
    config = AutoConfig.for_model(model_type, **sizes, max_position_embeddings=40960, bos_token_id=1, eos_token_id=2,
                                  torch_dtype="bfloat16")
    config.architectures = [ARCHITECTURES[model_type]]
    config.save_pretrained(out)
    save_tokenizer(out, sizes["vocab_size"])
    (out / "shape.json").write_text(json.dumps({"shape": shape, **SHAPES[shape]}))
    return out


def save_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens t0, t1, ...: benchmarks feed token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(out)


if __name__ == "__main__":
    import sys

    print(write(sys.argv[1], Path(sys.argv[2])))
