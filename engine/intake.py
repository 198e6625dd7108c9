"""What the core checks of a request before it queues it: what only it can know (the
vocabulary, max_model_len, the tokenizer's view of bad_words, which tokens the model
stops on). Field values themselves were checked once, by SamplingParams.validate where
the request entered (LLM.generate, AsyncLLM.generate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import ParamError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # AsyncLLM's check_token_ids runs where torch is not loaded
    import torch

    from engine.rules import TokenRules



@dataclass
class Admitted:
    """What admission resolved: the sequence's own limits, never written back into params."""

    max_tokens: int
    rules: TokenRules


def check_token_ids(vocab_size: int, prompt: list[int], params: SamplingParams) -> None:
    """Every token id a request names, inside the vocabulary. AsyncLLM runs it too, before
    the ids cross to the engine process: an id of any size is the client's error, never
    the pipe's."""
    for name, used in (("prompt", prompt), *params.token_ids_used().items()):
        if any(type(t) is not int or not 0 <= t < vocab_size for t in used):
            raise ParamError(name, f"{name} names token ids outside the vocabulary [0, {vocab_size})")


def admit(prompt: list[int], params: SamplingParams, *, vocab_size: int, max_model_len: int,
          max_num_seqs: int, tokenizer: Any, eos_token_ids: list[int],
          device: torch.device | None = None, pooling: bool = False) -> Admitted:
    """An embedding request (`pooling`) generates nothing: its prompt may fill max_model_len."""
    if not prompt:
        raise ParamError("prompt", "prompt must not be empty")
    check_token_ids(vocab_size, prompt, params)
    n_prompt = len(prompt)
    if pooling:
        if n_prompt > max_model_len:
            raise ParamError("prompt", f"prompt has {n_prompt} tokens; max_model_len is {max_model_len}")
        from engine.rules import TokenRules

        return Admitted(0, TokenRules())
    if n_prompt >= max_model_len:
        raise ParamError("prompt", f"prompt has {n_prompt} tokens; max_model_len is {max_model_len}, which must "
                         "also leave room for at least one generated token")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt
    elif n_prompt + max_tokens > max_model_len:
        raise ParamError("max_tokens", f"max_tokens ({max_tokens}) plus the prompt's {n_prompt} tokens exceeds "
                         f"max_model_len ({max_model_len})")
    if params.n > max_num_seqs:
        raise ParamError("n", f"n ({params.n}) exceeds max_num_seqs ({max_num_seqs})")
    bad_words = bad_words_ids(tokenizer, params)
    check_contradictions(params, bad_words, eos_token_ids)
    from engine.rules import TokenRules

    return Admitted(max_tokens, TokenRules.of(params, bad_words, device))


def bad_words_ids(tokenizer: Any, params: SamplingParams) -> list[list[int]] | None:
    """Each bad word's tokens as it starts the text and as it follows a space, as vLLM,
    each distinct sequence once (a set: a list scan here was quadratic in the words)."""
    if not params.bad_words:
        return None
    seen: dict[tuple[int, ...], None] = {}
    texts = dict.fromkeys(t for word in params.bad_words for t in (word, " " + word.lstrip()))
    for text in texts:
        toks = tokenizer.encode(text, add_special_tokens=False)
        if toks:
            seen.setdefault(tuple(toks), None)
    return [list(t) for t in seen]


def check_contradictions(params: SamplingParams, bad_words: list[list[int]] | None,
                         eos_token_ids: list[int]) -> None:
    """Refuse up front what could never sample a token: allowed ids that bad_words (or,
    before min_tokens, the stop and eos tokens) all ban. A grammar's part in it shows only
    while decoding, where the engine ends the sequence with an error instead."""
    if params.allowed_token_ids is None:
        return
    banned = {ids[0]: "bad_words" for ids in bad_words or [] if len(ids) == 1}
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
