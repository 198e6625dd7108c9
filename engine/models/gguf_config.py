"""What a GGUF file says about its architecture that transformers' GGUF config reader
drops, put back: head sizes, sliding windows, Gemma 2's soft-caps, Gemma's query scale, Phi-3's
partial rotary and LongRoPE factors, rope scaling, the experts' sizes and routing; and the
tokens that end a turn.

transformers maps only a fixed list of `<arch>.*` keys into the config (its
GGUF_CONFIG_MAPPING); the rest would silently fall back to its config defaults, and a
model whose window or soft-cap is a default rather than its own gives other tokens. The
keys read here are the ones llama.cpp's converter writes for these architectures.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ParamError
from engine.models import gguf_llama_keyed
from engine.models.layers import rotary

# Gemma 2 27B (46 layers) and Gemma 3 27B (62) scale queries by hidden / heads rather than
# by head_dim; llama.cpp tells them apart by their layer count the same way.
_GEMMA_HIDDEN_SCALED = {("gemma2", 46), ("gemma3", 62)}


_SWAP_LOCK = threading.Lock()


@functools.cache
def _reader_class() -> type:
    """gguf's reader over a plain ndarray view of its mapping, not the np.memmap itself:
    the parse slices the file once per part of every field, and each slice of a memmap
    pays numpy's memmap bookkeeping; Gemma 3's 262k-token vocabulary took 9.3 s to parse
    that way on 2 cores, 3.0 s this way (the tensors' bytes are the same mapping)."""
    from gguf.gguf_reader import GGUFReader  # the class itself: parsed_once swaps the package's name

    class Reader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._array

        @data.setter
        def data(self, value: Any) -> None:
            self._array = np.asarray(value)

    return Reader


def open_reader(path: Any, mode: str = "r") -> Any:
    return _reader_class()(path, mode)


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name map built
    once per architecture. A conversion reads the header five times (transformers for the
    config, the tokenizer and the weights; this module twice), and a 49k-token vocabulary
    takes about 5 s to parse on 2 cores; transformers also rebuilt the name map for every
    module (7 s). transformers imports both from `gguf` at call time, so they are swapped
    there, for this block only; one block at a time in a process, so that two threads
    never restore each other's swap."""
    import gguf

    with _SWAP_LOCK:
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], Any] = {}

        def reader(path: Any, mode: str = "r") -> Any:
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = _as_llama(_hide_misread(open_reader(path, mode)))
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


# Keys transformers' GGUF reader misreads: for gpt-oss it takes a rope scaling field's first
# part (the key's length) as its value and fails on every file llama.cpp writes. Within
# parsed_once they are read here and hidden from it.
# LFM2's and LFM2-MoE's head_count_kv: a count per layer, 0 for a convolution.
MISREAD = ("gpt-oss.rope.scaling.", "lfm2.attention.head_count_kv", "lfm2moe.attention.head_count_kv")


def _hide_misread(reader: Any) -> Any:
    reader.hidden_fields = {k: reader.fields[k].contents() for k in list(reader.fields) if k.startswith(MISREAD)}
    for k in reader.hidden_fields:
        del reader.fields[k]
    return reader


# Architectures whose keys llama.cpp writes as Llama's under their own name, with a few of
# their own that `restore` reads. transformers' reader knows none of them: within
# parsed_once it is shown them as `llama` (Gemma's as `gemma2`, whose SentencePiece
# tokenizer it builds the same way), for the config's common fields and the tokenizer.
# Their tensors: gguf_llama_keyed.renamed.
AS_LLAMA = tuple(gguf_llama_keyed.BUILDERS)
SHOWN_AS = {"gemma": "gemma2"}  # the rest as `llama`


def _as_llama(reader: Any) -> Any:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else ""
    if arch not in AS_LLAMA:
        return reader
    reader.true_arch = arch
    shown = SHOWN_AS.get(arch, "llama")
    for key in [k for k in reader.fields if k.startswith(arch + ".")]:
        reader.fields[shown + key[len(arch):]] = reader.fields[key]
    parts, at = list(field.parts), field.data[0]
    parts[at - 1], parts[at] = np.array([len(shown)], dtype=np.uint64), np.frombuffer(shown.encode(), dtype=np.uint8)
    reader.fields["general.architecture"] = field._replace(parts=parts)
    return reader


def file_arch(path: Path) -> str:
    """The architecture the file names (`general.architecture`), as llama.cpp wrote it."""
    return _fields(path)[0]


