"""The Anthropic Messages API with the official `anthropic` SDK, unchanged, against the
session's `bentoml serve` (tests/support/server.py): the same engine path as chat, so a
greedy answer equals the chat route's; streamed events in Anthropic's order; stop
sequences; forced tool use and its tool_result round trip; count_tokens; and errors in
Anthropic's shape, naming the field."""

from __future__ import annotations

import json

import anthropic
import httpx
import httpx2
import pytest

from tests.support.server import KEY, MODEL

pytestmark = pytest.mark.timeout(600)

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the current SDK sends sampling fields through extra_body
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    # A connection per request (tests/support/server.py NO_KEEPALIVE says why), through the
    # SDK's own HTTP package: anthropic 2.x runs on httpx2, not httpx.
    fresh = anthropic.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=180, http_client=fresh)


def chat_text(client, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_a_greedy_message_with_system_blocks_is_the_chat_routes_answer(claude, client):
    system = "Answer in one short sentence."
    msg = claude.messages.create(model=MODEL, max_tokens=16, messages=ASK, extra_body=GREEDY,
                                 system=[{"type": "text", "text": system}])
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": system}, *ASK], 16)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt_tokens
    assert 0 < msg.usage.output_tokens <= 16


def test_a_stream_comes_in_anthropics_order_and_equals_the_whole_answer(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [k for k in kinds if k not in ("text", "input_json", "thinking", "signature")]  # the SDK's own helpers
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_answer_and_is_named(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY).content[0].text
    word = whole.split()[2]  # a word the greedy answer reaches
    msg = claude.messages.create(model=MODEL, max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=[word])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == word
    assert msg.content[0].text == whole[:whole.index(word)]


def test_forced_tool_use_round_trips_its_result_and_streams_the_same_input(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(model=MODEL, max_tokens=64, messages=ask, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    msg = claude.messages.create(**forced)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and isinstance(call.input["city"], str) and len(call.input["city"]) <= 24
    with claude.messages.stream(**forced) as stream:
        parts = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                 and e.delta.type == "input_json_delta"]
    assert json.loads("".join(parts)) == call.input  # the streamed pieces join to the same input
    answer = claude.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]}])
    assert answer.content and answer.content[0].type in ("text", "tool_use")


def test_count_tokens_is_what_the_message_uses(claude, http):
    counted = claude.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    used = claude.messages.create(model=MODEL, max_tokens=2, messages=ASK, system="Be brief.").usage
    assert counted.input_tokens == used.input_tokens + used.cache_read_input_tokens
    tokenized = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."}, *ASK]}).json()
    assert counted.input_tokens == tokenized["count"]


@pytest.mark.parametrize(("body", "field"), [
    ({"model": MODEL, "messages": ASK}, "max_tokens"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "messages[0].content[0]"),
    ({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages[0].content[0]"),
    ({"model": MODEL, "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "tool", "name": "nope"},
      "tools": [WEATHER]}, "tool_choice.name"),
    ({"model": "no-such-model", "max_tokens": 4, "messages": ASK}, "model"),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, field):
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    err = r.json()
    assert r.status_code in (400, 404), r.text
    assert err["type"] == "error" and err["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert field in err["error"]["message"], err


def test_the_sdk_raises_its_own_errors_and_a_wrong_key_is_refused(claude, server):
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert "max_tokens" in bad.value.message
    wrong = anthropic.Anthropic(base_url=server.url, api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"
    assert claude.messages.create(model=MODEL, max_tokens=2, messages=ASK).content  # the server carries on
