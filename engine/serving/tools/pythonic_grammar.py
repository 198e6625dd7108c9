"""Forcing calls in the pythonic format: an EBNF grammar for `[name(key=value, ...)]`.

xgrammar writes JSON from a JSON schema, but a pythonic call's arguments are Python
literals (`True`, `None`, single-level keyword arguments), so the schema is translated
here into a grammar of the literals Python's `ast.literal_eval` reads, which is what
the pythonic parser (tool_formats.py) does with them. The translation covers the types
tool schemas use: strings (with enum, const, minLength/maxLength), integers, numbers,
booleans, null, arrays (items, minItems/maxItems), objects (properties, required, or
any dict) and anyOf/type lists. Keywords it cannot hold the output to (pattern, format,
minimum, $ref, ...) are a 400 naming `tools` rather than a grammar that quietly lets
the model break the schema.

Properties come in the schema's order, required ones always, optional ones possibly,
as xgrammar orders JSON objects.
"""

from __future__ import annotations

import json
import keyword
from typing import Any

from engine import limits
from engine.serving.errors import bad_request
from engine.serving.openai.protocol import Tool

# Keywords that describe a value without constraining it.
_NOTES = {"title", "description", "default", "examples", "$schema", "$comment", "deprecated", "readOnly",
          "writeOnly"}
_HANDLED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
            "maxItems", "minLength", "maxLength", "anyOf"}
_BASE = r'''
string ::= "\"" char* "\""
char ::= [^"\\\r\n] | "\\" ["\\bfnrt] | "\\u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
integer ::= "-"? ("0" | [1-9] [0-9]*)
number ::= integer ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
boolean ::= "True" | "False"
any ::= string | number | boolean | "None" | anylist | anydict
anylist ::= "[" (any (", " any)*)? "]"
anydict ::= "{" (string ": " any (", " string ": " any)*)? "}"
'''


def grammar(tools: list[Tool], parallel: bool, offered: list[Tool] | None = None) -> str:
    """The grammar of one call (or, with `parallel`, one or more) to any of `tools`;
    errors point into `offered`, the request's whole list, when `tools` is part of it."""
    rules: list[str] = []
    calls = []
    for i, tool in enumerate(tools):
        fn = tool.function
        at = next((k for k, t in enumerate(offered or []) if t is tool), i)
        where = f"tools[{at}].function.parameters"
        params = fn.parameters or {"type": "object", "properties": {}}
        if params.get("type", "object") != "object" or not isinstance(params.get("properties", {}), dict):
            raise bad_request("a pythonic call's parameters must be an object schema", where)
        _check(params, where)
        for name, path in [(fn.name, f"tools[{at}].function.name"), *((k, f"{where}.properties.{k}")
                                                                       for k in params.get("properties", {}))]:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise bad_request(f"{name!r} is not a Python name, so a pythonic call cannot carry it", path)
        required = params.get("required", [])
        members = [(_lit(f"{key}="), _value(schema, f"{where}.properties.{key}", rules), key in required)
                   for key, schema in params.get("properties", {}).items()]
        rules.append(f"call{i} ::= {_lit(fn.name + '(')} {_members(members, rules)} \")\"")
        calls.append(f"call{i}")
    call = " | ".join(calls)
    root = f'"[" ({call}) (", " ({call}))* "]"' if parallel else f'"[" ({call}) "]"'
    text = "\n".join([f"root ::= {root}", *rules]) + _BASE
    if len(text) > limits.MAX_GRAMMAR_CHARS:
        raise bad_request(f"the tools' schemas make a pythonic-call grammar of {len(text)} characters; at most "
                          f"{limits.MAX_GRAMMAR_CHARS} are accepted", "tools")
    return text


def _value(schema: Any, where: str, rules: list[str]) -> str:
    """An EBNF expression for a Python literal that satisfies `schema`."""
    if schema is True or schema == {}:
        return "any"
    if not isinstance(schema, dict):
        raise bad_request("a schema must be an object", where)
    _check(schema, where)
    if "const" in schema:
        return _literal(schema["const"], where)
    if "enum" in schema:
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise bad_request("enum must be a non-empty list", where)
        return "(" + " | ".join(_literal(v, where) for v in schema["enum"]) + ")"
    if "anyOf" in schema:
        return "(" + " | ".join(_value(s, f"{where}.anyOf[{k}]", rules) for k, s in enumerate(schema["anyOf"])) + ")"
    kind = schema.get("type")
    if isinstance(kind, list):
        return "(" + " | ".join(_value({**schema, "type": t}, where, rules) for t in kind) + ")"
    if kind is None:
        return "any"
    if kind == "string":
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low == 0 and high is None:
            return "string"
        return f'("\\"" char{{{low},{"" if high is None else high}}} "\\"")'
    if kind in ("integer", "number", "boolean"):
        return kind
    if kind == "null":
        return '"None"'
    if kind == "array":
        item = _value(schema.get("items", True), f"{where}.items", rules)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if low == 0 and high is None:
            return f'("[" ({item} (", " {item})*)? "]")'
        more = f'(", " {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        return f'("[" {item} {more} "]")' if low > 0 else f'("[" ({item} {more})? "]")'
    if kind == "object":
        props = schema.get("properties")
        if not props:
            return "anydict"
        required = schema.get("required", [])
        members = [(_lit(json.dumps(k) + ": "), _value(s, f"{where}.properties.{k}", rules), k in required)
                   for k, s in props.items()]
        at = len(rules)
        name = f"obj{at}"
        rules.append("")  # its place, before the rules _members adds
        rules[at] = f'{name} ::= "{{" {_members(members, rules)} "}}"'
        return name
    raise bad_request(f"type {kind!r} cannot be written as a Python literal", where)


def _members(members: list[tuple[str, str, bool]], rules: list[str]) -> str:
    """key-value pairs in order, joined by ", ": every required one, any optional ones.
    Each alternative starts with the first pair present; none may start after a
    required pair. What may follow pair k is a rule of its own (`tail`), so the grammar
    grows linearly in the pairs: spelled out in every alternative it grew as their
    square (2,000 optional properties made 40 MB)."""
    if not members:
        return '""'
    base = f"tail{len(rules)}"
    tails = [f"{base}_{k}" for k in range(len(members) + 1)]
    for k, (key, value, req) in enumerate(members):
        rules.append(f'{tails[k]} ::= (", " {key} {value}){"" if req else "?"} {tails[k + 1]}')
    rules.append(f'{tails[-1]} ::= ""')
    alts = []
    for i, (key, value, req) in enumerate(members):
        alts.append(f"{key} {value} {tails[i + 1]}")
        if req:
            break
    else:
        alts.append('""')
    return "(" + " | ".join(alts) + ")"


def _check(schema: dict[str, Any], where: str) -> None:
    for key in schema:
        if key not in _NOTES and key not in _HANDLED:
            raise bad_request(f"the pythonic tool-call format cannot force a call whose schema uses `{key}`; "
                              "use tool_choice \"auto\"", f"{where}.{key}")
    if schema.get("additionalProperties") not in (None, False):
        raise bad_request("the pythonic tool-call format cannot force additionalProperties", where)


def _literal(value: Any, where: str) -> str:
    """A const or enum value as the Python literal the model must write."""
    if value is None or isinstance(value, bool):
        return _lit(repr(value))
    if isinstance(value, (int, float, str)):
        return _lit(json.dumps(value))  # a JSON string or number is a Python literal too
    raise bad_request("enum and const values must be strings, numbers, booleans or null", where)


def _lit(text: str) -> str:
    """EBNF's quoted literal for text."""
    return json.dumps(text)
