"""Reasoning parsers: a <think> block apart from the answer, the same however the output
is cut into deltas, and never a source of tool calls. End to end, a tiny random model
with a Qwen3-style template is held by a grammar to an output with a think block, so the
served split is checked on text the engine really generated."""

from __future__ import annotations

import json

import pytest

from engine.serving.reasoning import ReasoningParser
from engine.serving.tools.calls import Splitter
from tests.served import literal_regex, tiny_llm

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {
    "qwen3": [
        ("<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.", "\nThe user wants the weather.\n",
         "It is sunny."),
        ("No thinking here, just <thin text.", None, "No thinking here, just <thin text."),
        (f"<think>maybe {CALL}</think>Done.", f"maybe {CALL}", "Done."),
        ("<think>cut off before the end", "cut off before the end", ""),
    ],
    "deepseek_r1": [
        ("Let me think.</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
        ("<think>Repeated tag.</think>Answer.", "Repeated tag.", "Answer."),
        ("<thi", "<thi", ""),
        ("Never closed", "Never closed", ""),
    ],
}
CASES = [(name, *case) for name, cases in TEXTS.items() for case in cases]


def split_reasoning(name: str, text: str) -> tuple[str | None, str]:
    """A whole output's reasoning (None when there was none) and content."""
    reasoning, content, _ = Splitter([], reasoning=name).feed(text, final=True)  # type: ignore[arg-type]
    return reasoning or None, content


def _streamed(name: str, text: str, size: int) -> tuple[str, str]:
    parser = ReasoningParser(name)  # type: ignore[arg-type]
    reasoning, content = [], []
    for i in range(0, len(text), size):
        r, c = parser.feed(text[i:i + size])
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.unit
@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_the_split_is_the_same_at_every_cut(name, text, reasoning, content):
    assert split_reasoning(name, text) == (reasoning, content)
    for size in (1, 7, 1000):
        assert _streamed(name, text, size) == (reasoning or "", content), size


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


@pytest.mark.served
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


@pytest.mark.served
def test_a_call_after_the_think_block_is_a_call(app):
    forced = f"<think>I should call the tool.</think>\n\n{CALL}"
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL], "max_tokens": 120,
            "temperature": 0, "structured_outputs": {"regex": literal_regex(forced)}}
    choice = app.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "I should call the tool."
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"} and choice["finish_reason"] == "tool_calls"
