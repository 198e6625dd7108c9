"""Tool calling in-process: the parser however its text is split, and prompt rendering."""

from __future__ import annotations

import json

import pytest

from engine.serving.errors import APIError
from engine.serving.openai.protocol import ChatMessage, Tool
from engine.serving.tools.calls import CallParser, DEFAULT_PROMPT, active_tools, render, write_calls
from engine.serving.tools.formats import CallDelta, fold
from tests.support.weather_tools import TIME, WEATHER

pytestmark = pytest.mark.timeout(600)


TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(TIME)]


def _parse_all(text: str, pieces: int, stream: bool = False) -> tuple[str, list]:
    """Feed `text` in `pieces` roughly equal chunks, as a stream would, flush, and join
    the calls' parts as a client does."""
    content, parts = _parts(text, max(1, len(text) // pieces), stream)
    return content, fold(parts)


def _parts(text: str, size: int, stream: bool) -> tuple[str, list[CallDelta]]:
    p = CallParser(TOOLS, stream)
    out, parts = "", []
    for i in range(0, len(text), size):
        c, k = p.feed(text[i:i + size])
        out, parts = out + c, parts + k
    c, k = p.finish()
    return out + c, parts + k


# -- in-process: parsing and rendering --------------------------------------------------------
@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_calls_come_out_of_the_text_however_it_is_split(pieces):
    text = ("Let me check.\n" + write_calls([("get_weather", {"city": "Paris", "unit": "celsius"})], "hermes") + "\n"
            + write_calls([("get_time", {"city": "Paris"})], "hermes"))
    content, calls = _parse_all(text, pieces)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_plain_answers_and_broken_calls_stay_text(pieces):
    plain = "It is sunny <b>today</b>, about 20 degrees.\n\n"
    assert _parse_all(plain, pieces) == (plain, [])
    for bad in ['<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not offered
                '<tool_call>\n{"name": "get_time", "arguments": {"city": </tool_call>',  # not JSON
                '<tool_call>\n{"name": "get_time", "arguments": {"city": "Pa']:  # cut off by max_tokens
        assert _parse_all(bad, pieces) == (bad, []), bad


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_streamed_arguments_join_to_the_whole_calls_arguments(size):
    """Streaming, a call opens as soon as its name is read and its arguments follow as the
    model writes them, spaced and escaped its own way; joined, they are exactly the
    arguments of the same text parsed whole."""
    text = ('Sure.\n<tool_call>\n{ "name" : "get_weather", "arguments":'
            '{"city" :"Par\\u00eds \\"x\\" \\ud83d\\ude00 日本",'
            '"unit": "celsius", "n": [1, 2.50, -0, 1E3, true, null, {}], "deep": {"a": {"b": []}}}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"city": "Rome"}}</tool_call> Done.')
    whole = _parse_all(text, 1)
    content, parts = _parts(text, size, stream=True)
    assert (content, [(c.id[:5], c.function.name, c.function.arguments) for c in fold(parts)]) == \
        (whole[0], [(c.id[:5], c.function.name, c.function.arguments) for c in whole[1]])
    assert json.loads(fold(parts)[0].function.arguments)["city"] == 'París "x" 😀 日本'
    first = [p for p in parts if p.index == 0]
    assert first[0].id and first[0].name == "get_weather" and first[-1].done
    if size < 100:  # cut finely, the first call's arguments come in many parts, before its block closes
        assert sum(1 for p in first if p.arguments) > 10
    # a streamed call that breaks off (max_tokens) keeps what was sent, as OpenAI's API does;
    # whole, the same text is no call and stays content
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Ro'
    assert [(c.function.name, c.function.arguments) for c in _parse_all(cut, len(cut) // size or 1, True)[1]] == \
        [("get_time", '{"city": "Ro')]
    assert _parse_all(cut, 1) == (cut, [])


def test_an_unclosed_call_with_whole_json_still_counts():
    content, calls = _parse_all('<tool_call>\n{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}', 3)
    assert content == "" and json.loads(calls[0].function.arguments) == {"city": "Rome"}


def test_a_template_without_tools_gets_the_default_prompt_and_hermes_history():
    msgs = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather?"),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}}]}),
            ChatMessage(role="tool", content="09:00", tool_call_id="c1")]
    conv, specs = render(msgs, TOOLS, native=False)
    assert specs is None
    assert conv[0]["role"] == "system" and conv[0]["content"].endswith("\n\nBe brief.")
    assert conv[0]["content"].startswith(DEFAULT_PROMPT.split("{tools}")[0])
    assert '"name": "get_weather"' in conv[0]["content"]
    assert conv[2] == {"role": "assistant", "content": write_calls([("get_time", {"city": "Oslo"})], "hermes")}
    assert conv[3] == {"role": "user", "content": "<tool_response>\n09:00\n</tool_response>"}
    native, specs = render(msgs, TOOLS, native=True)
    assert specs == [t.model_dump(exclude_none=True) for t in TOOLS] and native[3]["tool_call_id"] == "c1"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_tool_choice_checks():
    assert active_tools(TOOLS, "none") == [] and active_tools(TOOLS, None) == TOOLS
    named = {"type": "function", "function": {"name": "get_time"}}
    from engine.serving.openai.protocol import NamedToolChoice
    assert active_tools(TOOLS, NamedToolChoice.model_validate(named)) == [TOOLS[1]]
    with pytest.raises(APIError) as err:
        active_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}))
    assert err.value.detail.param == "tool_choice" and "not in `tools`" in str(err.value)


@pytest.mark.parametrize("block", ['{"name": ["get_time"], "arguments": {}}', '{"name": {"a": 1}}',
                                   '{"name": "get_time", "arguments": "' + "[" * 50000 + '"}',
                                   "[" * 50000 + "]" * 50000, '{"name": "get_time", "arguments": [1e999]}'])
def test_model_output_that_is_no_call_stays_content(block):
    text = f"<tool_call>\n{block}\n</tool_call>"
    assert _parse_all(text, 1) == (text, [])
