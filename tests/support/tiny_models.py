"""Tiny random Llama checkpoints in HF format, built offline with transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

def build_tiny_model(path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama in HF format, made offline from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        src = tokenizer_dir / name
        if src.is_file():
            shutil.copy(src, path / name)
    return path
