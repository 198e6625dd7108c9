"""Tool-call formats other than Hermes: Llama-3 JSON, Mistral, Granite, Command R, pythonic,
and the tagged-text formats of engine/serving/tools/xml_formats.py (Qwen3-Coder's, GLM-4.5's).

Each is the way a model family writes its calls, and in each the calls take the rest of
the output once they begin:

    llama3_json  {"name": "get_weather", "parameters": {"city": "Paris"}}   (";"-separated,
                 optionally after <|python_tag|>; only at the start of the output)
    mistral      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    granite      <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
    command_r    <|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather",
                 "parameters": {"city": "Paris"}}]<|END_ACTION|>    (Command R7B, Command A)
    pythonic     [get_weather(city="Paris"), get_time(zone="UTC")]          (only at the start)

TailParser holds the text back from the marker on and parses it at the end: calls that
all name offered functions with object arguments become calls, anything else stays
content, as the Hermes parser does with a block it cannot read. Streaming, the JSON
formats' calls open as soon as their names are read and their arguments follow as they
are written (JsonCallStream), as Hermes calls do.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.serving import jsontext
from engine.serving.openai.protocol import FunctionCall, ToolCall
from engine.serving.tools import xml_formats
from engine.serving.tools.argstream import ArgStream

Call = tuple[str, dict[str, Any]]
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
GRANITE_TAG = "<|tool_call|>"
COHERE_TAG, COHERE_END = "<|START_ACTION|>", "<|END_ACTION|>"


def _json_calls(text: str, args_keys: tuple[str, ...]) -> list[Call] | None:
    """JSON objects (or arrays of them) one after another, separated by ';' or ','."""
    decoder = json.JSONDecoder()
    out: list[Call] = []
    i, text = 0, text.strip()
    while i < len(text):
        if text[i] in " \n\t;,":
            i += 1
            continue
        try:
            obj, i = decoder.raw_decode(text, i)
            jsontext.check_values(obj)
        except Exception:  # noqa: BLE001 - not JSON we would hand a client (depth, NaN, ...): text
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = next((item[k] for k in args_keys if k in item), {})
            if isinstance(args, str):
                args = jsontext.model_json(args)
            if not isinstance(args, dict):
                return None
            out.append((item["name"], args))
    return out or None


def _llama3(text: str) -> list[Call] | None:
    return _json_calls(text.strip().removeprefix(PYTHON_TAG), ("parameters", "arguments"))


def _mistral(text: str) -> list[Call] | None:
    calls: list[Call] = []
    for part in text.split(MISTRAL_TAG):
        if not part.strip():
            continue
        name, sep, args = part.partition("[ARGS]")  # the v11+ spelling: name[ARGS]{...}
        if sep:
            obj = jsontext.model_json(args)
            if not isinstance(obj, dict) or not name.strip():
                return None
            calls.append((name.strip(), obj))
            continue
        got = _json_calls(part, ("arguments", "parameters"))
        if got is None:
            return None
        calls += got
    return calls or None


def _granite(text: str) -> list[Call] | None:
    calls: list[Call] = []
    for part in text.split(GRANITE_TAG):
        if part.strip():
            got = _json_calls(part, ("arguments", "parameters"))
            if got is None:
                return None
            calls += got
    return calls or None


def _command_r(text: str) -> list[Call] | None:
    """One JSON list of {"tool_call_id", "tool_name", "parameters"} up to <|END_ACTION|>."""
    body, _end, rest = text.partition(COHERE_END)
    if rest.strip():
        return None
    try:
        items = json.loads(body)
        jsontext.check_values(items)
    except Exception:  # noqa: BLE001 - not JSON we would hand a client (depth, NaN, ...): text
        return None
    if not isinstance(items, list) or not items:
        return None
    calls: list[Call] = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("tool_name"), str):
            return None
        args = item.get("parameters", {})
        if isinstance(args, str):
            args = jsontext.model_json(args)
        if not isinstance(args, dict):
            return None
        calls.append((item["tool_name"], args))
    return calls


def _command_r_render(calls: list[Call]) -> str:
    items = [{"tool_call_id": str(i), "tool_name": n, "parameters": a} for i, (n, a) in enumerate(calls)]
    return COHERE_TAG + json.dumps(items, ensure_ascii=False) + COHERE_END


def _pythonic(text: str) -> list[Call] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls: list[Call] = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if len(args) != len(node.keywords):
            return None
        calls.append((node.func.id, args))
    return calls


def _tagged_list(tag: str, calls: list[Call]) -> str:
    """Calls as Mistral and Granite write them: the tag, then one JSON list."""
    return tag + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    markers: tuple[str, ...]  # what begins the calls
    at_start: bool  # the calls can only begin the output
    parse: Callable[[str], list[Call] | None]  # the text from the marker on
    render: Callable[[list[Call]], str]  # calls as the model writes them (history, the default prompt)
    streams: bool = False  # JSON calls, whose arguments can stream as they are written (JsonCallStream)
    # arguments parsed as text, typed by the function's parameter schema (xml_formats.coerce)
    coerce: Callable[[dict[str, str], dict[str, Any]], dict[str, Any]] | None = None


FORMATS = {
    "llama3_json": ToolFormat((PYTHON_TAG, "{"), True, _llama3,
                              lambda calls: "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                                                      for n, a in calls), True),
    "mistral": ToolFormat((MISTRAL_TAG,), False, _mistral, lambda calls: _tagged_list(MISTRAL_TAG, calls), True),
    "granite": ToolFormat((GRANITE_TAG,), False, _granite, lambda calls: _tagged_list(GRANITE_TAG, calls), True),
    "command_r": ToolFormat((COHERE_TAG,), False, _command_r, _command_r_render, True),
    "pythonic": ToolFormat(("[",), True, _pythonic,
                           lambda calls: "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items())
                                                         + ")" for n, a in calls) + "]"),
    "qwen3_xml": ToolFormat((xml_formats.MARKER,), False, xml_formats.parse_qwen, xml_formats.render_qwen,
                            coerce=xml_formats.coerce),
    "glm45": ToolFormat((xml_formats.MARKER,), False, xml_formats.parse_glm, xml_formats.render_glm,
                        coerce=xml_formats.coerce),
}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class CallDelta:
    """Part of one tool call: the first part carries the call's id and name, later parts
    more of its arguments, and `done` marks the last. A call parsed whole is one part."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    done: bool = False

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> CallDelta:
        return cls(index, call.function.arguments, call.id, call.function.name, True)


