"""Tool calling: the parser and prompt rendering in-process, then round trips with the
real openai client against `bentoml serve` (the session's server, tests/served.py)."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from engine.serving.errors import APIError
from engine.serving.openai.protocol import ChatMessage, Tool
from engine.serving.tools.calls import CallParser, DEFAULT_PROMPT, active_tools, render, write_calls
from engine.serving.tools.formats import CallDelta, fold
from tests.served import MODEL

pytestmark = pytest.mark.timeout(600)


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time in a city."""

    city: str = Field(max_length=24)


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME = openai.pydantic_function_tool(GetTime, name="get_time")
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
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
@pytest.mark.unit
@pytest.mark.parametrize("pieces", [1, 7, 1000])
def test_calls_come_out_of_the_text_however_it_is_split(pieces):
    text = ("Let me check.\n" + write_calls([("get_weather", {"city": "Paris", "unit": "celsius"})], "hermes") + "\n"
            + write_calls([("get_time", {"city": "Paris"})], "hermes"))
    content, calls = _parse_all(text, pieces)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"city": "Paris"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.unit
@pytest.mark.parametrize("pieces", [1, 5, 1000])
def test_plain_answers_and_broken_calls_stay_text(pieces):
    plain = "It is sunny <b>today</b>, about 20 degrees.\n\n"
    assert _parse_all(plain, pieces) == (plain, [])
    for bad in ['<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not offered
                '<tool_call>\n{"name": "get_time", "arguments": {"city": </tool_call>',  # not JSON
                '<tool_call>\n{"name": "get_time", "arguments": {"city": "Pa']:  # cut off by max_tokens
        assert _parse_all(bad, pieces) == (bad, []), bad


@pytest.mark.unit
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


@pytest.mark.unit
def test_an_unclosed_call_with_whole_json_still_counts():
    content, calls = _parse_all('<tool_call>\n{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}', 3)
    assert content == "" and json.loads(calls[0].function.arguments) == {"city": "Rome"}


@pytest.mark.unit
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


@pytest.mark.unit
def test_tool_choice_checks():
    assert active_tools(TOOLS, "none") == [] and active_tools(TOOLS, None) == TOOLS
    named = {"type": "function", "function": {"name": "get_time"}}
    from engine.serving.openai.protocol import NamedToolChoice
    assert active_tools(TOOLS, NamedToolChoice.model_validate(named)) == [TOOLS[1]]
    with pytest.raises(APIError) as err:
        active_tools(TOOLS, NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}))
    assert err.value.detail.param == "tool_choice" and "not in `tools`" in str(err.value)


# -- end to end -------------------------------------------------------------------------------
def _round_trip(client, http, message: dict) -> openai.types.chat.ChatCompletion:
    """Answer the call with a result and ask for the next turn; check that the turn the
    model saw carries the call and its result, and that its reply is the engine's greedy
    continuation of exactly that prompt."""
    result = json.dumps({"temperature": 18, "sky": "clear"})
    results = [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in message["tool_calls"]]
    messages = ASK + [message] + results
    nxt = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                         temperature=0)
    ids = http.post("/tokenize", json={"messages": messages, "tools": [WEATHER, TIME]}).json()["tokens"]
    seen = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    call = message["tool_calls"][0]["function"]
    assert f"<tool_response>\n{result}\n</tool_response>" in seen
    assert json.dumps(call["name"]) in seen and seen.rstrip().endswith("assistant")
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0).choices[0]
    reply = nxt.choices[0]
    if reply.message.tool_calls:
        assert reply.finish_reason == "tool_calls" and "<tool_call>" in same.text
    else:
        assert reply.message.content == same.text and reply.finish_reason == same.finish_reason
    return nxt


@pytest.mark.served
def test_required_tool_round_trip(client, http):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    (GetWeather if call.function.name == "get_weather" else GetTime).model_validate_json(call.function.arguments)
    _round_trip(client, http, choice.message.model_dump(exclude_none=True))


@pytest.mark.served
def test_required_tool_round_trip_streamed(client, http):
    ask = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
               max_tokens=80, temperature=1.0, seed=7)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    calls: dict[int, dict] = {}
    parts = 0
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            parts += bool(d.function.arguments)
            c = calls.setdefault(d.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] += d.id or ""
            c["function"]["name"] += d.function.name or ""
            c["function"]["arguments"] += d.function.arguments or ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    fn = calls[0]["function"]
    (GetWeather if fn["name"] == "get_weather" else GetTime).model_validate_json(fn["arguments"])
    assert parts > 3  # the arguments streamed as they were generated, not in one piece at the end
    whole = client.chat.completions.create(**ask).choices[0].message.tool_calls[0].function
    assert (fn["name"], fn["arguments"]) == (whole.name, whole.arguments)  # the same seed, the same call
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    _round_trip(client, http, {"role": "assistant", "tool_calls": [calls[0]]})


@pytest.mark.served
def test_a_named_tool_is_the_one_called_on_every_sample(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=3, temperature=1.0, seed=2,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      parallel_tool_calls=False, max_tokens=60)
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and isinstance(call.function.parsed_arguments, GetTime)


@pytest.mark.served
def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12,
                                       temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.served
def test_auto_with_a_strict_function_makes_a_begun_call_valid(client, http):
    """`auto` leaves the choice to the model; with `strict`, a call it begins must follow the
    schema (a grammar triggered by the opening tag). logit_bias pushes the model into
    writing the tag: with strict the call that follows is whole and valid, without it the
    model only stutters tags, and nothing of that becomes a call."""
    tag = http.post("/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False}).json()["tokens"]
    kw = dict(model=MODEL, messages=ASK, tool_choice="auto", parallel_tool_calls=False, temperature=0,
              max_tokens=80, logit_bias={str(t): 10 for t in tag})
    strict = openai.pydantic_function_tool(GetWeather, name="get_weather")
    assert strict["function"]["strict"] is True
    choice = client.chat.completions.create(tools=[strict], **kw).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    GetWeather.model_validate_json(call.function.arguments)
    loose = {"type": "function", "function": {**strict["function"], "strict": False}}
    choice = client.chat.completions.create(tools=[loose], **kw).choices[0]
    assert not choice.message.tool_calls and choice.message.content.count("<tool_call>") > 1


@pytest.mark.parametrize("block", ['{"name": ["get_time"], "arguments": {}}', '{"name": {"a": 1}}',
                                   '{"name": "get_time", "arguments": "' + "[" * 50000 + '"}',
                                   "[" * 50000 + "]" * 50000, '{"name": "get_time", "arguments": [1e999]}'])
@pytest.mark.unit
def test_model_output_that_is_no_call_stays_content(block):
    text = f"<tool_call>\n{block}\n</tool_call>"
    assert _parse_all(text, 1) == (text, [])
