"""Tool-call formats served end to end by a tiny random model with a Llama-3.1-style
template, held by a grammar (a forced call, or a literal output) to text in that format."""

from __future__ import annotations

import json

import pytest

from tests.support.server import literal_regex, tiny_llm
from tests.support.call_formats import CASES, TIME, TOOLS, WEATHER, split_calls


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
    for fmt in ("llama3_json", "mistral", "granite", "command_r", "pythonic", "qwen3_xml", "glm45"):
        serving = OpenAIServing(llm, "tiny", tool_call_parser=fmt)
        clients[fmt] = TestClient(create_app(lambda s=serving: s)).__enter__()
    yield clients
    for tc in clients.values():
        tc.__exit__(None, None, None)
    llm.shutdown()


ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "granite", "command_r", "pythonic", "qwen3_xml", "glm45"])
def test_a_forced_call_in_each_format_follows_the_schema(serve, fmt):
    bounded = {"type": "function", "function": {"name": "get_weather", "parameters": {  # a random model's
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},  # strings never end
        "required": ["city"], "additionalProperties": False}}}
    body = {"messages": ASK, "tools": [bounded, TIME], "max_tokens": 120, "temperature": 0,  # Command R's is long
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    choice = serve[fmt].post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    [call] = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and args["city"] in ("Paris", "Rome")
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, t, _, calls in CASES if calls and f != "hermes"])
def test_generated_calls_in_each_format_are_served_streamed_or_not(serve, fmt, text):
    body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 180, "temperature": 0,  # Command R's are long
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


def test_a_forced_pythonic_call_the_grammar_cannot_hold_is_a_400_naming_the_keyword(serve):
    pattern = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z]"}}}}}
    r = serve["pythonic"].post("/v1/chat/completions", json={"messages": ASK, "tools": [pattern],
                                                             "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters.properties.city.pattern"
