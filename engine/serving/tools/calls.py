"""Tool calling: tools into the prompt, calls out of the generated text.

Calls use the Hermes format that Qwen2.5/3, Hermes and many fine-tunes are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template renders `tools` gets them through its template. Other
templates (SmolLM2's, for one) get DEFAULT_PROMPT as a system message, assistant turns
that called tools rendered as the calls' text, and tool results as user turns wrapped
in <tool_response> tags, so the conversation reads the same way a tool-trained model
would see it.

`tool_choice="required"` and a named function become an xgrammar structural tag: the
output is one or more calls and nothing else, each naming an offered function (the named
one) with arguments that follow its JSON schema, so a forced call always parses. With
`auto` the model decides and the text is parsed (a `strict` function makes any call the
model begins follow the grammar too); a block that does not parse, or names a function
that is not in `tools`, stays in `content` rather than becoming a call the client
cannot dispatch. Streamed, a call's arguments go out as they are written (CallParser;
tool_formats.JsonCallStream for the other JSON formats).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from engine.sampling_params import Constraint
from engine.serving import jsontext
from engine.serving.errors import bad_request
from engine.serving.openai.protocol import ChatMessage, FunctionCall, NamedToolChoice, Tool, ToolCall, ToolChoice
from engine.serving.reasoning import ReasoningParser, ReasoningParserName
from engine.serving.tools import pythonic_grammar
from engine.serving.tools.argstream import ArgStream
from engine.serving.tools.formats import (CALL_HEAD, COHERE_END, COHERE_TAG, FORMATS, GRANITE_TAG, MISTRAL_TAG, Call,
                                         CallDelta, TailParser, detect, fold, make_call, new_call_id, partial_suffix,
                                         streamed_name)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# How a Hermes block opens when it is a call whose arguments can stream: the name first, then the arguments.
HEADER = re.compile(r"\s*" + CALL_HEAD)

DEFAULT_PROMPT = """You can call functions to help answer. Each function is described by a JSON object on its own line:
{tools}

To call a function, reply with {how}, for example:
{example}
Each result comes back inside <tool_response></tool_response> tags. Answer in plain text when no function is needed."""
HOW = {"hermes": "its name and arguments as one JSON object inside <tool_call></tool_call> tags, one block per call",
       "llama3_json": "only its name and parameters as one JSON object, calls separated by \"; \"",
       "mistral": "[TOOL_CALLS] and then a JSON list of the calls, each with its name and arguments",
       "granite": "<|tool_call|> and then a JSON list of the calls, each with its name and arguments",
       "command_r": "<|START_ACTION|>, a JSON list of the calls, each with its tool_call_id, tool_name and "
                    "parameters, and then <|END_ACTION|>",
       "pythonic": "only a Python list of the calls, with keyword arguments",
       "qwen3_xml": "a <tool_call> block per call: <function=its name>, then each argument as "
                    "<parameter=its name> with the value on its own line, then </parameter>",
       "glm45": "a <tool_call> block per call: its name, then each argument as <arg_key>its name</arg_key> "
                "and <arg_value>its value</arg_value>"}

Conversation = list[dict[str, Any]]


def _template(tokenizer: Any) -> str | None:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        tpl = tpl.get("tool_use") or tpl.get("default")
    return tpl if isinstance(tpl, str) else None


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders a `tools` list itself."""
    return "tools" in (_template(tokenizer) or "")


def template_format(tokenizer: Any) -> str:
    """The call format the chat template teaches (tool_formats.detect)."""
    return detect(_template(tokenizer))


