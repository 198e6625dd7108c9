"""Reasoning parsers: a <think> block apart from the answer, the same however the output
is cut into deltas, and never a source of tool calls."""

from __future__ import annotations


import pytest

from engine.serving.reasoning import ReasoningParser
from engine.serving.tools.calls import Splitter

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


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), CASES)
def test_the_split_is_the_same_at_every_cut(name, text, reasoning, content):
    assert split_reasoning(name, text) == (reasoning, content)
    for size in (1, 7, 1000):
        assert _streamed(name, text, size) == (reasoning or "", content), size
