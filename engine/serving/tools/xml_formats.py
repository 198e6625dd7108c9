"""Tool-call formats whose arguments are tagged text, not one JSON object:

    qwen3_xml  <tool_call>
               <function=get_weather>
               <parameter=city>
               Paris
               </parameter>
               </function>
               </tool_call>                     (Qwen3-Coder, Qwen3.5)
    glm45      <tool_call>get_weather
               <arg_key>city</arg_key>
               <arg_value>Paris</arg_value>
               </tool_call>                     (GLM-4.5, 4.6, 4.7)

Their chat templates write a string argument as it is and any other value as JSON, so a
value read back is text until the function's schema says what it is (`coerce`): a
string-typed parameter keeps its text, any other is read as JSON where it parses. Calls
follow one another, whitespace between; anything else in the held text leaves it all
content, as with the other formats.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from engine.serving import jsontext

Raw = tuple[str, dict[str, str]]  # a call's name and its arguments' text
MARKER = "<tool_call>"

QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
QWEN_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
GLM_CALL = re.compile(r"<tool_call>([^<\n]+)(.*?)</tool_call>", re.S)
GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _tiled(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Every match of `pattern` in `text`, when only whitespace lies between and around
    them; None otherwise (or when there is none)."""
    found, at = [], 0
    for m in pattern.finditer(text):
        if text[at:m.start()].strip():
            return None
        found.append(m)
        at = m.end()
    return found if found and not text[at:].strip() else None


def _one_newline(value: str) -> str:
    """Qwen's template puts each value on lines of its own: one newline either side is
    the layout, not the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _parse(call_re: re.Pattern[str], arg_re: re.Pattern[str], text: str,
           value: Callable[[str], str] = str) -> list[Raw] | None:
    """The calls from the first one's marker on (TailParser hands over the text after
    it): each call's name and its arguments' text, or None where the text is not calls."""
    calls = _tiled(call_re, MARKER + text)
    if calls is None:
        return None
    out = []
    for call in calls:
        args = _tiled(arg_re, call[2]) if call[2].strip() else []
        if args is None:
            return None
        out.append((call[1].strip(), {a[1].strip(): value(a[2]) for a in args}))
    return out


def parse_qwen(text: str) -> list[Raw] | None:
    return _parse(QWEN_CALL, QWEN_PARAM, text, _one_newline)


def parse_glm(text: str) -> list[Raw] | None:
    return _parse(GLM_CALL, GLM_PAIR, text)


def _text(value: Any) -> str:
    """A value as the templates write it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def render_qwen(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"<tool_call>\n<function={name}>\n"
                     + "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in args.items())
                     + "</function>\n</tool_call>" for name, args in calls)


def render_glm(calls: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join(f"<tool_call>{name}\n"
                     + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n" for k, v in args.items())
                     + "</tool_call>" for name, args in calls)


def _types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (its `type`, or its anyOf/oneOf
    branches'); empty where it does not say."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return {t for branch in schema.get("anyOf", []) + schema.get("oneOf", []) for t in _types(branch)}


def coerce(args: dict[str, str], parameters: dict[str, Any]) -> dict[str, Any]:
    """Each argument's text as the value the function's schema asks for: kept as text
    where the parameter is a string; otherwise read as JSON, or, where it is not JSON a
    client should get (the server's own checks: depth, size, NaN), kept as text without
    the whitespace around it, which is layout there (the grammar lets a forced call put
    a little on either side of any value it does not type as a string)."""
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    props = props if isinstance(props, dict) else {}
    out: dict[str, Any] = {}
    for key, text in args.items():
        if "string" in _types(props.get(key)):
            out[key] = text
        elif text.strip() == "null":
            out[key] = None
        else:
            value = jsontext.model_json(text)
            out[key] = text.strip() if value is None else value
    return out
