"""`/v1/responses` over the chat path: items in, a Response or its typed stream events out.

A Responses request is a chat request spelled differently: its items become chat
messages (function calls folded into the assistant turn that made them, their outputs
into tool turns), its function tools and `text.format` become chat's tools and
response_format, and the answer's text is split into a message item and function_call
items by the same parser. So tools, grammars, penalties and errors behave exactly as on
/v1/chat/completions; errors are renamed to the Responses fields the client sent.

With `store` (OpenAI's default) the response and the conversation that led to it are
kept (response_store.py), so a later request can continue it by previous_response_id.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import TypeAdapter

from engine.client.async_llm import StreamOutput
from engine.messages import TokenLogprobs
from engine.serving import jsontext
from engine.serving.errors import APIError, bad_request, renamed
from engine.serving.openai.handlers import OpenAIServing
from engine.serving.openai.protocol import (
    ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDef, FunctionName, JSONSchemaFormat, NamedToolChoice,
    ResponseFormat, Tool, ToolCall,
)
from engine.serving.openai.streams import Choice, absorb, chain, collect, usage
from engine.serving.responses.protocol import (
    FunctionCallItem, FunctionCallOutputItem, IncompleteDetails, InputTokensDetails, MessageItem,
    OutputFunctionCall, OutputMessage, OutputReasoning, OutputText, ReasoningItem, ReasoningText, Response,
    ResponseDeleted, ResponsesRequest, ResponseUsage,
)
from engine.serving.tenancy import TENANT

# engine and chat field names -> the Responses request's own
NAMES = {"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
RENAME = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
# A stored conversation is kept as JSON (response_store.py), whose memory the store's bound
# on bytes measures; as pydantic objects it took more than its text, unmeasured there.
CONVERSATION = TypeAdapter(list[Item])


async def create(serving: OpenAIServing, req: ResponsesRequest) -> Response | AsyncIterator[str]:
    if req.background:
        raise bad_request("background responses are not supported here: send the request without it (and "
                          "stream: true to see the answer as it is generated)", "background")
    history: list[Item] = []
    if req.previous_response_id is not None:
        prev = serving.store.get(req.previous_response_id, TENANT.get())
        if prev is None:
            raise APIError(404, f"no stored response `{req.previous_response_id}`: it was never stored "
                           "(store: false), was deleted or evicted, or lives on another replica",
                           "invalid_request_error", "previous_response_id", "previous_response_not_found")
        history = CONVERSATION.validate_json(prev.conversation)
    items: list[Item] = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else list(req.input)
    conversation = history + items
    chat = _chat_request(req, conversation, len(history))
    try:
        _, (first, gen), tools = await serving.start_chat(chat, dict(NAMES))
    except APIError as exc:
        raise renamed(exc, RENAME, frozenset({"messages"})) from None
    resp = Response(model=serving.model_name, status="in_progress", **_echo(req))
    if req.stream:
        return _stream(serving, req, resp, first, gen, tools, conversation)
    choice = Choice()
    last = await collect([(first, gen)], [choice], 0, 1)
    reasoning, text, calls = serving.split(choice.text, tools)
    if reasoning is not None:
        resp.output.append(OutputReasoning(content=[ReasoningText(text=reasoning)]))
    if text or not calls:
        lps = _logprobs(serving, choice.logprobs) if _wants_logprobs(req) else []
        resp.output.append(OutputMessage(content=[OutputText(text=text, logprobs=lps)]))
    resp.output += [OutputFunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments)
                    for c in calls]
    _finish(resp, choice.finish_reason, last)
    _keep(serving, req, resp, conversation)
    return resp


def get(serving: OpenAIServing, rid: str) -> str:
    stored = serving.store.get(rid, TENANT.get())
    if stored is None:
        raise _not_found(rid)
    return stored.response


def delete(serving: OpenAIServing, rid: str) -> ResponseDeleted:
    if not serving.store.delete(rid, TENANT.get()):
        raise _not_found(rid)
    return ResponseDeleted(id=rid)


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no stored response `{rid}`", "invalid_request_error", "response_id", "not_found")


def _chat_request(req: ResponsesRequest, items: list[Item], skip: int) -> ChatCompletionRequest:
    if req.reasoning is not None and req.reasoning.summary is not None:
        raise bad_request("this model gives no reasoning to summarize", "reasoning.summary")
    fmt, response_format = req.text.format if req.text else None, None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or fmt.name is None:
            raise bad_request("a json_schema format needs `name` and `schema`", "text.format")
        response_format = ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description))
    elif fmt is not None and fmt.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    choice = req.tool_choice
    return ChatCompletionRequest(
        model=req.model, messages=_messages(items, req.instructions, skip), stream=req.stream,
        max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        logprobs=_wants_logprobs(req), top_logprobs=req.top_logprobs,
        tools=[Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict))
               for t in req.tools] if req.tools else None,
        tool_choice=NamedToolChoice(type="function", function=FunctionName(name=choice.name))
        if choice is not None and not isinstance(choice, str) else choice,
        parallel_tool_calls=req.parallel_tool_calls, response_format=response_format)


def _messages(items: list[Item], instructions: str | None, skip: int) -> list[ChatMessage]:
    """Chat messages for the items; the first `skip` came from the stored conversation."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    for i, item in enumerate(items):
        where = f"input[{i - skip}]" if i >= skip else "previous_response_id"
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            jsontext.loads(item.arguments, f"{where}.arguments", "arguments")
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant":  # calls belong to the turn that made them
                out[-1] = out[-1].model_copy(update={"tool_calls": [*(out[-1].tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        # a ReasoningItem is left out of the prompt, as templates leave out earlier turns' reasoning
    if not out:
        raise bad_request("input must hold at least one item", "input")
    return out


def _wants_logprobs(req: ResponsesRequest) -> bool:
    return req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or [])


def _logprobs(serving: OpenAIServing, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """Tokens' logprobs in the Responses shape, which is chat's: token, logprob, bytes, top_logprobs."""
    return [x.model_dump() for x in serving.logprobs.chat(lps).content or []] if lps else []


def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as a Response repeats them."""
    tc = req.tool_choice
    return {
        "instructions": req.instructions, "parallel_tool_calls": req.parallel_tool_calls,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": "auto" if tc is None else tc if isinstance(tc, str) else tc.model_dump(),
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store, "metadata": req.metadata or {},
        "user": req.user,
        "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
        if req.text and req.text.format else {"format": {"type": "text"}},
    }


def _finish(resp: Response, finish_reason: str | None, last: StreamOutput) -> None:
    if finish_reason == "length":
        resp.status, resp.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
        for item in resp.output:
            item.status = "incomplete"
    else:
        resp.status = "completed"
    u = usage([last])
    resp.usage = ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                               total_tokens=u.total_tokens, input_tokens_details=InputTokensDetails(
                                   cached_tokens=u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details
                                   else 0))


def _keep(serving: OpenAIServing, req: ResponsesRequest, resp: Response, conversation: list[Item]) -> None:
    if not req.store:
        return
    out: list[Item] = []
    for item in resp.output:
        if isinstance(item, OutputMessage):
            out.append(MessageItem(role="assistant", content="".join(p.text for p in item.content), id=item.id))
        elif isinstance(item, OutputFunctionCall):
            out.append(FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name,
                                        arguments=item.arguments, id=item.id))
    # Reasoning items a client echoed back never reach a prompt: kept, they were stored data
    # that no bound on the prompt's length bounded (24 times the prompt was measured).
    rendered = [i for i in conversation if not isinstance(i, ReasoningItem)]
    serving.store.put(resp.id, resp.model_dump_json(), CONVERSATION.dump_json(rendered + out), TENANT.get())


async def _stream(serving: OpenAIServing, req: ResponsesRequest, resp: Response, first: StreamOutput,
                  gen: AsyncIterator[StreamOutput], tools: list[Tool], conversation: list[Item]
                  ) -> AsyncIterator[str]:
    """OpenAI's event sequence: created, in_progress, then per output item added, its
    deltas, done, and completed (or incomplete) with the whole response."""
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def snapshot() -> dict[str, Any]:
        return resp.model_dump(mode="json")

    splitter = serving.splitter(tools, stream=True)
    fcs: dict[int, OutputFunctionCall] = {}  # by call index, as they stream
    choice = Choice()
    msg: OutputMessage | None = None
    parts: list[str] = []
    rs: OutputReasoning | None = None
    thoughts: list[str] = []
    want_lps = _wants_logprobs(req)
    pending: list[dict[str, Any]] = []  # tokens' logprobs not yet sent with a text delta
    msg_lps: list[dict[str, Any]] = []

    def close_reasoning() -> list[str]:
        nonlocal rs
        if rs is None:
            return []
        idx, text = resp.output.index(rs), "".join(thoughts)
        rs.content, rs.status = [ReasoningText(text=text)], "completed"
        events = [event("response.reasoning_text.done", item_id=rs.id, output_index=idx, content_index=0, text=text),
                  event("response.output_item.done", output_index=idx, item=rs.model_dump(mode="json"))]
        rs = None
        return events

    def close_message(status: str) -> list[str]:
        nonlocal msg
        if msg is None:
            return []
        idx, text = resp.output.index(msg), "".join(parts)
        msg.content, msg.status = [OutputText(text=text, logprobs=msg_lps[:])], status  # type: ignore[assignment]
        part = msg.content[0].model_dump(mode="json")
        events = [event("response.output_text.done", item_id=msg.id, output_index=idx, content_index=0, text=text,
                        logprobs=msg_lps[:]),
                  event("response.content_part.done", item_id=msg.id, output_index=idx, content_index=0, part=part),
                  event("response.output_item.done", output_index=idx, item=msg.model_dump(mode="json"))]
        msg = None
        parts.clear()
        msg_lps.clear()
        return events

    try:
        yield event("response.created", response=snapshot())
        yield event("response.in_progress", response=snapshot())
        last = first
        async for last in chain(first, gen):
            for d in last.deltas:
                absorb(choice, d)
                if want_lps:
                    pending += _logprobs(serving, d.logprobs or [])
                reasoning, text, calls = splitter.feed(d.text, final=d.finish_reason is not None)
                if reasoning:
                    if rs is None:
                        rs = OutputReasoning(status="in_progress")
                        resp.output.append(rs)
                        yield event("response.output_item.added", output_index=len(resp.output) - 1,
                                    item=rs.model_dump(mode="json"))
                    thoughts.append(reasoning)
                    yield event("response.reasoning_text.delta", item_id=rs.id, output_index=resp.output.index(rs),
                                content_index=0, delta=reasoning)
                if text or calls:
                    for e in close_reasoning():
                        yield e
                if text:
                    if msg is None:
                        msg = OutputMessage(status="in_progress")
                        resp.output.append(msg)
                        idx = len(resp.output) - 1
                        yield event("response.output_item.added", output_index=idx, item=msg.model_dump(mode="json"))
                        yield event("response.content_part.added", item_id=msg.id, output_index=idx, content_index=0,
                                    part=OutputText(text="").model_dump(mode="json"))
                    parts.append(text)
                    msg_lps += pending
                    yield event("response.output_text.delta", item_id=msg.id, output_index=resp.output.index(msg),
                                content_index=0, delta=text, logprobs=pending)
                    pending = []
                for c in calls:  # a call's parts: opened, its arguments as they come, done
                    if c.id is not None:
                        for e in close_message("completed"):
                            yield e
                        fcs[c.index] = OutputFunctionCall(call_id=c.id, name=c.name or "", arguments="",
                                                          status="in_progress")
                        resp.output.append(fcs[c.index])
                        yield event("response.output_item.added", output_index=len(resp.output) - 1,
                                    item=fcs[c.index].model_dump(mode="json"))
                    fc = fcs[c.index]
                    idx = resp.output.index(fc)
                    if c.arguments:
                        fc.arguments += c.arguments
                        yield event("response.function_call_arguments.delta", item_id=fc.id, output_index=idx,
                                    delta=c.arguments)
                    if c.done:
                        fc.status = "incomplete" if d.finish_reason == "length" else "completed"
                        yield event("response.function_call_arguments.done", item_id=fc.id, output_index=idx,
                                    name=fc.name, arguments=fc.arguments)
                        yield event("response.output_item.done", output_index=idx, item=fc.model_dump(mode="json"))
        for e in close_reasoning():
            yield e
        if msg is None and not any(isinstance(o, (OutputMessage, OutputFunctionCall)) for o in resp.output):
            # an empty answer is still one message
            msg = OutputMessage(status="in_progress")
            resp.output.append(msg)
            yield event("response.output_item.added", output_index=len(resp.output) - 1,
                        item=msg.model_dump(mode="json"))
        for e in close_message("incomplete" if choice.finish_reason == "length" else "completed"):
            yield e
        _finish(resp, choice.finish_reason, last)
        _keep(serving, req, resp, conversation)
        yield event("response.incomplete" if resp.status == "incomplete" else "response.completed",
                    response=snapshot())
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