def active_tools(tools: list[Tool] | None, choice: ToolChoice | None) -> list[Tool]:
    """The tools the model may call under this choice; 400s for a choice that cannot hold."""
    tools = tools or []
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return []
    if not tools:
        raise bad_request(f"tool_choice {_choice_name(choice)} needs a non-empty `tools` list", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise bad_request(f"tool_choice names function `{choice.function.name}`, which is not in `tools` ("
                              + ", ".join(t.function.name for t in tools) + ")", "tool_choice")
        return named
    return tools


def _choice_name(choice: ToolChoice) -> str:
    return f"`{choice}`" if isinstance(choice, str) else f"function `{choice.function.name}`"


def render(messages: Sequence[ChatMessage], tools: list[Tool], native: bool,
           fmt: str = "hermes") -> tuple[Conversation, list | None]:
    """The conversation for apply_chat_template and the `tools` to pass it (native templates only)."""
    conv: Conversation = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls is not None and role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
        if role == "tool" and not m.tool_call_id:
            raise bad_request("a tool message needs the tool_call_id it answers", f"messages[{i}].tool_call_id")
        calls = [(c.id, c.function.name, _arguments(c.function, f"messages[{i}].tool_calls[{j}].function.arguments"))
                 for j, c in enumerate(m.tool_calls or [])]
        if native:
            msg: dict[str, Any] = {"role": role, "content": m.text()}
            if calls:
                msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                     for cid, name, args in calls]
            if role == "tool":
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None and role == "assistant":
                msg["reasoning_content"] = m.reasoning_content  # for templates that render it
            conv.append(msg)
        elif role == "tool":
            conv.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
        else:
            written = [write_calls([(name, args) for _, name, args in calls], fmt)] if calls else []
            text = "\n".join([m.text()] * bool(m.text()) + written)
            conv.append({"role": role, "content": text})
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if native:
        return conv, specs or None
    if specs:
        prompt = DEFAULT_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in specs),
                                       how=HOW[fmt], example=write_calls([("function_name", {"argument": "value"})],
                                                                         fmt))
        if conv and conv[0]["role"] == "system":
            conv[0] = {"role": "system", "content": prompt + "\n\n" + conv[0]["content"]}
        else:
            conv.insert(0, {"role": "system", "content": prompt})
    return conv, None


def _arguments(fn: FunctionCall, field: str) -> Any:
    return jsontext.loads(fn.arguments, field, "arguments")


def write_calls(calls: list[Call], fmt: str) -> str:
    """Calls as a model trained on `fmt` writes them (earlier turns, the default prompt's example)."""
    if fmt != "hermes":
        return FORMATS[fmt].render(calls)
    return "\n".join(f"{OPEN}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + f"\n{CLOSE}"
                     for n, a in calls)


def marker_is_special(tokenizer: Any, fmt: str) -> bool:
    """Whether a tag that marks this format's calls is one special token of the tokenizer
    (Mistral's [TOOL_CALLS], Granite's <|tool_call|>): decoding with the default
    skip_special_tokens would drop it from the text and leave the calls unparsable."""
    tags = (OPEN, CLOSE) if fmt == "hermes" else tuple(m for m in FORMATS[fmt].markers if len(m) > 1)
    for tag in tags:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            return True
    return False


# A call's grammar per format: what opens a call to `name` (its arguments follow as JSON),
# what closes it, what separates calls, and (under auto with a strict function) the text
# that, once the model writes it, begins a call the grammar then holds to the schema.
GRAMMAR = {
    "hermes": (lambda name: f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": ', "}\n" + CLOSE, "\n", OPEN),
    "llama3_json": (lambda name: f'{{"name": {json.dumps(name)}, "parameters": ', "}", "; ", '{"name"'),
    # a tag, then a one-call JSON list: Mistral's [TOOL_CALLS], Granite's <|tool_call|>
    **{fmt: (lambda name, tag=tag: f'{tag}[{{"name": {json.dumps(name)}, "arguments": ', "}]", "", tag)
       for fmt, tag in (("mistral", MISTRAL_TAG), ("granite", GRANITE_TAG))},
    # Command R's one-call list, closed by its end tag
    "command_r": (lambda name: f'{COHERE_TAG}[{{"tool_call_id": "0", "tool_name": {json.dumps(name)}, "parameters": ',
                  "}]" + COHERE_END, "", COHERE_TAG),
    # tagged text, each argument held to its schema by xgrammar's style for the format (STYLE)
    "qwen3_xml": (lambda name: f"{OPEN}\n<function={name}>\n", "\n</function>\n" + CLOSE, "\n", OPEN),
    "glm45": (lambda name: f"{OPEN}{name}", CLOSE, "\n", OPEN),
}
STYLE = {"qwen3_xml": "qwen_xml", "glm45": "glm_xml"}


