"""KV memory one sequence holds as it grows, with and without a sliding window.

A Mistral-shaped random model (load_format="dummy": the size of the KV, not the weights'
values, is what is measured) generates one long sequence alone; the peak of KV blocks in
use, times the bytes of a block, is what the sequence held. The same config with
`sliding_window: null` is the before. Then Gemma 3 270M's hybrid layout (15 local layers
with a 512-token window, 3 global), one block table for every layer against one per group.

    python scripts/bench_window_kv.py --window 256 --tokens 2048
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.decoder import kv_block_bytes  # noqa: E402
from beam_bench import peak_blocks  # noqa: E402  (scripts/ is on sys.path when run as a script)


def mistral_dir(window: int | None, out: Path) -> Path:
    from transformers import MistralConfig

    from model_shapes import write as write_shape  # the synthetic tokenizer; scripts/ on sys.path

    write_shape("qwen3-0.6b", out)  # a word-level tokenizer over 151,936 ids
    MistralConfig(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=window,
                  max_position_embeddings=32768, architectures=["MistralForCausalLM"]).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt + output tokens of the one sequence")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    prompt = list(range(100, 164))
    for window in (None, args.window):
        path = mistral_dir(window, Path(tempfile.mkdtemp()))
        llm = LLM(str(path), dtype="float32", load_format="dummy", block_size=args.block_size,
                  max_model_len=args.tokens + 64, enable_prefix_caching=False)
        block = kv_block_bytes(llm.engine.hf_config, args.block_size, torch.float32)
        most, _ = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=args.tokens - len(prompt),
                                                          ignore_eos=True))
        print(f"sliding_window {window}: peak {most} blocks = {most * block / 2**20:.2f} MiB for "
              f"{args.tokens} tokens ({most * block / args.tokens / 1024:.1f} KiB a token)")
        llm.shutdown()
    gemma(args.tokens, args.block_size)


def gemma(tokens: int, block_size: int) -> None:
    """Gemma 3 270M's layout (random weights): one table for all 18 layers, as before
    engine/kv_groups.py, against a table per group of 3 like layers."""
    from engine import config as engine_config, kv_groups
    from engine.models import loader, packaged

    path = loader.resolve(packaged.GEMMA3_270M_TAG).path
    prompt = list(range(1000, 1064))
    planner = engine_config.kv_groups
    for name, plan in (("one table", lambda c, h: kv_groups.single(h.num_hidden_layers)), ("per group", planner)):
        engine_config.kv_groups = plan
        try:
            llm = LLM(str(path), dtype="float32", load_format="dummy", block_size=block_size,
                      max_model_len=tokens + 64, enable_prefix_caching=False, quantization=None)
        finally:
            engine_config.kv_groups = planner
        groups = llm.engine.resolved.kv_groups
        block = kv_block_bytes(llm.engine.hf_config, block_size, torch.float32,
                               layers_per_block=groups.layers_per_block)
        most, _ = peak_blocks(llm, prompt, SamplingParams(temperature=0, max_tokens=tokens - len(prompt),
                                                          ignore_eos=True))
        print(f"gemma-3-270m, {name} ({groups.num_groups} groups of {groups.layers_per_block} layers): peak "
              f"{most} blocks = {most * block / 2**20:.2f} MiB for {tokens} tokens "
              f"({most * block / tokens / 1024:.1f} KiB a token)")
        llm.shutdown()

if __name__ == "__main__":
    main()
