"""When a sequence ends, decided token by token right after sampling, next to the
scheduler: a sequence that stops frees its blocks in the step that stopped it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.detokenizer import Detokenizer
from engine.sequence import Sequence


@dataclass
class Verdict:
    """The text a new token adds, and why the sequence ends with it (None: it goes on)."""

    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def after_token(seq: Sequence, tok: int, detok: Detokenizer, eos_token_ids: list[int],
                max_model_len: int) -> Verdict:
    """`tok` already appended to `seq` (and accepted by its grammar, if any). Checked in
    vLLM's order: eos, a stop token, a stop string, a completed grammar, the length."""
    params = seq.params
    if not params.ignore_eos and tok in eos_token_ids:
        verdict = Verdict("", "stop")
    elif tok in seq.rules.stop_token_ids:
        verdict = Verdict("", "stop", tok)
    else:
        verdict = Verdict(detok.update([tok]))
        if detok.stopped:
            return Verdict(verdict.text, "stop", detok.stop_reason)
        if seq.matcher is not None and seq.matcher.done:  # the constraint is complete: nothing may follow
            verdict.finish_reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= max_model_len:
            verdict.finish_reason = "length"
    if verdict.finish_reason is not None:
        verdict.text += detok.flush()
        if detok.stopped:  # held-back text completed a stop string
            verdict.finish_reason, verdict.stop_reason = "stop", detok.stop_reason
    return verdict
