"""Reasoning served end to end: a tiny random model with a Qwen3-style template is held by a
grammar to an output with a think block, so the split into reasoning and content (and a
call inside the block not being a call) is checked on text the engine really generated."""

from __future__ import annotations

import json

import pytest

from tests.support.server import literal_regex, tiny_llm

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# -- end to end ---------------------------------------------------------------------------------
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    from starlette.testclient import TestClient

    from engine.serving.app import create_app
    from engine.serving.openai.handlers import OpenAIServing

    llm = tiny_llm(tiny_model_factory("qwen3-style-tiny"), QWEN3_TEMPLATE)
    serving = OpenAIServing(llm, "tiny", reasoning_parser="qwen3")
    with TestClient(create_app(lambda: serving)) as tc:
        yield tc
    llm.shutdown()


def test_a_think_block_is_reasoning_and_a_call_inside_it_is_not_a_call(app):
    forced = f"<think>check {CALL}</think>\n\nIt is sunny."
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL], "max_tokens": 120,
            "temperature": 0, "structured_outputs": {"regex": literal_regex(forced)}}
    msg = app.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"], msg["tool_calls"]) == (f"check {CALL}", "It is sunny.", [])
    lines = app.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines if x.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    assert not any(d.get("tool_calls") for d in deltas)


def test_a_call_after_the_think_block_is_a_call(app):
    forced = f"<think>I should call the tool.</think>\n\n{CALL}"
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL], "max_tokens": 120,
            "temperature": 0, "structured_outputs": {"regex": literal_regex(forced)}}
    choice = app.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "I should call the tool."
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and choice["finish_reason"] == "tool_calls"