def fold(deltas: list[CallDelta]) -> list[ToolCall]:
    """The calls the parts add up to, as a client joins them by index."""
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = ToolCall(id=d.id, function=FunctionCall(name=d.name or "", arguments=""))
        calls[d.index].function.arguments += d.arguments
    return list(calls.values())


def make_call(name: str, args: dict[str, Any]) -> ToolCall:
    """A parsed call as the client gets it: a fresh id, the arguments as JSON text."""
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)))


def detect(template: str | None) -> str:
    """The format a chat template teaches its model, Hermes when it says nothing."""
    t = template or ""
    if MISTRAL_TAG in t:
        return "mistral"
    if GRANITE_TAG in t:
        return "granite"
    if COHERE_TAG in t:
        return "command_r"
    if "<arg_key>" in t:  # GLM-4.5's, inside its <tool_call> blocks
        return "glm45"
    if "<function=" in t and "<parameter=" in t:  # Qwen3-Coder's and Qwen3.5's, the same
        return "qwen3_xml"
    if "<tool_call>" in t:
        return "hermes"
    if "func_name1(" in t or "[func_name(" in t:
        return "pythonic"
    if PYTHON_TAG in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


# A JSON call's opening, {"name": ..., "arguments"|"parameters": <first char>: group 1 is the
# name as written, group 2 the arguments' first character (Hermes blocks open the same way).
CALL_HEAD = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(\S)'
# Command R's, {"tool_call_id": ..., "tool_name": ..., "parameters": <first char>, the same groups.
COHERE_HEAD = (r'\{\s*(?:"tool_call_id"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*)?"tool_name"\s*:\s*"((?:[^"\\]|\\.)*)"'
               r'\s*,\s*"parameters"\s*:\s*(\S)')
# Before it, separators and markers; or Mistral's v11 spelling, name[ARGS]<first char>.
_SKIP = r'(?:\s|[;,\[\]}]|' + "|".join(map(re.escape, (PYTHON_TAG, MISTRAL_TAG, GRANITE_TAG, COHERE_TAG))) + ")*"
_HEADS = (re.compile(_SKIP + CALL_HEAD), re.compile(_SKIP + r'([A-Za-z_][\w.\-]*)\[ARGS\]\s*(\S)'),
          re.compile(_SKIP + COHERE_HEAD))


