"""Tool-call formats beside Hermes (Llama-3 JSON, Mistral, Granite, Command R, pythonic,
Qwen3-Coder's and GLM-4.5's tagged text): each parses
the same whole or streamed at any cut, leaves what is not a call as content, is picked
from the chat template, and the pythonic grammar holds calls to their schemas."""

from __future__ import annotations

import json

import pytest

from engine.serving.openai.protocol import Tool
from engine.serving.tools.calls import call_parser
from engine.serving.tools.formats import fold
from tests.support.call_formats import CASES, TOOLS, split_calls


def _streamed(fmt: str, text: str, size: int, stream: bool) -> tuple[str, list]:
    content, parts = _parts(fmt, text, size, stream)
    return content, fold(parts)


def _parts(fmt: str, text: str, size: int, stream: bool) -> tuple[str, list]:
    parser = call_parser(TOOLS, fmt, stream)
    content, parts = [], []
    for i in range(0, len(text), size):
        c, k = parser.feed(text[i:i + size])
        content.append(c)
        parts += k
    c, k = parser.finish()
    return "".join(content) + c, parts + k


def _pairs(calls: list) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_format_parses_the_same_whole_and_at_every_cut(fmt, text, content, calls):
    got_content, got_calls = split_calls(text, TOOLS, fmt)
    assert (got_content, _pairs(got_calls)) == (content, calls)
    for size in (1, 7, 1000):
        for stream in (False, True):  # whole calls, or arguments as they come
            c, k = _streamed(fmt, text, size, stream)
            assert (c, _pairs(k)) == (content, calls), (size, stream)
            assert [x.function.arguments for x in k] == [x.function.arguments for x in got_calls]
    if calls and fmt not in ("pythonic", "qwen3_xml", "glm45"):  # JSON calls stream their arguments; others whole
        _, parts = _parts(fmt, text, 1, stream=True)
        assert sum(1 for p in parts if p.arguments) > 10 * len(calls)


def test_the_format_is_read_from_the_chat_template():
    from engine.serving.tools.formats import detect

    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert detect("{% if tools %}<|python_tag|>{% endif %}ipython") == "llama3_json"
    assert detect("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert detect("{{ '<|tool_call|>' + message['tool_calls'] | tojson }}") == "granite"
    assert detect("{{ '<|START_ACTION|>' }}{{ tool_calls | tojson }}{{ '<|END_ACTION|>' }}") == "command_r"
    assert detect("[func_name1(params_name1=params_value1)]") == "pythonic"
    # Qwen3-Coder's template writes <tool_call> too: its tagged parameters decide
    assert detect("<tool_call>\n<function={{ tool_call.name }}>\n<parameter={{ k }}>\n") == "qwen3_xml"
    assert detect("<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect(None) == detect("{{ messages }}") == "hermes"


def test_the_pythonic_grammar_holds_calls_to_their_schemas():
    """Forced pythonic calls are Python literals in the schema's shape: the grammar takes
    what the schema allows (in its order, optional arguments left out) and nothing else."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    from engine.serving.errors import APIError
    from engine.serving.tools.pythonic_grammar import grammar
    from engine.serving.tools.formats import _pythonic

    rich = Tool.model_validate({"type": "function", "function": {"name": "plan", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False, "properties": {
            "city": {"type": "string", "maxLength": 5}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
            "opts": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": ["number", "null"]}},
                     "required": ["b"]}, "extra": {}}}}})
    g = xgrammar.Grammar.from_ebnf(grammar([rich, TOOLS[1]], parallel=True))
    good = ['[plan(city="Pé")]', '[get_time(), plan(city="a", unit="f")]',
            '[plan(city="ab", days=-3, unit="c", tags=["x", "y"], opts={"b": None}, extra=[1, {"k": True}])]']
    bad = ['[plan(city="Paris!")]', '[plan(days=3)]', '[plan(unit="c", city="a")]', '[plan(city="a", days=1.5)]',
           '[plan(city="a", tags=["a", "b", "c"])]', '[plan(city="a", opts={"a": True})]', 'plan(city="a")']
    assert all(_is_grammar_accept_string(g, s) and _pythonic(s) for s in good)
    assert not any(_is_grammar_accept_string(g, s) for s in bad)
    one = xgrammar.Grammar.from_ebnf(grammar([TOOLS[1]], parallel=False))
    assert not _is_grammar_accept_string(one, "[get_time(), get_time()]")
    at = "tools[0].function.parameters.properties.c"
    for schema, param in [({"type": "string", "pattern": "^[A-Z]"}, f"{at}.pattern"),
                          ({"type": "integer", "minimum": 0}, f"{at}.minimum")]:
        tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"c": schema}}}})
        with pytest.raises(APIError) as err:
            grammar([tool], parallel=False)
        assert err.value.detail.param == param  # what the grammar cannot hold the model to is refused, not dropped


def test_the_pythonic_grammar_grows_linearly_in_the_properties_and_is_capped():
    """Each optional property's tail is one rule: 2,000 optional properties made a 40 MB
    grammar when every alternative spelled out the rest. Past the bound, a 400 naming tools."""
    from engine import limits
    from engine.serving.errors import APIError
    from engine.serving.tools.pythonic_grammar import grammar

    def tool(n: int) -> Tool:
        return Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}}})

    small, double = len(grammar([tool(100)], parallel=False)), len(grammar([tool(200)], parallel=False))
    assert double < 2.2 * small  # linear, where it was quadratic
    with pytest.raises(APIError) as err:
        grammar([tool(2000)], parallel=False)
    assert err.value.detail.param == "tools" and str(limits.MAX_GRAMMAR_CHARS) in str(err.value)