def _fields(path: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    import gguf

    reader = gguf.GGUFReader(path)  # parsed_once's, inside a conversion
    fields = {k: f.contents() for k, f in reader.fields.items()
              if not k.startswith("tokenizer.") or k == "tokenizer.ggml.padding_token_id"}
    fields.update(getattr(reader, "hidden_fields", {}))
    tensors = {t.name: t for t in reader.tensors}
    arch = getattr(reader, "true_arch", None) or str(fields.get("general.architecture", ""))
    return arch, fields, tensors


# Tokens that end an assistant turn in the chat formats of the served families. An HF
# checkpoint lists its own in generation_config.json; a GGUF names only its eos (and at times
# an eot or eom), so llama.cpp also stops on these when the vocabulary has them; here, when
# the file's chat template writes them.
TURN_ENDS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|end_of_text|>",
             "<|endoftext|>")


def stop_token_ids(path: Path, tokenizer: Any) -> list[int]:
    """Every token a generation from this file ends on: eos, eot, eom and the turn ends
    its chat template writes, for the generation_config.json the converted model gets."""
    import gguf

    reader = gguf.GGUFReader(path)
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = reader.fields.get(key)
        if f is not None and int(f.contents()) not in ids:
            ids.append(int(f.contents()))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    vocab = tokenizer.get_vocab()
    for text in TURN_ENDS:
        if text in template and text in vocab and vocab[text] not in ids:
            ids.append(vocab[text])
    return ids


def restore(config: Any, path: Path) -> Any:
    """`config` (from transformers' GGUF reader) with the file's own settings back in place."""
    arch, kv, tensors = _fields(path)
    get = lambda key, default=None: kv.get(f"{arch}.{key}", default)  # noqa: E731
    pad = getattr(config, "pad_token_id", None)
    if pad is not None and pad >= config.vocab_size:  # a class default past this file's vocabulary (Phi-3)
        config.pad_token_id = kv.get("tokenizer.ggml.padding_token_id")
    key_length = get("attention.key_length")
    if key_length and hasattr(config, "head_dim"):  # Qwen3's is not hidden / heads, nor transformers' default
        config.head_dim = int(key_length)
    elif arch in AS_LLAMA:  # the reader took Llama's rope.dimension_count for it: a partial rotary's width
        config.head_dim = config.hidden_size // config.num_attention_heads
    window = get("attention.sliding_window")
    if arch in ("gemma2", "gemma3", "phi3", "mistral", "qwen2", "qwen3") and window:
        config.sliding_window = int(window)
    if arch in ("gemma2", "gemma3"):
        layers = int(get("block_count"))
        if (arch, layers) in _GEMMA_HIDDEN_SCALED:
            config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
        else:
            config.query_pre_attn_scalar = int(get("attention.key_length", config.head_dim))
    if arch == "gemma2":
        config.attn_logit_softcapping = get("attn_logit_softcapping", config.attn_logit_softcapping)
        config.final_logit_softcapping = get("final_logit_softcapping", config.final_logit_softcapping)
    if arch not in ("phi3", "gpt-oss"):  # each with its own below
        _rope_scaling(config, arch, get, tensors)
    if arch == "phi3":
        _phi3(config, get, tensors)
    if arch == "gpt-oss":
        _gpt_oss(config, get)
    if arch == "llama" and get("expert_count"):
        return gguf_llama_keyed.mixtral(config, get)
    if arch in gguf_llama_keyed.BUILDERS:
        gguf_llama_keyed.partial_rotary(config, get)
        return gguf_llama_keyed.BUILDERS[arch](config, get, tensors)
    if arch in ("qwen2moe", "qwen3moe"):
        # llama.cpp builds every layer as experts, renormalising the top-k for Qwen3-MoE only.
        config.moe_intermediate_size = int(get("expert_feed_forward_length"))
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
        config.norm_topk_prob = arch == "qwen3moe"
        if arch == "qwen2moe":
            config.shared_expert_intermediate_size = int(get("expert_shared_feed_forward_length"))
    return config


