"""`/v1/messages` over the chat path: Anthropic's request in, a Message or its event stream out.

A Messages request is a chat request spelled differently, as a Responses request is: its
system blocks become the system turn, tool_use blocks an assistant turn's tool calls and
tool_result blocks tool turns; its tools and tool_choice become chat's, on the same
constrained decoding. The answer's text is split into thinking, text and tool_use blocks
by the server's reasoning and tool-call parsers. So admission, deadlines, metrics,
tracing and errors are the chat route's; errors are renamed to the fields the client sent.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import ValidationError

from engine.serving.anthropic.protocol import (
    CountTokensRequest, Message, MessagesRequest, MessagesResponse, OutText, OutThinking, OutToolUse, TokenCount,
    ToolChoice, ToolDef,
)
from engine.serving.anthropic.outcome import stop_reason, usage_of
from engine.serving.anthropic.stream import stream_message
from engine.serving.errors import APIError, bad_request, renamed
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import (
    ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, FunctionName, NamedToolChoice, TextPart, Tool,
    ToolCall,
)
from engine.serving.openai.streams import Choice, collect
from engine.serving.tools import calls as tools_mod

# engine field names -> the Messages request's own (its max_tokens is the chat request's)
NAMES = {"prompt": "messages", "stop": "stop_sequences"}
# chat request fields -> the Messages request's own, for errors the chat route raises
RENAME = {"stop": "stop_sequences"}


async def create(serving: OpenAIServing, req: MessagesRequest) -> MessagesResponse | AsyncIterator[str]:
    if req.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {req.max_tokens}", "max_tokens")
    budget = req.thinking.budget_tokens if req.thinking is not None else None
    thinking = req.thinking is not None and req.thinking.type == "enabled"
    if thinking and budget is not None and not 0 < budget < req.max_tokens:
        raise bad_request("thinking.budget_tokens must be positive and less than max_tokens (the think block "
                          "and the answer share max_tokens here)", "thinking.budget_tokens")
    chat = chat_request(req)
    try:
        _, (first, gen), tools = await serving.start_chat(chat, dict(NAMES))
    except APIError as exc:
        raise renamed(exc, RENAME) from None
    if req.stream:
        return stream_message(serving, first, gen, tools, thinking)
    choice = Choice()
    last = await collect([(first, gen)], [choice], 0, 1)
    reasoning, text, calls = serving.split(choice.text, tools)
    msg = MessagesResponse(model=serving.model_name, usage=usage_of(last))
    if reasoning is not None and thinking:
        msg.content.append(OutThinking(thinking=reasoning))
    if text or not calls:
        msg.content.append(OutText(text=text))
    for c in calls:
        args = tool_input(c.function.arguments)
        msg.content.append(OutToolUse(id=c.id, name=c.function.name, input=args) if args is not None
                           else OutText(text=c.function.arguments))
    msg.stop_reason, msg.stop_sequence = stop_reason(choice, bool(calls))
    return msg


async def count_tokens(serving: OpenAIServing, req: CountTokensRequest) -> TokenCount:
    """The prompt's length as the engine would see it: the chat template over the same
    turns and tools a Messages request with these fields renders."""
    serving.check_model(req.model)
    full = MessagesRequest(model=req.model, max_tokens=1, messages=req.messages, system=req.system, tools=req.tools,
                           tool_choice=req.tool_choice, thinking=req.thinking)
    chat = chat_request(full)
    try:
        tools = tools_mod.active_tools(chat.tools, chat.tool_choice)
        ids = await serving.chat_prompt_async(chat.messages, True, tools)
    except APIError as exc:
        raise renamed(exc, RENAME) from None
    return TokenCount(input_tokens=len(ids))


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request this Messages request is. Every field was type-checked as the
    Messages body; what chat's own rules still refuse is a 400 naming the chat field,
    renamed to the client's."""
    messages = [ChatMessage(role="system", content=_system(req.system))] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _turn(m, i)
    choice, parallel = _tool_choice(req.tool_choice, req.tools)
    try:
        return ChatCompletionRequest(
            model=req.model, messages=messages, max_tokens=req.max_tokens, stream=req.stream,
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences,
            tools=[_tool(t) for t in req.tools] if req.tools else None, tool_choice=choice,
            parallel_tool_calls=parallel,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(part) for part in err["loc"]) or "messages"
        raise renamed(bad_request(f"{field}: {err['msg']}", field), RENAME) from None


def _system(system: str | list) -> str | list[TextPart]:
    return system if isinstance(system, str) else [TextPart(type="text", text=b.text) for b in system]


def _turn(m: Message, i: int) -> list[ChatMessage]:
    """One Anthropic turn as chat turns: its tool results first (each a tool turn, as chat
    templates expect them right after the call), then its text and calls."""
    if isinstance(m.content, str):
        return [ChatMessage(role=m.role, content=m.content)]
    out: list[ChatMessage] = []
    texts: list[TextPart] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if block.type in ("image", "document"):
            raise bad_request(f"{where} is an {block.type} block: this server serves a text-only model", where)
        if block.type == "text":
            texts.append(TextPart(type="text", text=block.text))
        elif block.type == "tool_use":
            if m.role != "assistant":
                raise bad_request(f"{where}: tool_use blocks belong in assistant turns", where)
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                     arguments=json.dumps(block.input))))
        elif block.type == "tool_result":
            if m.role != "user":
                raise bad_request(f"{where}: tool_result blocks belong in user turns", where)
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=_result(block, where)))
        # thinking blocks a client sends back are the model's earlier reasoning: as on the
        # chat and Responses routes, it does not go back into the prompt.
    if calls:
        out.append(ChatMessage(role="assistant", content=texts or None, tool_calls=calls))
    elif texts or not out:
        out.append(ChatMessage(role=m.role, content=texts))
    return out


def _result(block, where: str) -> str:
    """A tool result's text; `is_error` says so in the text, the only way the model can tell."""
    content = block.content
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.type == "image":
                raise bad_request(f"{where}.content[{k}] is an image block: this server serves a text-only model",
                                  f"{where}.content[{k}]")
        content = "\n".join(part.text for part in content)
    text = content or ""
    return f"Error: {text}" if block.is_error else text


def _tool(t: ToolDef) -> Tool:
    return Tool(type="function", function=FunctionDef(name=t.name, description=t.description, parameters=t.input_schema))


def _tool_choice(choice: ToolChoice | None, tools: list[ToolDef] | None) -> tuple[object, bool | None]:
    """Anthropic's tool_choice as chat's, and whether more than one call may come."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs the tool's name", "tool_choice.name")
        if choice.name not in {t.name for t in tools or []}:
            raise bad_request(f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice.name")
        return NamedToolChoice(type="function", function=FunctionName(name=choice.name)), parallel
    if choice.name is not None:
        raise bad_request(f"tool_choice.name applies only to type tool, not {choice.type}", "tool_choice.name")
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def tool_input(arguments: str) -> dict | None:
    """A call's arguments as the object Anthropic's tool_use block holds (an empty text is
    no arguments), or None where they are not a JSON object: the parsers count a call only
    once its JSON is whole, so this is a guard, and such text is answered as text."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
