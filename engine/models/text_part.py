"""Where a multimodal checkpoint (Gemma 3, Qwen3.5) keeps its language model's tensors: the
engine serves that part as a decoder-only model and loads nothing of the rest."""

from __future__ import annotations

TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def text_name(name: str, other_parts: tuple[str, ...]) -> str | None:
    """A checkpoint tensor's name in the text model's terms; None for one of `other_parts`
    (the vision tower, a projector, a multi-token-prediction head)."""
    if name.startswith(other_parts):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return "model." + name.removeprefix(prefix)
    return name
