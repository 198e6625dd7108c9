"""What the core checks of a request that only it can know: the tokenizer's view of
bad_words, and sampling fields that together leave no token to sample."""

from __future__ import annotations

from typing import Any

from engine.errors import ParamError
from engine.sampling_params import SamplingParams


def bad_words_ids(tokenizer: Any, params: SamplingParams) -> list[list[int]] | None:
    """Each bad word's tokens as it starts the text and as it follows a space, as vLLM."""
    if params.bad_words_token_ids is not None or not params.bad_words:
        return params.bad_words_token_ids
    ids: list[list[int]] = []
    for word in params.bad_words:
        for text in dict.fromkeys([word, " " + word.lstrip()]):
            toks = tokenizer.encode(text, add_special_tokens=False)
            if toks and toks not in ids:
                ids.append(toks)
    return ids


def check_contradictions(params: SamplingParams, eos_token_ids: list[int]) -> None:
    """Refuse up front what could never sample a token: allowed ids that bad_words (or,
    before min_tokens, the stop and eos tokens) all ban. `params.bad_words_token_ids` must
    be filled. A grammar's part in it shows only while decoding, where the engine ends
    the sequence with an error instead."""
    if params.allowed_token_ids is None:
        return
    banned = {ids[0]: "bad_words" for ids in params.bad_words_token_ids or [] if len(ids) == 1}
    if params.min_tokens > 0:
        for t in [*eos_token_ids, *params.stop_token_ids]:
            banned.setdefault(t, "min_tokens (stop and eos tokens are banned until it is reached)")
    if all(t in banned for t in params.allowed_token_ids):
        why = sorted({banned[t] for t in params.allowed_token_ids})
        raise ParamError("allowed_token_ids", "every token in allowed_token_ids is banned by "
                         + " and ".join(why) + ": nothing could be generated")


def constraints(params: SamplingParams) -> str:
    """The request's fields that ban tokens, for an error that says which to change."""
    names = [name for name, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                                   ("bad_words", bool(params.bad_words)),
                                   ("min_tokens", params.min_tokens > 0),
                                   ("the structured-output constraint", params.structured is not None)) if on]
    return ", ".join(names) or "the request's constraints"
