"""Relevance scores (/v1/score, /v1/rerank, LLM.score): a query and a document as one
prompt, scored at its last token by a small linear head over the final-normed hidden
state. Two kinds of checkpoint carry such a head:

- a sequence-classification checkpoint (`*ForSequenceClassification`): its `score.weight`,
  one row per label (one label: a sigmoid; several: a softmax, as transformers' pipeline);
- a causal LM asked a yes/no question (Qwen3-Reranker): `classifier_from_token: [no, yes]`
  makes the head the difference of the two tokens' LM-head rows, so the score is
  sigmoid(l_yes - l_no), the softmax's P(yes) over the two (vLLM's conversion, the same sum).

How query and document join is the checkpoint's convention: a `template` with `{query}`
and `{document}`, or else the tokenizer's pair encoding (what transformers gives a
cross-encoder called with text and text_pair).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_validator

from engine.errors import ParamError

if TYPE_CHECKING:
    import torch

    from engine.models.loader import ModelFiles


class ScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    classifier_from_token: tuple[str, str] | None = None  # [no, yes]: a yes/no question to a causal LM
    template: str | None = None  # with {query} and {document}; None: the tokenizer's pair encoding

    @field_validator("template")
    @classmethod
    def _placeholders(cls, v: str | None) -> str | None:
        if v is not None and ("{query}" not in v or "{document}" not in v):
            raise ParamError("scorer.template", "scorer.template needs both {query} and {document}")
        return v


def is_classifier(hf_config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])


def head(files: ModelFiles, hf_config: Any, tokenizer: Any, scorer: ScorerConfig) -> torch.Tensor:
    """The head's fp32 rows, read from the checkpoint (never the possibly quantized or
    packed weights the engine computes with): its safetensors, or a GGUF's own tensor
    where its conversion left the embedding and the head in the file."""
    import torch

    from engine.models import gguf_dense

    path = files.path

    if scorer.classifier_from_token is not None:
        ids = []
        for token in scorer.classifier_from_token:
            found = tokenizer.encode(token, add_special_tokens=False)
            if len(found) != 1:
                raise ParamError("scorer.classifier_from_token", f"{token!r} is {len(found)} tokens for this "
                                 "tokenizer; a yes/no head needs one token each")
            ids.append(found[0])
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if files.blocks_only:
            no, yes = gguf_dense.rows(files.source, "token_embd.weight" if tied else "output.weight", ids)
        else:
            rows = _tensor(path, ("model.embed_tokens.weight", "embed_tokens.weight") if tied else ("lm_head.weight",))
            no, yes = rows[ids[0]].float(), rows[ids[1]].float()
        return (yes - no)[None, :]
    if not is_classifier(hf_config):
        raise ParamError("scorer", "scorer on a causal LM needs classifier_from_token (e.g. [\"no\", \"yes\"]); "
                         "a sequence-classification checkpoint brings its own head")
    weight = _tensor(path, ("score.weight",)).float()
    if weight.dim() != 2 or weight.shape[1] != hf_config.hidden_size:
        raise ParamError("model", f"score.weight has shape {tuple(weight.shape)}; expected [labels, "
                         f"{hf_config.hidden_size}]")
    return torch.as_tensor(weight)


def scores(head_rows: torch.Tensor, hidden: torch.Tensor) -> list[float]:
    """One label: its sigmoid; several: their softmax."""
    import torch

    logits = head_rows @ hidden.float()
    return (torch.sigmoid(logits) if logits.shape[0] == 1 else torch.softmax(logits, dim=0)).tolist()


def _tensor(path: Path, names: tuple[str, ...]) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    raise ParamError("model", f"{path}: the checkpoint has no {' or '.join(names)} for the scoring head")


def pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (query, document) pairs as vLLM forms them: one text_1 against every text_2,
    or the two lists index by index."""
    firsts = [text_1] if isinstance(text_1, str) else list(text_1)
    seconds = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        if not texts:
            raise ParamError(name, f"{name} must not be an empty list")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    if len(firsts) != len(seconds):
        raise ParamError("text_2", f"got {len(firsts)} text_1 and {len(seconds)} text_2: give one text_1, "
                         "or as many as text_2")
    return list(zip(firsts, seconds))


def prompt_ids(tokenizer: Any, query: str, document: str, template: str | None) -> list[int]:
    """The scored prompt's token ids: the template filled in, or the tokenizer's pair encoding."""
    if template is not None:
        return tokenizer.encode(template.replace("{query}", query).replace("{document}", document),
                                add_special_tokens=False)
    return tokenizer(query, text_pair=document)["input_ids"]
