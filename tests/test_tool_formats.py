"""Tool-call formats beside Hermes (Llama-3 JSON, Mistral, pythonic): each parses the same
whole or streamed at any cut, leaves what is not a call as content, is picked from the
chat template, and is served end to end by a tiny random model with a Llama-3.1-style
template, held by a grammar (a forced call, or a literal output) to text in that format."""

from __future__ import annotations

import json

import pytest

from engine.serving.openai.protocol import Tool
from engine.serving.tools.calls import Splitter, call_parser
from engine.serving.tools.formats import fold
from tests.served import literal_regex, tiny_llm

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]
PARIS = ("get_weather", {"city": "Paris", "days": 2})
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
     "", [PARIS]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                    '{"name": "get_time", "parameters": {}}', "", [PARIS, ("get_time", {})]),
    ("llama3_json", 'The weather is {"sunny"}.', 'The weather is {"sunny"}.', []),
    ("llama3_json", '{"name": "launch", "parameters": {}}', '{"name": "launch", "parameters": {}}', []),
    ("mistral", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     "Let me check.", [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}', "",
     [PARIS, ("get_time", {})]),
    ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ("granite", 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {}}]', "Checking.", [PARIS, ("get_time", {})]),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', "", [PARIS]),
    ("granite", "<|tool_call|>[{'name': 'x'}]", "<|tool_call|>[{'name': 'x'}]", []),
    ("pythonic", '[get_weather(city="Paris", days=2), get_time()]', "", [PARIS, ("get_time", {})]),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),
    ("pythonic", "No calls here.", "No calls here.", []),
]


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


def split_calls(text: str, tools: list[Tool], fmt: str) -> tuple[str, list]:
    """A whole output's content and calls."""
    _, content, calls = Splitter(tools, fmt).whole(text)
    return content, calls


def _pairs(calls: list) -> list:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.unit
@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_format_parses_the_same_whole_and_at_every_cut(fmt, text, content, calls):
    got_content, got_calls = split_calls(text, TOOLS, fmt)
    assert (got_content, _pairs(got_calls)) == (content, calls)
    for size in (1, 7, 1000):
        for stream in (False, True):  # whole calls, or arguments as they come
            c, k = _streamed(fmt, text, size, stream)
            assert (c, _pairs(k)) == (content, calls), (size, stream)
            assert [x.function.arguments for x in k] == [x.function.arguments for x in got_calls]
    if calls and fmt != "pythonic":  # JSON calls stream their arguments; pythonic ones come whole
        _, parts = _parts(fmt, text, 1, stream=True)
        assert sum(1 for p in parts if p.arguments) > 10 * len(calls)


@pytest.mark.unit
def test_the_format_is_read_from_the_chat_template():
    from engine.serving.tools.formats import detect

    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert detect("{% if tools %}<|python_tag|>{% endif %}ipython") == "llama3_json"
    assert detect("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert detect("{{ '<|tool_call|>' + message['tool_calls'] | tojson }}") == "granite"
    assert detect("[func_name1(params_name1=params_value1)]") == "pythonic"
    assert detect(None) == detect("{{ messages }}") == "hermes"


# -- end to end ---------------------------------------------------------------------------------
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


@pytest.fixture(scope="module")
def serve(tiny_model_factory):
    """An app per format over one tiny engine."""
    from starlette.testclient import TestClient

    from engine.serving.app import create_app
    from engine.serving.openai.handlers import OpenAIServing

    llm = tiny_llm(tiny_model_factory("llama31-style-tiny"), LLAMA_TEMPLATE)
    clients = {}
    for fmt in ("llama3_json", "mistral", "granite", "pythonic"):
        serving = OpenAIServing(llm, "tiny", tool_call_parser=fmt)
        clients[fmt] = TestClient(create_app(lambda s=serving: s)).__enter__()
    yield clients
    for tc in clients.values():
        tc.__exit__(None, None, None)
    llm.shutdown()


ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.served
@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "granite", "pythonic"])
def test_a_forced_call_in_each_format_follows_the_schema(serve, fmt):
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {  # a random model's
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},  # strings never end
        "required": ["city"], "additionalProperties": False}}}
    body = {"messages": ASK, "tools": [bounded, TIME], "max_tokens": 60, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = serve[fmt].post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    [call] = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Paris", "Rome")
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.served
@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, t, _, calls in CASES if calls and f != "hermes"])
def test_generated_calls_in_each_format_are_served_streamed_or_not(serve, fmt, text):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 120, "temperature": 0,
            "structured_outputs": {"regex": literal_regex(text)}}
    whole = serve[fmt].post("/v1/chat/completions", json=body).json()["choices"][0]
    expected = split_calls(text, TOOLS, fmt)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == \
        [c.function.name for c in expected[1]]
    lines = serve[fmt].post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    joined: dict[int, str] = {}
    for x in lines:
        if x.startswith("data: {"):
            for d in json.loads(x[6:])["choices"][0]["delta"].get("tool_calls") or []:
                joined[d["index"]] = joined.get(d["index"], "") + d["function"].get("arguments", "")
    assert list(joined.values()) == [c["function"]["arguments"] for c in whole["message"]["tool_calls"]]


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.served
def test_a_forced_pythonic_call_the_grammar_cannot_hold_is_a_400_naming_the_keyword(serve):
    pattern = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}}}}
    r = serve["pythonic"].post("/v1/chat/completions", json={"messages": ASK, "tools": [pattern],
                                                             "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters.properties.city.pattern"
