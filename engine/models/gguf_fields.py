"""What every GGUF config builder reads: the fields transformers' reader gives when it is
shown a file as `llama`, the counts a config cannot do without, and the decoder's own
layer count (engine/models/gguf_llama_keyed.py, engine/models/gguf_state_keyed.py)."""

from __future__ import annotations

from typing import Any

from engine.errors import ParamError


def llama_fields(config: Any) -> dict[str, Any]:
    """What a Llama config read from a GGUF carries over to the config of the architecture
    the file really holds."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    return {k: getattr(config, k) for k in keep if hasattr(config, k)}


def need(get, key: str) -> int:
    """A count the config cannot do without: a file that lacks it (or holds no number
    there) is refused naming the key, not met by a TypeError."""
    value = get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value < 1:
        raise ParamError("model", f"the GGUF file's {key!r} is {value!r}; a positive count is needed")
    return int(value)


def main_layers(get, layers: int) -> int:
    """The decoder's own layers: GLM-4.5's converter counts its multi-token-prediction layers
    in block_count and writes them after the last one."""
    return layers - int(get("nextn_predict_layers", 0) or 0)
