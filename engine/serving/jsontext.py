"""JSON from clients, bounded: request bodies and the JSON text carried inside them.

Python's json module recurses, so text nested a few thousand deep raises RecursionError,
which no `except ValueError` catches; what parses must also stay shallow enough for
everything downstream (xgrammar compiles a schema in the engine core, on the step loop,
so a deep schema would stall every request). One rule serves the body and the JSON
strings inside it (tool-call arguments, schemas sent as text): at most MAX_DEPTH levels,
finite numbers, integers within 64 bits, and strings that are valid Unicode.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from engine.serving.errors import APIError, bad_request

MAX_DEPTH = 64  # deeper than any real request (a JSON schema included), and far from RecursionError
MAX_NODES = 1 << 20  # values in one document: 8 MiB of "[0,0,...]" holds four million
OFF_LOOP_BYTES = 256 << 10  # bodies larger than this are parsed on a worker thread (loads_async)
INT64 = range(-(2**63), 2**63)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def loads(text: str | bytes, field: str | None = None, what: str = "the request body") -> Any:
    """Parse and check `text`; a 400 naming `field` when it is not JSON this server takes."""
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        raise bad_request(f"{what} is nested deeper than {MAX_DEPTH} levels", field) from None
    except ValueError as exc:  # bad JSON, bad UTF-8, NaN or Infinity
        raise bad_request(f"{what} is not valid JSON: {exc}", field) from None
    try:
        check_values(data)
    except APIError as exc:  # a path inside JSON text is not in the client's document: name the field
        if field is not None:
            exc.detail.param = field
        raise
    return data


def check_values(data: Any) -> None:
    """Refuse what JSON can carry but nothing downstream should see: nesting past MAX_DEPTH,
    more than MAX_NODES values, numbers too large for any field (1e400 parses as
    infinity), and strings that are not Unicode (a lone surrogate escape such as "\\ud800"
    cannot be encoded, tokenized or echoed).

    Linear in time and memory: each node on the stack keeps a link to its parent and its
    key, and the path is spelled out only for the node that fails. Spelling it for every
    node cost len(key) x len(list) bytes under a long key (a 257 KiB body peaked at 50 MB)."""
    stack: list[_Node] = [(data, 0, None, None)]
    seen = 0
    while stack:
        entry = stack.pop()
        node, depth = entry[0], entry[1]
        seen += 1
        if seen > MAX_NODES:
            raise bad_request(f"the request holds more than {MAX_NODES} JSON values", None)
        if depth > MAX_DEPTH:
            raise bad_request(f"the request is nested deeper than {MAX_DEPTH} levels", _path(entry))
        if isinstance(node, dict):
            for k, v in node.items():
                _check_str(k, entry)
                stack.append((v, depth + 1, entry, k))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, entry, i) for i, v in enumerate(node))
        elif isinstance(node, str):
            _check_str(node, entry)
        elif isinstance(node, float) and not math.isfinite(node):
            raise bad_request("numbers must be finite", _path(entry))
        elif isinstance(node, int) and not isinstance(node, bool) and node not in INT64:
            raise bad_request("integers must fit in 64 bits", _path(entry))


# (value, depth, parent entry, key or index in the parent): a path kept as links, not text
_Node = tuple[Any, int, "Any", "str | int | None"]
MAX_PATH_CHARS = 256  # a key may be megabytes long: an error names a short path


def _path(entry: _Node) -> str | None:
    """The failing node's path, e.g. messages[0].content, built only when raising."""
    parts: list[str] = []
    while entry is not None and entry[2] is not None:
        key = entry[3]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
        entry = entry[2]
    path = "".join(reversed(parts)).lstrip(".")
    if len(path) > MAX_PATH_CHARS:
        path = path[:MAX_PATH_CHARS] + "..."
    return path or None


def _check_str(s: str, entry: _Node) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("strings must be valid Unicode (a lone surrogate is not)", _path(entry)) from None


async def loads_async(text: bytes, field: str | None = None, what: str = "the request body") -> Any:
    """`loads`, on a worker thread when the text is large: parsing and checking megabytes
    takes long enough for the event loop's other requests to notice (7 MiB of chat
    messages 0.28 s, 5 MiB of numbers 2.7 s, on the AVX2 VM of benchmarks/LOG.md)."""
    if len(text) <= OFF_LOOP_BYTES:
        return loads(text, field, what)
    return await asyncio.to_thread(loads, text, field, what)


def model_json(text: str) -> Any:
    """JSON the model wrote, or None where it is not JSON we would hand a client: the
    model's output is data, and text that does not parse stays text."""
    try:
        data = json.loads(text, parse_constant=_no_constants)
        check_values(data)
    except Exception:  # noqa: BLE001 - ValueError, RecursionError and the 400s above alike
        return None
    return data