def constraint(tools: list[Tool], choice: ToolChoice | None, parallel: bool,
               fmt: str = "hermes", offered: list[Tool] | None = None) -> Constraint | None:
    """The grammar a tool choice needs, as an xgrammar structural tag, or None.

    `required`: one or more calls (one without parallel calls) and nothing else, each
    naming an offered function with arguments that follow its schema. A named function:
    exactly one call to it, as vLLM forces it (a small model would otherwise repeat the
    call until max_tokens). `auto` with a `strict` function: free text, but a call, once
    begun, must be whole and valid. Otherwise the model is free and its text is parsed.
    `offered` is the request's whole `tools` list, for errors that point into it.
    """
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if not tools or not (forced or any(t.function.strict for t in tools)):
        return None
    if fmt == "pythonic":  # Python literals, not JSON: a grammar of its own (pythonic_grammar.py)
        if not forced:
            return None  # strict under auto: the calls are parsed, not constrained
        single = not parallel or isinstance(choice, NamedToolChoice)
        return Constraint("grammar", pythonic_grammar.grammar(tools, not single, offered))
    begin, end, separator, trigger = GRAMMAR[fmt]
    style = {"style": STYLE[fmt]} if fmt in STYLE else {}
    tags = [{"type": "tag", "begin": begin(t.function.name),
             "content": {"type": "json_schema", "json_schema": t.function.parameters or {"type": "object"},
                         "max_whitespace_cnt": 4, **style},  # room for indentation, none for endless blank lines
             "end": end} for t in tools]
    if forced:
        spec = {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
                "stop_after_first": not parallel or isinstance(choice, NamedToolChoice)}
    else:
        spec = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": not parallel}
    return Constraint("structural_tag", json.dumps({"type": "structural_tag", "format": spec}))


