"""chat_template_kwargs reach the chat template and never the tokenizer, and a template
that raises is the request's error, not the server's."""

from __future__ import annotations


import pytest


SAY = [{"role": "user", "content": "Say hello."}]


def test_chat_template_kwargs_reach_the_template(default_model_dir):
    from transformers import AutoTokenizer

    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    off = tok.decode(apply_chat_template(tok, SAY, template_kwargs={"enable_thinking": False}))
    assert off.endswith("/no_think") and not tok.decode(apply_chat_template(tok, SAY)).endswith("/no_think")


@pytest.mark.parametrize("kwargs", [{"padding": "max_length", "max_length": 200_000_000}, {"padding": "bogus"},
                                    {"truncation": True}, {"return_tensors": "pt"}, {"tools": []}])
def test_chat_template_kwargs_never_reach_the_tokenizer(default_model_dir, kwargs):
    """Only template variables pass: apply_chat_template's own arguments (a 2e8-token
    padding, a bad padding value that was a 500) are refused naming the field, at once."""
    from transformers import AutoTokenizer

    from engine.errors import ParamError
    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    with pytest.raises(ParamError, match="template variables only") as err:
        apply_chat_template(tok, SAY, template_kwargs=kwargs)
    assert err.value.param == "chat_template_kwargs"


def test_a_template_that_raises_is_the_requests_error(default_model_dir):
    from transformers import AutoTokenizer

    from engine.errors import ParamError
    from engine.prompts import apply_chat_template

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.chat_template = "{% if strict %}{{ raise_exception('strict mode refuses this') }}{% endif %}x"
    with pytest.raises(ParamError, match="strict mode refuses") as err:
        apply_chat_template(tok, SAY, template_kwargs={"strict": True})
    assert err.value.param == "chat_template_kwargs"
