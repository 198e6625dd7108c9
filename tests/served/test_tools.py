"""Tool calling round trips with the real openai client against `bentoml serve` (the
session's server, tests/support/server.py)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.support.server import MODEL
from tests.support.weather_tools import GetTime, GetWeather, TIME, WEATHER

pytestmark = pytest.mark.timeout(600)


ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


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


def test_required_tool_round_trip(client, http):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("get_weather", "get_time")
    (GetWeather if call.function.name == "get_weather" else GetTime).model_validate_json(call.function.arguments)
    _round_trip(client, http, choice.message.model_dump(exclude_none=True))


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


def test_a_named_tool_is_the_one_called_on_every_sample(client):
    r = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[WEATHER, TIME], n=3, temperature=1.0, seed=2,
                                      tool_choice={"type": "function", "function": {"name": "get_time"}},
                                      parallel_tool_calls=False, max_tokens=60)
    for choice in r.choices:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_time" and isinstance(call.function.parsed_arguments, GetTime)


def test_tool_choice_none_answers_in_text(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=12,
                                       temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == plain.choices[0].message.content and not r.choices[0].message.tool_calls


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