def _rope_scaling(config: Any, arch: str, get, tensors: dict[str, Any]) -> None:
    """The rope scaling llama.cpp's converter writes for every architecture: linear and YaRN
    as `rope.scaling.*` keys, Llama 3's as a tensor of per-frequency divisors
    (`rope_freqs.weight`). transformers' reader drops all three, and a Llama 3.1 or 3.2
    file, a Qwen file extended with YaRN, would then turn every position as the unscaled
    model does. A scaling this cannot express is refused, never served unscaled."""
    kind = get("rope.scaling.type")
    kind = None if kind in (None, "none") else str(kind)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    # Gemma 3 scales its global layers only; its local ones keep their own base.
    params = rope["full_attention"] if "full_attention" in rope else rope
    if "rope_freqs.weight" in tensors:
        if kind is not None:
            raise ParamError("model", f"the GGUF file has both rope scaling {kind!r} and rope_freqs.weight")
        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float64)
        params.update(_llama3(factors, float(params.get("rope_theta", 10000.0)), rotary.head_dim(config)))
    elif kind == "linear":
        params.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=float(get("rope.scaling.factor")),
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
        # Written only where the checkpoint set them; transformers' defaults otherwise.
        for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                          ("yarn_beta_slow", "beta_slow")):
            if get(f"rope.scaling.{key}") is not None:
                params[name] = float(get(f"rope.scaling.{key}"))
        # OLMo 3's converter writes the checkpoint's attention_factor under the older key.
        if "attention_factor" not in params and get("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(get("rope.scaling.attn_factor"))
    elif kind is not None:
        raise ParamError("model", f"{arch} GGUF: rope scaling {kind!r} is not supported here "
                                  "(linear, yarn, or Llama 3's rope_freqs.weight)")
    config.rope_parameters = rope


def _llama3(factors: np.ndarray, theta: float, dim: int) -> dict[str, Any]:
    """Llama 3's rope parameters from the divisors llama.cpp stores per frequency: 1 above
    the high-frequency cut, `factor` below the low one, 1 / ((1 - s) / factor + s) between,
    where s = (original / wavelength - low) / (high - low). s is linear in 1 / wavelength,
    so the smoothed divisors give original / (high - low) and low / (high - low); only
    those ratios enter the frequencies, so low is taken as 1. The parameters found must
    give back every divisor, or the file is refused."""
    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factors.shape != wavelength.shape:
        raise ParamError("model", f"rope_freqs.weight has {factors.size} factors; head_dim {dim} has "
                                  f"{wavelength.size} frequencies")
    factor = float(factors.max())
    if factor < 1:
        raise ParamError("model", f"rope_freqs.weight divides frequencies by {factor} at most: Llama 3's "
                                  "rope scaling only lowers them")
    candidates = [(8192.0, 1.0, 4.0)]  # Llama 3.1's and 3.2's own
    between = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    if between.sum() >= 2:
        s = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelength[between], s, 1)
        if intercept < 0:  # the fit, then the same rounded as a config writes them
            original, high = float(-slope / intercept), float(1 - 1 / intercept)
            candidates[:0] = [(float(round(original)), 1.0, round(high, 4)), (original, 1.0, high)]
    for original, low, high in candidates:
        s = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
        want = np.where(wavelength < original / high, 1.0,
                        np.where(wavelength > original / low, factor, 1 / ((1 - s) / factor + s)))
        if np.allclose(want, factors, rtol=1e-5, atol=0):
            return dict(rope_type="llama3", factor=factor, low_freq_factor=low, high_freq_factor=high,
                        original_max_position_embeddings=int(original) if original.is_integer() else original)
    raise ParamError("model", "rope_freqs.weight is not Llama 3's rope scaling: no factor, original context and "
                              "frequency cuts give back its divisors")


def _phi3(config: Any, get, tensors: dict[str, Any]) -> None:
    head_dim = config.hidden_size // config.num_attention_heads
    turned = get("rope.dimension_count")
    params = dict(config.rope_parameters or {})
    if turned and int(turned) != head_dim:
        params["partial_rotary_factor"] = int(turned) / head_dim
    if not get("attention.sliding_window"):
        config.sliding_window = None  # the converter writes 0 for none
    if "rope_factors_long.weight" in tensors:
        params.update(
            rope_type="longrope",
            long_factor=np.asarray(tensors["rope_factors_long.weight"].data, dtype=np.float32).tolist(),
            short_factor=np.asarray(tensors["rope_factors_short.weight"].data, dtype=np.float32).tolist(),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")))
        if get("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(get("rope.scaling.attn_factor"))
        config.original_max_position_embeddings = params["original_max_position_embeddings"]
    config.rope_parameters = params


def _gpt_oss(config: Any, get) -> None:
    """Its expert size, window and alternating layers (llama.cpp's pattern: every other
    layer windowed, the first one included) and YaRN, whose `truncate: false` every gpt-oss
    checkpoint sets and no GGUF key carries. The SwiGLU clamp and slope stay the config's
    defaults, the released models' 7 and 1.702, which llama.cpp also fixes."""
    config.intermediate_size = int(get("expert_feed_forward_length", config.intermediate_size))
    config.sliding_window = int(get("attention.sliding_window", config.sliding_window))
    config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(config.num_hidden_layers)]
    params = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 150000.0))}
    if get("rope.scaling.type") == "yarn":
        params.update(rope_type="yarn", factor=float(get("rope.scaling.factor")), truncate=False,
                      original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
                      beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)))
    config.rope_parameters = params