def streamed_name(head: re.Match[str] | None, names: set[str]) -> str | None:
    """The offered function a call's opening names, when its arguments open as an object
    (what can stream); None otherwise."""
    if head is None or head.group(2) != "{":
        return None
    name = jsontext.model_json(f'"{head.group(1)}"')
    return name if name in names else None


class JsonCallStream:
    """The calls of a JSON format (llama3_json, mistral) as they are written: each opens
    once its name is read and its arguments stream through an ArgStream, as Hermes calls
    do (tools.CallParser). It reads the held text from `pos` on; a call that breaks off
    or stops being JSON ends there, and nothing after it is read."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.pos = 0
        self.args: ArgStream | None = None
        self.calls = 0
        self.stopped = False

    def read(self, buf: str, final: bool) -> list[CallDelta]:
        parts: list[CallDelta] = []
        while not self.stopped:
            if self.args is not None:
                text, self.pos = buf[self.pos:], len(buf)
                more = self.args.feed(text, final)
                if more:
                    parts.append(CallDelta(self.calls - 1, more))
                if not (self.args.done or self.args.broken or final):
                    break
                self.pos -= len(self.args.rest) if self.args.done else 0
                self.stopped = not self.args.done
                parts.append(CallDelta(self.calls - 1, done=True))
                self.args = None
                continue
            m = next((m for h in _HEADS if (m := h.match(buf, self.pos))), None)
            name = streamed_name(m, self.names)
            if name is None:
                break
            self.calls += 1
            self.args, self.pos = ArgStream(), m.start(2)
            parts.append(CallDelta(self.calls - 1, "", new_call_id(), name))
        return parts


class TailParser:
    """feed/finish/calls as tools.CallParser, for a format whose calls take the rest of
    the output: text before the marker is content, the rest is held and parsed at the end.
    With `stream`, a JSON format's calls stream as they are written (JsonCallStream);
    once one has, the held text is read that way to the end rather than parsed whole."""

    def __init__(self, fmt: ToolFormat, names: set[str], stream: bool = False,
                 schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.fmt = fmt
        self.names = names
        self.schemas = schemas or {}  # each function's parameters, for a format whose arguments are text
        self.buf = ""
        self.holding = False
        self.decided = False  # an at-start format has seen text that is not a marker: plain content now
        self.reader = JsonCallStream(names) if stream and fmt.streams else None
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        out, parts = self._content(text), []
        if self.holding and self.reader is not None:
            parts = self.reader.read(self.buf, False)
            self.calls = self.reader.calls
        return out, parts

    def _content(self, text: str) -> str:
        """What can be shown now; from the marker on, the text is held."""
        self.buf += text
        if self.holding:
            return ""
        if self.decided:
            out, self.buf = self.buf, ""
            return out
        if self.fmt.at_start:
            head = self.buf.lstrip()
            if not head or any(m.startswith(head) for m in self.fmt.markers):
                return ""  # undecided: whitespace, or a marker's beginning
            if any(head.startswith(m) for m in self.fmt.markers):
                self.holding = True
                return ""
            self.decided = True
            out, self.buf = self.buf, ""
            return out
        [marker] = self.fmt.markers
        at = self.buf.find(marker)
        if at >= 0:
            out, self.buf, self.holding = self.buf[:at], self.buf[at:], True
            return out
        keep = partial_suffix(self.buf, marker)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def finish(self) -> tuple[str, list[CallDelta]]:
        text, self.buf = self.buf, ""
        if not self.holding:
            return text, []
        if self.reader is not None and self.reader.calls:
            parts = self.reader.read(text, True)
            self.calls = self.reader.calls
            return "", parts
        parsed = self.fmt.parse(text if self.fmt.at_start else text[len(self.fmt.markers[0]):])
        if parsed is None or any(name not in self.names for name, _ in parsed):
            return text, []
        if self.fmt.coerce is not None:
            parsed = [(name, self.fmt.coerce(args, self.schemas.get(name, {}))) for name, args in parsed]
        self.calls += len(parsed)
        return "", [CallDelta.whole(i, make_call(name, args)) for i, (name, args) in enumerate(parsed)]


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
