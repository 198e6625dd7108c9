"""The Messages API's translation to the chat path, without a model: turns and blocks to chat
turns, tool_choice to chat's, a choice's end to Anthropic's stop_reason, and errors in
Anthropic's shape with the field leading the message."""

from __future__ import annotations

import pytest

from engine.serving.anthropic.handler import chat_request, tool_input
from engine.serving.anthropic.outcome import stop_reason
from engine.serving.anthropic.protocol import MessagesRequest
from engine.serving.errors import APIError, anthropic_body, bad_request
from engine.serving.openai.streams import Choice

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **fields})


def test_blocks_become_chat_turns_with_tool_calls_and_results():
    chat = chat_request(request(system=[{"type": "text", "text": "Be brief."}], tools=[TOOL], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should look it up.", "signature": "x"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
            {"type": "text", "text": "Thanks!"}]},
    ]))
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = chat.messages[2]
    assert [p.text for p in assistant.content] == ["Let me check."]  # the thinking does not go back in
    assert assistant.tool_calls[0].id == "toolu_1" and assistant.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert (chat.messages[3].tool_call_id, chat.messages[3].content) == ("toolu_1", "Sunny")
    assert chat.messages[4].content == "Error: no such city"  # is_error reaches the model in the text
    assert chat.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize(("choice", "want"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
])
def test_tool_choice_maps_to_chats(choice, want):
    chat = chat_request(request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice=choice))
    assert chat.tool_choice == want and chat.parallel_tool_calls is True  # chat's default: several calls may come
    named = chat_request(request(messages=[{"role": "user", "content": "hi"}], tools=[TOOL], tool_choice={
        "type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}))
    assert named.tool_choice.function.name == "get_weather" and named.parallel_tool_calls is False


@pytest.mark.parametrize(("messages", "tool_choice", "field"), [
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}], None,
     "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}], None, "messages[0].content[0].content[0]"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}], None,
     "messages[0].content[0]"),
    ([{"role": "user", "content": "hi"}], {"type": "tool", "name": "other"}, "tool_choice.name"),
    ([{"role": "user", "content": "hi"}], {"type": "tool"}, "tool_choice.name"),
    ([{"role": "user", "content": "hi"}], {"type": "auto", "name": "get_weather"}, "tool_choice.name"),
])
def test_what_cannot_be_served_is_a_400_naming_where(messages, tool_choice, field):
    with pytest.raises(APIError) as err:
        chat_request(request(messages=messages, tools=[TOOL], tool_choice=tool_choice))
    assert err.value.status == 400 and err.value.detail.param == field


def test_stop_reasons_and_tool_input():
    assert stop_reason(Choice(finish_reason="stop"), called=True) == ("tool_use", None)
    assert stop_reason(Choice(finish_reason="length"), called=False) == ("max_tokens", None)
    assert stop_reason(Choice(finish_reason="stop", stop_reason="\n\n"), called=False) == ("stop_sequence", "\n\n")
    assert stop_reason(Choice(finish_reason="stop", stop_reason=2), called=False) == ("end_turn", None)
    assert tool_input("") == {} and tool_input('{"city": "Paris"}') == {"city": "Paris"}
    assert tool_input('{"city": "Par') is None and tool_input("[1]") is None


def test_errors_take_anthropics_shape_with_the_field_first():
    body = anthropic_body(bad_request("must be at least 1", "max_tokens"))
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                                "message": "max_tokens: must be at least 1"}}
    assert anthropic_body(APIError(429, "busy", "rate_limit_error"))["error"]["type"] == "rate_limit_error"
    assert anthropic_body(APIError(503, "down", "server_error"))["error"]["type"] == "overloaded_error"
    assert anthropic_body(APIError(500, "oops", "server_error"))["error"]["type"] == "api_error"


def test_a_streamed_think_block_and_call_are_thinking_text_and_tool_use_blocks_in_order():
    """The stream on text a Qwen3-style reasoning model writes, cut into odd pieces: a
    thinking block (its deltas, then its signature), a text block, a tool_use block whose
    input_json_delta parts join to the call's arguments; then message_delta says tool_use."""
    import asyncio
    import json

    from engine.client.async_llm import StreamOutput
    from engine.messages import CompletionDelta
    from engine.serving.anthropic.stream import stream_message
    from engine.serving.openai.protocol import Tool
    from engine.serving.tools.calls import Splitter

    text = ('<think>The user wants the weather.</think>\n\nLet me look.<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    outs = [StreamOutput("r", [1, 2, 3], [CompletionDelta(0, p, [5], None, "stop" if k == len(pieces) - 1 else None)],
                         k == len(pieces) - 1, k + 1) for k, p in enumerate(pieces)]
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": TOOL[
        "input_schema"]}})]

    class Serving:  # what the stream asks of OpenAIServing
        model_name = "m"

        def splitter(self, tools, stream=False):
            return Splitter(tools, "hermes", "qwen3", stream)

    async def collect() -> list[dict]:
        async def rest():
            for out in outs[1:]:
                yield out
        return [json.loads(e.split("data: ", 1)[1]) async for e in
                stream_message(Serving(), outs[0], rest(), tools, thinking=True)]

    events = asyncio.run(collect())
    kinds = [e["type"] for e in events]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "The user wants the weather."
    assert "".join(d.get("text", "") for d in deltas).strip() == "Let me look."
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == {"city": "Paris"}
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use" and events[-2]["usage"]["output_tokens"] == len(pieces)