class CallParser:
    """Splits generated text into content and tool calls as it arrives.

    `feed` returns the content that can be shown now and the calls' parts settled now. Text
    that may be the start of a <tool_call> tag is held back until it is decided, and
    whitespace is held until something follows it, so the gaps between calls are not
    sent as content. A plain-text answer comes out unchanged.

    Whole, a block becomes a call only if it parses. With `stream`, a block that opens as
    a call to an offered function (`{"name": ..., "arguments": {`) is a call from there
    on and its arguments stream as they are written (engine/serving/tools/argstream.py); for a
    valid call the parts join to exactly the whole call's arguments. A streamed call that
    breaks off (max_tokens) or stops being JSON keeps the arguments sent so far, as
    OpenAI's API does; a block that opens otherwise is parsed whole at its end.
    """

    def __init__(self, tools: list[Tool], stream: bool = False) -> None:
        self.names = {t.function.name for t in tools}
        self.stream = stream
        self.buf = ""
        self.blank = ""  # whitespace waiting to see what follows it
        self.in_call = False
        self.args: ArgStream | None = None  # the streaming call's arguments
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.buf += text
        out: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if self.in_call and self.stream and self.args is None:
                self._begin(calls)
            if self.args is not None:
                end = self.buf.find(CLOSE)
                cut = end if end >= 0 else len(self.buf) - partial_suffix(self.buf, CLOSE)
                more = self.args.feed(self.buf[:cut], final=end >= 0)
                if more:
                    calls.append(CallDelta(self.calls - 1, more))
                if end < 0:
                    self.buf = self.buf[cut:]
                    break
                calls.append(CallDelta(self.calls - 1, done=True))
                self.buf, self.in_call, self.args = self.buf[end + len(CLOSE):], False, None
                continue
            if self.in_call:
                end = self.buf.find(CLOSE)
                if end < 0:
                    break
                block, self.buf, self.in_call = self.buf[:end], self.buf[end + len(CLOSE):], False
                self._settle(block, out, calls)
                continue
            start = self.buf.find(OPEN)
            if start >= 0:
                self._content(self.buf[:start], out)
                self.buf, self.in_call = self.buf[start + len(OPEN):], True
                continue
            keep = partial_suffix(self.buf, OPEN)
            self._content(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(out), calls

    def finish(self) -> tuple[str, list[CallDelta]]:
        """Flush at the end of the output: an unclosed call still counts if its JSON is whole
        (or, streaming, once it began)."""
        out: list[str] = []
        calls: list[CallDelta] = []
        if self.args is not None:
            calls.append(CallDelta(self.calls - 1, self.args.feed(self.buf, final=True), done=True))
            self.in_call, self.args = False, None
        elif self.in_call:
            self._settle(self.buf, out, calls)
            self.in_call = False
        else:
            self._content(self.buf, out)
        if not self.calls and self.blank:
            out.append(self.blank)  # a plain answer keeps its trailing whitespace
        self.buf = self.blank = ""
        return "".join(out), calls

    def _content(self, text: str, out: list[str]) -> None:
        if self.calls and not self.blank:
            text = text.lstrip()  # no leading blank line for text that follows a call
        stripped = text.rstrip()
        if stripped:
            out.append(self.blank + stripped)
            self.blank = text[len(stripped):]
        else:
            self.blank += text

    def _settle(self, block: str, out: list[str], calls: list[CallDelta]) -> None:
        call = self._parse(block)
        if call is None:
            self._content(OPEN + block + (CLOSE if not self.in_call else ""), out)
        else:
            self.blank = ""
            self.calls += 1
            calls.append(CallDelta.whole(self.calls - 1, call))

    def _begin(self, calls: list[CallDelta]) -> None:
        """Start streaming the call if the block has opened as one to an offered function."""
        m = HEADER.match(self.buf)
        name = streamed_name(m, self.names)
        if m is None or name is None:
            return
        self.blank = ""
        self.calls += 1
        self.args = ArgStream()
        self.buf = self.buf[m.start(2):]
        calls.append(CallDelta(self.calls - 1, "", new_call_id(), name))

    def _parse(self, block: str) -> ToolCall | None:
        """A call, or None: whatever the model wrote that is not one stays content."""
        obj = jsontext.model_json(block)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = jsontext.model_json(args)
        if not isinstance(args, dict):
            return None
        return make_call(obj["name"], args)


def call_parser(tools: list[Tool], fmt: str = "hermes", stream: bool = False) -> CallParser | TailParser:
    """The call parser for this format (`stream`: JSON calls' arguments as they come)."""
    if fmt == "hermes":
        return CallParser(tools, stream)
    return TailParser(FORMATS[fmt], {t.function.name for t in tools}, stream,
                      {t.function.name: t.function.parameters or {} for t in tools})


class Splitter:
    """One choice's text, whole or as it streams, into reasoning (with a reasoning parser),
    content and tool calls (with tools). Calls come from the content alone, so nothing
    inside a think block becomes a call. Either parser may hold text back while a tag is
    undecided (`holds`)."""

    def __init__(self, tools: list[Tool], fmt: str = "hermes", reasoning: ReasoningParserName | None = None,
                 stream: bool = False) -> None:
        self.think = ReasoningParser(reasoning) if reasoning else None
        self.parser = call_parser(tools, fmt, stream) if tools else None
        self.holds = self.think is not None or self.parser is not None

    @property
    def num_calls(self) -> int:
        return self.parser.calls if self.parser else 0

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        """(reasoning, content, calls' parts) that can be shown now; `final` flushes what
        is held. Consecutive parts of one call come out as one."""
        reasoning, calls = "", []
        if self.think is not None:
            reasoning, text = self.think.feed(text)
            if final:
                more, tail = self.think.finish()
                reasoning, text = reasoning + more, text + tail
        if self.parser is not None:
            text, calls = self.parser.feed(text)
            if final:
                tail, more = self.parser.finish()
                text, calls = text + tail, calls + more
        merged: list[CallDelta] = []
        for d in calls:
            if merged and merged[-1].index == d.index and not merged[-1].done and d.id is None:
                merged[-1].arguments += d.arguments
                merged[-1].done = d.done
            else:
                merged.append(d)
        return reasoning, text, merged

    def whole(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """A whole output's (reasoning, content, calls)."""
        reasoning, text, parts = self.feed(text, final=True)
        return reasoning, text, fold(parts)
