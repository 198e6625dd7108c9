"""The split a GGUF's byte-level vocabulary was trained with, where transformers' GGUF
reader does not know the file's `tokenizer.ggml.pre` and leaves GPT-2's in its place.

A BPE vocabulary holds merges only within the pieces its pre-tokenizer cut, so text cut
another way gives other tokens than the model saw in training: GLM-4 cuts numbers into
runs of at most three digits and keeps one leading punctuation mark on a word
(`.get`, `(self`), where GPT-2's split gives whole digit runs and cuts the mark off;
Command R, SmolLM and StarCoder put every digit on its own; StableLM 2 splits as Qwen2;
HunYuan in three passes (digit runs, CJK runs, words).
The names and their splits are llama.cpp's (its llama-vocab.cpp), which chose them to
match each family's own tokenizer.json. A name known to neither is served with GPT-2's
split and a warning, as llama.cpp serves it with its default.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# Names whose split is one transformers knows under another name: GLM-4's is Llama 3's,
# StableLM 2's Qwen2's (llama.cpp gives each pair one split).
SAME_AS = {"glm4": "llama3", "chatglm-bpe": "llama3", "stablelm2": "qwen2"}
# Every digit its own piece, then GPT-2's split.
DIGITS_THEN_GPT2 = ("command-r", "smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b")
# Splits of several passes, each cutting the pieces of the one before: HunYuan's (and
# DeepSeek V3's) runs of 1-3 digits, then CJK runs, then words with their marks.
PASSES = {name: (r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
                 r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                 r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
          for name in ("hunyuan-dense", "deepseek-v3")}
# Names whose split is GPT-2's own: what the reader builds already.
GPT2 = ("gpt-2", "phi-2", "olmo", "mpt", "jais", "exaone4", "trillion", "granite-docling", "a.x-4.0", "mellum",
        "gigachat")


def set_pre_tokenizer(tokenizer: Any, pre: str | None, model: str | None) -> None:
    """Give `tokenizer` (built by transformers from a GGUF whose `tokenizer.ggml.model` is
    `model` and `tokenizer.ggml.pre` is `pre`) the split its vocabulary was trained with."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    if model != "gpt2" or not pre or pre in GGUF_PRE_TOKENIZER_SPLITS or pre in GPT2:
        return
    if pre in DIGITS_THEN_GPT2:
        split = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif pre in PASSES:
        split = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PASSES[pre]]
                                        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in SAME_AS:
        split = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GGUF_PRE_TOKENIZER_SPLITS[SAME_AS[pre]]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        logger.warning("GGUF pre-tokenizer %r is not known here: text is split as GPT-2 splits it", pre)
        return
    tokenizer.backend_tokenizer.pre_tokenizer = split
