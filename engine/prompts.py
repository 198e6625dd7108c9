"""Turning what a user sends into token ids: a text as transformers encodes it, a
conversation through the model's own chat template. The offline LLM, the engine and the
HTTP process share these; none of them needs torch or the model here."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jinja2

from engine.errors import ParamError

Message = dict[str, Any]


TEMPLATE_ARGS = ("conversation", "tools", "tokenize", "add_generation_prompt", "return_dict", "documents",
                 "chat_template", "continue_final_message", "tokenizer_kwargs", "messages")


@functools.lru_cache(maxsize=8)
def tokenizer_args(tokenizer_type: type) -> frozenset[str]:
    """apply_chat_template's own parameters, read from its signature: the tokenizer takes
    these (padding, max_length, truncation, return_tensors, and whatever a later
    transformers adds) and hands only the rest to the template as variables."""
    params = inspect.signature(tokenizer_type.apply_chat_template).parameters
    return frozenset(name for name, p in params.items() if p.kind is not p.VAR_KEYWORD) | frozenset(TEMPLATE_ARGS)


def apply_chat_template(tokenizer: Any, conversation: list[Message], add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation through the model's own chat template; `template_kwargs`
    are extra variables the template reads (Qwen3's enable_thinking, say), and nothing
    else: a tokenizer argument among them (`{"padding": "max_length", "max_length": 2e8}`
    built a 2e8-token encoding) is refused naming it. A template that fails on what it
    was given is the request's error too."""
    if not conversation:
        raise ParamError("messages", "messages must not be empty")
    clash = sorted(set(template_kwargs or ()) & tokenizer_args(type(tokenizer)))
    if clash:
        raise ParamError("chat_template_kwargs", f"chat_template_kwargs may set template variables only, not "
                         f"{', '.join(clash)}")
    try:
        out = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False,
            **(template_kwargs or {}),
        )
    except jinja2.TemplateError as exc:  # the template's own raise_exception, or a bad variable
        raise ParamError("messages" if not template_kwargs else "chat_template_kwargs",
                         f"the chat template rejected the request: {exc}") from None
    return list(out["input_ids"] if isinstance(out, dict) else out)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's token ids, special tokens (BOS) included, as transformers adds them."""
    return tokenizer.encode(text, add_special_tokens=True)
